"""The prompts' pass (prefill) of the GPT over its paged KV cache: eager, or one compiled graph for every shape.

A prefill group is B right-padded prompts of T tokens, each from its own first position on (the positions before
it are cached blocks it shares: server/engine/kv_blocks.py), written into the blocks of its table
(GPTRunner.prefill). B, T, the tables' width and the pools' size are compiled dynamic, so one graph serves every
group; every layer's pools have the one size, so the graph is built regionally (one block for all layers, over the
eager model's prepacked layers: no copy of the weights, seconds to build, cached), or whole where a regional build
fails.
Compiled, a prefill is faster than eager for one prompt and for a group (docs/BENCHMARKS.md). On CUDA the prompts
stay eager: its graphs run through dynamo, which specialises a dimension of size 1 and would recompile for a lone
prompt on the request path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.gpt import GPT
from models.kv_cache import PagedKVCache
from server.execution.decoder.step import SCRATCH_BLOCKS, DecodeStep, forward_over, scratch_pools

# (ids (B, T), positions (B, T), last (B,), table (B, N), steer_rows (B,), steers (S, n_layer, C), *pools) ->
# next-token logits (B, vocab); writes the prompts' keys and values at their positions, through the tables
PromptFn = Callable[..., torch.Tensor]

EXAMPLE_ROWS, EXAMPLE_TOKENS = 2, 24  # the scratch group a graph is traced on (sizes of 0 and 1 would specialise)


def prompt_pass(model: GPT) -> PromptFn:
    """The prefill as a plain function of tensors (the form every compiler takes)."""

    forward = forward_over(model)

    def prefill(
        ids: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        table: torch.Tensor,
        steer_rows: torch.Tensor,
        steers: torch.Tensor,
        *pools: torch.Tensor,
    ) -> torch.Tensor:
        """-> the logits after each row's last prompt token (B, vocab)."""
        return forward(ids, positions, table, pools, logits_at=last, steering=(steer_rows, steers))[:, 0]

    return prefill


class PromptPass:
    """The GPT's prefill, compiled once (bucket None: any rows, any prompt length) where the device allows it."""

    def __init__(self, step: DecodeStep) -> None:
        """Over the decode step's models (plain and prepacked) and cache, with its rounding dtype."""
        self.step = step
        self.device = step.device
        self.dtype, self.check_rounding = step.dtype, step.check_rounding  # its kernels, its check's tolerance
        self.weights_bytes = step.weights_bytes
        self.cache = step.cache
        self.vocab_size = step.vocab_size
        self.model, self.regional_model = step.model, step.regional_model  # what each function below reads
        self.traced = prompt_pass(step.model)  # what the compiler traces whole and checks against
        self.regional = prompt_pass(step.regional_model)  # its blocks one region (regional.py)
        self.uncompiled = prompt_pass(step.eager_model)  # the prepacked copy's (prepacked.py)
        # None -> the compiled pass: written by the background compiler (server/execution/compiler.py,
        # BackgroundCompiler.run) when its graph is built and checked; read by __call__ on the compute thread
        # (GPTRunner.prefill), which runs eagerly until then and for one-token prompts
        self.compiled: dict[None, PromptFn] = {}

    def buckets(self) -> list[None]:
        """The one graph to build, where it can be called without dynamo (the CPU's graphs)."""
        return [None] if self.device.type == "cpu" else []

    def matmul_rows(self, bucket: None) -> None:
        return None  # any: a dynamic dimension

    def example(self, bucket: None) -> tuple[torch.Tensor, ...]:
        """Scratch inputs strided as a live group's (right_padded's ids, positions and tables), over a scratch
        pool; the group and prompt sizes, the tables' width and the pool's size dynamic."""
        B, T = EXAMPLE_ROWS, EXAMPLE_TOKENS
        generator = torch.Generator(device=self.device).manual_seed(0)
        ids = torch.randint(self.vocab_size, (B, T), generator=generator, device=self.device)
        positions = torch.arange(T, device=self.device).expand(B, T) + 16  # after a cached block (contiguous)
        last = torch.tensor([T - 1, T // 2], device=self.device)
        width = -(-(T + 16) // 16)
        table = torch.arange(B * width, device=self.device).view(B, width) % (SCRATCH_BLOCKS - 1) + 1
        pools = scratch_pools(self.step.model, SCRATCH_BLOCKS).tensors()
        steer_rows = torch.tensor([1, 0], device=self.device)  # a steered and a plain prompt
        for t in (ids, positions, table):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        for t in (last, steer_rows):
            torch._dynamo.mark_dynamic(t, 0)
        for t in pools:
            torch._dynamo.mark_dynamic(t, 0)
        return ids, positions, last, table, steer_rows, self.step.steering.scratch(), *pools

    def real_inputs(self, bucket: None) -> tuple[torch.Tensor, ...]:
        """A real group's inputs (compiler.py's check): two prompts of the check's text, right-padded."""
        lengths = [EXAMPLE_TOKENS, EXAMPLE_TOKENS // 2 + 1]
        B, T = len(lengths), max(lengths)
        ids = torch.tensor([self.step.check_tokens(5 * row, T) for row in range(B)], device=self.device)
        positions = torch.arange(T, device=self.device).expand(B, T).contiguous()  # as prompt_group makes them
        last = torch.tensor(lengths, device=self.device) - 1
        width = -(-T // 16)
        table = torch.arange(B * width, device=self.device).view(B, width) + 1
        plain, steers = torch.zeros(B, dtype=torch.long, device=self.device), self.step.steering.scratch()
        return ids, positions, last, table, plain, steers, *scratch_pools(self.step.model, B * width + 1).tensors()

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        cache: PagedKVCache,
        steer_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (B, vocab) after each row's `last` token; the prompts' keys and values written through the
        cache's tables (B, N >= 2), each row steered by its row of the steering table (B,). A one-token prompt runs
        eagerly (the graph was traced for T > 1)."""
        compiled = self.compiled.get(None)
        fn = compiled if compiled is not None and ids.shape[1] > 1 else self.uncompiled
        return fn(ids, positions, last, cache.table, steer_rows, self.step.steering.vectors, *cache.tensors())
