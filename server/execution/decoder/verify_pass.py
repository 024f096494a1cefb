"""The GPT's draft check: one sequence's pending token and the draft tokens after it in one pass over its blocks
of the paged KV cache, with the greedy choice after each (speculative decoding's verification,
server/engine/speculation.py).

A one-row decode step reads every weight to make one token; this pass reads them once for VERIFY_TOKENS tokens,
so each draft token the model agrees with is a step saved. Its products have VERIFY_TOKENS rows, within the C++
GEMM template's (kernel_choice.py, TEMPLATE_GEMM_MAX_ROWS) or, in bf16, the skinny kernel's (skinny_gemm.py:
then it is built regionally, as the decode step); its attention is SDPA's one op, since the explicit
product's batched matmul of several queries has no template choice (inductor raised NoValidChoicesError, and
the build fell back to MKL's products, the slowest on AVX2 CPUs: docs/BENCHMARKS.md, "Why these paths"). One
graph, the key columns dynamic as the decode step's, built on the CPU after the decode buckets; until it is built
(and on CUDA, where it is not) the runner has no draft check and the engine decodes step by step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from models.gpt import GPT
from models.sampling import greedy_choice
from server.execution.decoder.step import (
    COLUMN_STEP,
    SCRATCH_BLOCKS,
    DecodeStep,
    check_lengths,
    forward_over,
    scratch_pools,
)
from server.execution.packaged import WholePass

VERIFY_TOKENS = 4  # the pending token and up to 3 drafts: the template's rows, and 8 at most a schedule

# (tokens (1, T), positions (1, T), eos_bias (1, T), table (1, N), *pools) -> (greedy (T,), logprobs (T,),
# logits (T, vocab)); writes the T tokens' keys and values at their positions, through the table
VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def verify_pass(model: GPT) -> VerifyFn:
    """The draft check as a plain function of tensors (the form every compiler takes)."""
    eos_id = model.config.eos_token_id
    forward = forward_over(model)

    def verify(
        tokens: torch.Tensor, positions: torch.Tensor, eos_bias: torch.Tensor, table: torch.Tensor, *pools: torch.Tensor
    ):
        """-> the greedy token after each of the T tokens (T,), its logprob (T,), the logits (T, vocab)."""
        logits = forward(tokens, positions, table, pools)[0]
        return *greedy_choice(logits, eos_bias[0], eos_id), logits

    return verify


class VerifyPass:
    """The draft check of one sequence, over the decode step's models and pool; compiled once."""

    BUCKET = (1, VERIFY_TOKENS)  # (rows, tokens): a key of its own among the compiler's buckets

    def __init__(self, step: DecodeStep) -> None:
        self.step = step  # its cache, context and column buckets
        self.device = step.device
        self.dtype, self.check_rounding = step.dtype, step.check_rounding  # its kernels, its check's tolerance
        self.weights_bytes = step.weights_bytes
        self.model = step.model  # whose weights the export freezes
        self.traced = verify_pass(step.model)  # what the compiler traces and checks against
        self.regional_model = step.regional_model  # its blocks one compile region (regional.py)
        self.regional = verify_pass(step.regional_model)
        self.uncompiled = verify_pass(step.eager_model)
        # BUCKET -> the compiled pass: written by the background compiler (server/execution/compiler.py,
        # BackgroundCompiler.run) when its graph is built and checked; read by __call__ on the compute thread
        # (GPTRunner.verify, for server/engine/speculation.py), which returns None until then: no draft check
        self.compiled: dict[tuple[int, int], VerifyFn] = {}
        self._inputs = (
            torch.zeros((1, VERIFY_TOKENS), dtype=torch.long, device=self.device),  # tokens
            torch.zeros((1, VERIFY_TOKENS), dtype=torch.long, device=self.device),  # positions
            torch.zeros((1, VERIFY_TOKENS), device=self.device),  # EOS bias
            torch.zeros((1, step.table_width), dtype=torch.long, device=self.device),  # the block table
        )
        self._arrays = tuple(t.numpy() for t in self._inputs) if self.device.type == "cpu" else ()
        self._views: dict[int, torch.Tensor] = {}  # N -> the table's first N blocks

    def buckets(self) -> list[tuple[int, int]]:
        """The one graph to build, on the CPU (CUDA's steps are graphs replayed per shape: not built there)."""
        return [self.BUCKET] if self.device.type == "cpu" else []

    def matmul_rows(self, bucket: tuple[int, int]) -> int:
        return bucket[0] * bucket[1]

    def freezes(self, bucket: tuple[int, int]) -> bool:
        """Whether the pass is built whole and frozen (its products in the C++ GEMM template), else regionally."""
        return self.step.freezes(self.matmul_rows(bucket))  # the decode step's rule, at the pass's rows

    def example(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Scratch inputs strided as the live ones (a view of the table's first blocks), over a scratch pool; the
        table's width and the pool's size dynamic."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        _, columns = self.step.bucket(1, self.step.compiled_columns // 2 + 1)
        blocks = columns // COLUMN_STEP
        pools = scratch_pools(self.step.model, SCRATCH_BLOCKS).tensors()
        named = torch.arange(blocks, device=self.device).view(1, blocks) % (SCRATCH_BLOCKS - 1) + 1
        table = self.step.table_like(named, blocks)
        torch._dynamo.mark_dynamic(table, 1, min=2, max=max(2, self.step.compiled_columns // COLUMN_STEP))
        for t in pools:
            torch._dynamo.mark_dynamic(t, 0)
        tokens = torch.randint(self.step.vocab_size, (1, VERIFY_TOKENS), generator=generator, device=self.device)
        positions = torch.arange(VERIFY_TOKENS, device=self.device).view(1, -1) + columns // 2
        return tokens, positions, torch.zeros((1, VERIFY_TOKENS), device=self.device), table, *pools

    def exported(self, bucket: tuple[int, int]) -> tuple[WholePass, tuple[torch.Tensor, ...], tuple]:
        """The whole pass as torch.export takes it (server/execution/packaged.py): over the plain model, on
        scratch inputs, its dynamic sizes the table's width and the pool's size."""
        example = self.example(bucket)
        blocks = torch.export.Dim("blocks", min=2, max=max(2, self.step.compiled_columns // COLUMN_STEP))
        pool = COLUMN_STEP * torch.export.Dim("pool_blocks", min=2)  # whole blocks
        pools = [{0: pool}] * len(example[4:])
        return WholePass(self.step.model, self.traced), example, (None, None, None, {1: blocks}, *pools)

    def real_inputs(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """A real draft check's inputs (compiler.py's check): a prompt of the check's text, its next tokens of that
        text to check."""
        (length,) = check_lengths(1, self.step.context)
        cache, _ = self.step.prefilled([length])
        tokens = torch.tensor([self.step.check_tokens(length, VERIFY_TOKENS)], device=self.device)
        positions = torch.arange(length, length + VERIFY_TOKENS, device=self.device).view(1, -1)
        _, columns = self.step.bucket(1, length + VERIFY_TOKENS)
        table = self.step.table_like(cache.table, columns // COLUMN_STEP)
        return tokens, positions, torch.zeros((1, VERIFY_TOKENS), device=self.device), table, *cache.tensors()

    def logits(self, output: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return output[2]

    def __call__(
        self, tokens: list[int], position: int, eos_bias: list[float], table: list[int]
    ) -> tuple[list[int], list[float]] | None:
        """The greedy token (its EOS bias applied) after each of tokens (VERIFY_TOKENS of them, the first at
        `position` of the sequence whose block table this is) and its logprob; their keys and values written.
        None until the pass is compiled."""
        compiled = self.compiled.get(self.BUCKET)
        _, columns = self.step.bucket(1, position + VERIFY_TOKENS)
        if compiled is None or columns > self.step.compiled_columns:
            return None
        tok, pos, bias, blocks = self._arrays
        tok[0] = tokens
        pos[0] = np.arange(position, position + VERIFY_TOKENS)
        bias[0] = eos_bias
        blocks[0, : len(table)] = table
        n = columns // COLUMN_STEP
        if n not in self._views:
            self._views[n] = self._inputs[3][:, :n]
        greedy, logprobs, _ = compiled(*self._inputs[:3], self._views[n], *self.step.cache.tensors())
        return greedy.tolist(), logprobs.tolist()
