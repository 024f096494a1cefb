"""One decode step of the GPT over its paged KV cache: eager, or compiled per batch-size bucket.

The model's keys and values live in one `PagedKVCache` pool (models/kv_cache.py) whose blocks the engine hands out
(server/engine/kv_blocks.py); a step takes each row's block table. A step over n rows whose longest has p tokens runs on
b rows (b in 1, 2, 4, ... max rows, padding rows included, their tables the null block) and reads the first N blocks of
each table, N * 16 = p rounded up (at least two blocks: a dimension of size 1 would be specialised). One compiled graph
serves each b for every N: the table's width is compiled dynamic (and the pool's size, so that the compiler traces and
checks on small scratch pools), so a model builds 6 graphs instead of one per (b, N) shape. Inputs are preallocated
tensors written in place, which is what a compiled graph needs, and on CUDA the graph captured per (b, N) shape
(server/execution/decoder/cuda_graphs.py). Until a b's compiled step is ready (server/execution/compiler.py builds them
off the request path), the step runs on a larger built bucket (`padding_limit`) or eagerly (on the CPU in bf16 with
prepacked linear layers: server/execution/decoder/prepacked.py). The step takes the pools as arguments rather than
reading the model's cache attribute: a compiler freezing the weights must see the cache as inputs it mutates, not as
constants; every layer's pools have the one size and the table is shared, so a regional build traces one block and
reuses it for all."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from model_store import GPT
from models.kv_cache import BLOCK_TOKENS, PagedKVCache, blocks_for
from models.quantize import WeightOnlyInt8Linear
from models.sampling import greedy_choice
from server.execution import group_gemm
from server.execution.decoder.cuda_graphs import CUDAGraphs
from server.execution.decoder.prepacked import prepacked_copy
from server.execution.decoder.regional import regional_copy
from server.execution.decoder.step_inputs import StepInputs, pinned_like
from server.execution.graph_call import distinct_tensors
from server.execution.kernel_choice import template_serves
from server.execution.packaged import WholePass
from server.execution.passes import buckets
from server.execution.runner import DecodeRows, StepOutput
from server.execution.steering import SteeringTable

# (tokens (b, 1), positions (b, 1), eos_bias (b,), allowed (b, vocab) bool, table (b, N) block ids, steer_rows (b,),
#   steers (S, n_layer, C), *pools (blocks * 16, *, width)) -> (greedy tokens (b,), their logprobs (b,), logits
#   (b, vocab)); writes the tokens' keys and values at their positions, reads each row's first N * 16
StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


COLUMN_STEP = BLOCK_TOKENS  # a step reads its longest row's columns rounded up to whole blocks
# The most columns a compiled step reads: inductor's CPU code sums more than 4096 floats in chunks, a choice it makes
# by the size, which a graph for every column count cannot make (its build fails); longer rows' steps run eagerly
COMPILED_COLUMNS = 4096

# What the compiler's check runs a built pass on (server/execution/step_check.py): prompts of real
# text, as a request gives them, whose statistics scratch inputs lack (a random cache gave a real model's steps
# differences its requests never see)
CHECK_TEXT = (
    "The history of the city begins in the early Middle Ages, when a small market grew up beside the river. Its "
    "first charter was granted in 1172, and by the fourteenth century it had a cathedral, two abbeys and a stone "
    "bridge. Once upon a time, a little girl named Lily found a shiny red ball in the park. She was very happy and "
    'ran home to show her mother, who smiled and said: "Let us play together after dinner."'
)


def forward_over(model: GPT, **options) -> Callable[..., torch.Tensor]:
    """The one call of the model behind every pass (the decode step, the prompts' pass, the draft check):
    forward(ids (B, T), positions (B, T), table (B, N), pools, logits_at=None, steering=None) -> logits (B, T or 1,
    vocab), the ids' keys and values written into the rows' blocks. steering: (steer_rows (B,), steers (S, n_layer,
    C)), each row's vectors a row of the steering table (server/execution/steering.py; row 0 zeros: a plain row).
    Each pass is this call and a head that makes what it returns."""

    def forward(ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, pools, logits_at=None, steering=None):
        cache = PagedKVCache.from_tensors(pools, model.config.n_layer).rows(table)
        steer = steering[1][steering[0]] if steering is not None else None  # (B, n_layer, C)
        # forward, not __call__: the compute thread's guard hook is for callers, not for a compiler's trace
        return model.forward(ids, input_pos=positions, cache=cache, logits_at=logits_at, steer=steer, **options).logits

    return forward


def eager_step(model: GPT, fused_attention: bool) -> StepFn:
    """The decode step as a plain function of tensors (the form every compiler takes).

    fused_attention: SDPA's one op (eager: quicker than the explicit product's several ops), or the explicit
    product (compiled: inductor fuses it into the step, where SDPA's CPU flash kernel is slower; docs/BENCHMARKS.md,
    "Why these paths").

    The greedy choice is made on the graph (gpt-fast's sampling inside the step): the EOS logit gets
    each row's bias (-inf before min_new_tokens), a constrained row's disallowed tokens are masked out
    (structured output: server/features/constraints.py), then argmax, with the token's logprob under the model.
    Only those cross to Python for a greedy row; the logits are there for the rows the batch sampler
    handles.
    """
    eos_id = model.config.eos_token_id
    forward = forward_over(model, fused_attention=fused_attention)

    def step(
        tokens: torch.Tensor,
        positions: torch.Tensor,
        eos_bias: torch.Tensor,
        allowed: torch.Tensor,
        table: torch.Tensor,
        steer_rows: torch.Tensor,
        steers: torch.Tensor,
        *pools: torch.Tensor,
    ):
        """-> greedy tokens (b,), their logprobs (b,), the logits (b, vocab)."""
        logits = forward(tokens, positions, table, pools, steering=(steer_rows, steers))[:, -1]  # (b, vocab)
        return *greedy_choice(logits, eos_bias, eos_id, allowed), logits

    return step


def compile_order(row_buckets: list[int], max_rows: int) -> list[int]:
    """The row buckets of at most max_rows rows: the smallest (the most used at low load), the largest (full
    load), then the rest. Until a bucket is built, its steps may run padded on a larger built one
    (`DecodeStep.padding_limit`), so two builds serve most loads compiled while the others, slow to build for
    a many-layer model, follow (docs/BENCHMARKS.md, "Compiling")."""
    order = [b for b in row_buckets if b <= max_rows]
    return order[:1] + order[-1:] + order[1:-1] if len(order) > 2 else order


def rounding_dtype(model: GPT) -> torch.dtype:
    """The coarsest dtype the step's products round to (bf16 where int8 layers give their kernel bf16 activations)."""
    dtypes = {next(model.parameters()).dtype}
    dtypes |= {m.kernel_dtype for m in model.modules() if isinstance(m, WeightOnlyInt8Linear)}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def check_lengths(rows: int, context: int) -> list[int]:
    """Prompt lengths for `rows` rows of the check: 8 to 24 tokens, unequal (so rows read different columns)."""
    return [min(8 + 7 * i % 17, context // 2) for i in range(rows)]


SCRATCH_BLOCKS = 11  # a traced pass's scratch pool (its size a dynamic dimension: none of the others' sizes)


def scratch_pools(model: GPT, blocks: int) -> PagedKVCache:
    """A small zeroed pool shaped as the live one but for its size (the graphs take any: a dynamic dimension)."""
    p = next(model.parameters())
    return PagedKVCache.empty([b.attn.cache_shapes() for b in model.blocks], blocks, p.dtype, p.device)


class DecodeStep:
    def __init__(
        self, model: GPT, max_rows: int, check_ids: list[int] | None = None, blocks: int | None = None
    ) -> None:
        """check_ids: the check's text's tokens (CHECK_TEXT, by the checkpoint's tokenizer); without a tokenizer,
        ids spread over the vocabulary. blocks: the pool's (the null block included); default: every row's whole
        context."""
        self.model = model
        vocab = model.config.vocab_size
        self.check_ids = check_ids or [(7 + 131 * i) % vocab for i in range(64)]
        self.max_rows = max_rows
        self.row_buckets = buckets(max_rows)
        self.context = model.config.context_length
        self.compiled_columns = min(self.context, COMPILED_COLUMNS)  # the longest a compiled step reads
        self.device = next(model.parameters()).device
        self.dtype = rounding_dtype(model)  # chooses the compiled step's kernels
        self.check_rounding = torch.int8 if group_gemm.in_use(model) else self.dtype  # the check's: int8 activations
        # all a step reads (a quantized layer's codes too, which linear_bytes does not count): picks frozen graphs
        self.weights_bytes = sum(t.nbytes for t in distinct_tensors(model))
        # what runs uncompiled (prefills, and a bucket until its compiled step is ready); the compiler
        # traces the plain model's step
        self.eager_model = prepacked_copy(model)
        self.uncompiled = eager_step(self.eager_model, fused_attention=True)
        self.max_blocks = blocks_for(self.context)  # the most a row's table names
        # the tables' width, one spare column (two at least): every view of N <= max_blocks blocks is then strided
        # alike; a view of the whole buffer would be contiguous, and a graph built for the others would not take it
        self.table_width = max(2, self.max_blocks) + 1
        with torch.inference_mode():  # as every step runs: the compiled graphs' guards check the dispatch keys
            self.cache = scratch_pools(model, blocks or max_rows * self.max_blocks + 1)
            self.steering = SteeringTable(model.config.n_layer, model.config.d_model, max_rows, self.device)
        # what the compiler traces, and what its graphs are checked against (run eagerly, the same kernels): the
        # plain model as one whole graph (frozen on the CPU), or regionally (regional.py):
        # the blocks built once for all layers, the weights graph inputs (the eager model's, prepacked on the CPU):
        # much quicker to build than one whole graph of a many-layer model
        self.traced = eager_step(model, fused_attention=False)
        self.regional_model = regional_copy(self.eager_model)
        self.regional = eager_step(self.regional_model, fused_attention=False)
        # rows -> compiled step (any columns): written by the background compiler (server/execution/compiler.py,
        # BackgroundCompiler.run) when a bucket's graph is built and checked (a frozen one replaces the regional
        # one); read by __call__ on the compute thread (GPTRunner.decode), which runs a bucket without one on a
        # larger built bucket within padding_limit, or eagerly
        self.compiled: dict[int, StepFn] = {}
        self.graphs = CUDAGraphs() if self.device.type == "cuda" else None  # per (rows, columns), on CUDA
        # how many times its rows a step may be padded to run on a built bucket while its own builds. CUDA: any
        # (a step is bound by its kernel launches, not its rows: a compiled step of many rows costs little more
        # than one of a few, eager far more; docs/BENCHMARKS.md, "CUDA GPU"). CPU: 4 (up to that, a compiled
        # step of the padded rows is no slower than the eager step of the rows themselves; docs/BENCHMARKS.md,
        # "Compiling")
        self.padding_limit = math.inf if self.device.type == "cuda" else 4
        self.vocab_size = model.config.vocab_size
        self._rows: dict[int, StepInputs] = {}
        self._host_outputs: dict[int, tuple[torch.Tensor, ...]] = {}  # rows -> pinned (greedy, logprobs), CUDA

    def bucket(self, rows: int, longest: int) -> tuple[int, int]:
        """The (rows, columns) shape for `rows` rows whose longest writes position longest - 1: its columns whole
        blocks, two at least."""
        columns = max(2 * COLUMN_STEP, min(self.max_blocks * COLUMN_STEP, -(-longest // COLUMN_STEP) * COLUMN_STEP))
        return next(b for b in self.row_buckets if b >= rows), columns

    def inputs(self, rows: int, columns: int) -> tuple[torch.Tensor, ...]:
        """The shape's fixed inputs: tokens (b, 1), positions (b, 1), EOS bias (b,), allowed tokens (b, vocab),
        the tables' first N = columns / 16 blocks (b, N), the rows' steering rows (b,), the steering table, the
        pools."""
        if rows not in self._rows:
            self._rows[rows] = StepInputs(rows, self.vocab_size, self.table_width, self.device)
        i = self._rows[rows]
        table = i.table_view(columns // COLUMN_STEP)
        return (
            i.tokens,
            i.positions,
            i.eos_bias,
            i.allowed,
            table,
            i.steer_rows,
            self.steering.vectors,
            *self.cache.tensors(),
        )

    def compile_order(self, max_rows: int) -> list[int]:
        return compile_order(self.row_buckets, max_rows)

    def freezes(self, rows: int) -> bool:
        """Whether the bucket gets a whole frozen graph after its regional one: on the CPU where its products run in
        inductor's C++ GEMM template (kernel_choice.py, `template_serves`), which needs frozen weights and beats the
        regional step. Above, both run the prepacked linear layers and the frozen graph was no faster, for a copy
        of the weights and a long build (docs/BENCHMARKS.md, "Compiling")."""
        return self.device.type == "cpu" and template_serves(self.matmul_rows(rows), self.dtype, self.weights_bytes)

    def matmul_rows(self, rows: int) -> int:
        return rows  # one token a row

    def shared_graph(self, rows: int) -> str | None:
        """The regional graph a bucket shares: on the CPU every bucket of 2 or more rows one graph, its rows a
        dynamic dimension: one build for them all, and no slower (docs/BENCHMARKS.md, "Compiling"). One row is its
        own (torch specialises a size of 1); so is every bucket on CUDA (not measured there)."""
        several = sum(b > 1 for b in self.row_buckets) > 1
        return "rows" if rows > 1 and several and self.device.type == "cpu" else None

    def example(self, rows: int, shared: bool = False) -> tuple[torch.Tensor, ...]:
        """Scratch inputs for the compiler, shaped and strided as the live ones (a table view of the most blocks,
        pools of another size: both dynamic), over a scratch pool: the live one is the compute thread's.
        shared: the rows dynamic, from 2 to the largest bucket (`shared_graph`)."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        _, columns = self.bucket(rows, self.compiled_columns // 2 + 1)
        blocks = columns // COLUMN_STEP
        # a few blocks the rows' tables name over and over: only shapes are traced (the values are never checked)
        pools = scratch_pools(self.model, SCRATCH_BLOCKS).tensors()
        named = torch.arange(rows * blocks, device=self.device).view(rows, blocks) % (SCRATCH_BLOCKS - 1) + 1
        table = self.table_like(named, blocks)
        torch._dynamo.mark_dynamic(table, 1, min=2, max=max(2, self.compiled_columns // COLUMN_STEP))
        for t in pools:
            torch._dynamo.mark_dynamic(t, 0)
        tokens = torch.arange(rows, device=self.device).view(rows, 1)
        positions = (torch.arange(rows, device=self.device) * 7 % columns).view(rows, 1)
        eos_bias = torch.zeros(rows, device=self.device)
        allowed = torch.rand(rows, self.vocab_size, generator=generator, device=self.device) > 0.25
        steer_rows = torch.arange(rows, device=self.device) % 2  # plain and steered rows (their values never checked)
        if shared:
            for t in (tokens, positions, eos_bias, allowed, table, steer_rows):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=self.max_rows)
        return tokens, positions, eos_bias, allowed, table, steer_rows, self.steering.scratch(), *pools

    def exported(self, rows: int) -> tuple[WholePass, tuple[torch.Tensor, ...], tuple]:
        """The whole step as torch.export takes it (server/execution/packaged.py): over the plain model, on
        scratch inputs, its dynamic sizes the table's width and the pools' size."""
        example = self.example(rows)
        blocks = torch.export.Dim("blocks", min=2, max=max(2, self.compiled_columns // COLUMN_STEP))
        pool = COLUMN_STEP * torch.export.Dim("pool_blocks", min=2)  # whole blocks
        pools = [{0: pool}] * len(example[7:])
        return WholePass(self.model, self.traced), example, (None, None, None, None, {1: blocks}, None, None, *pools)

    def check_tokens(self, start: int, length: int) -> list[int]:
        """`length` tokens of the check's text from `start` on (wrapping round)."""
        return [self.check_ids[(start + j) % len(self.check_ids)] for j in range(length)]

    def prefilled(self, lengths: list[int], spare: int = 2 * COLUMN_STEP) -> tuple[PagedKVCache, torch.Tensor]:
        """A scratch pool bound to one row a prompt of the check's text of each length (its blocks consecutive, and
        `spare` positions more), filled by the eager prefill, and the token the model picks after each (rows,)."""
        width = blocks_for(max(lengths) + spare)
        cache = scratch_pools(self.model, len(lengths) * width + 1)
        table = torch.arange(len(lengths) * width, device=self.device).view(len(lengths), width) + 1
        forward, picked = forward_over(self.eager_model), []
        for row, length in enumerate(lengths):
            ids = torch.tensor([self.check_tokens(3 * row, length)], device=self.device)
            positions = torch.arange(length, device=self.device).view(1, length)
            logits = forward(ids, positions, table[row : row + 1], cache.tensors())  # (1, length, vocab)
            picked.append(logits[0, -1].argmax())
        return cache.rows(table), torch.stack(picked)

    def real_inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        """A real step's inputs (compiler.py's check): rows of the check's text, their next tokens to write."""
        lengths = check_lengths(rows, self.context)
        cache, picked = self.prefilled(lengths)
        _, columns = self.bucket(rows, max(lengths) + 1)
        positions = torch.tensor(lengths, device=self.device).view(rows, 1)
        eos_bias = torch.zeros(rows, device=self.device)
        allowed = torch.ones((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        table = self.table_like(cache.table, columns // COLUMN_STEP)
        plain = torch.zeros(rows, dtype=torch.long, device=self.device)
        return (
            picked.view(rows, 1),
            positions,
            eos_bias,
            allowed,
            table,
            plain,
            self.steering.scratch(),
            *cache.tensors(),
        )

    def table_like(self, table: torch.Tensor, blocks: int) -> torch.Tensor:
        """The table's first `blocks` columns, strided as the live tables' views (a compiled graph called directly
        reads its inputs as strided as those it was built for)."""
        full = torch.zeros((table.shape[0], self.table_width), dtype=torch.long, device=self.device)
        width = min(table.shape[1], full.shape[1])
        full[:, :width] = table[:, :width]
        return full[:, :blocks]

    def logits(self, output: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return output[2]

    def __call__(self, batch: DecodeRows) -> StepOutput:
        """One step for n rows, each through its block table (see CausalLMRunner.decode)."""
        n = len(batch.tokens)
        rows, columns = self.bucket(n, max(batch.positions) + 1)
        if rows not in self.compiled:  # the smallest larger built bucket within the padding limit, if any
            rows = next(
                (b for b in self.row_buckets if rows < b <= n * self.padding_limit and b in self.compiled), rows
            )
        inputs = self.inputs(rows, columns)
        self._rows[rows].write(batch)
        if (compiled := self.compiled.get(rows)) and columns <= self.compiled_columns:
            # the graph itself where it can be (compiler.py, GraphCapture), built for inputs strided as these
            if self.graphs is not None:
                outputs = self.graphs((rows, columns), compiled, *inputs)
            else:
                outputs = compiled(*inputs)
            greedy, logprobs, logits = outputs
        else:
            greedy, logprobs, logits = self.uncompiled(*inputs)
        greedy, logprobs = self.read_back(rows, greedy, logprobs)
        return StepOutput(greedy[:n].tolist(), logprobs[:n].tolist(), logits[:n])

    def read_back(self, rows: int, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's outputs on the host. On CUDA: copied into pinned twins without blocking, then one wait
        for the stream (each `.tolist()` of a device tensor waits once)."""
        if self.device.type != "cuda":
            return outputs
        if rows not in self._host_outputs:
            self._host_outputs[rows] = tuple(pinned_like(t) for t in outputs)
        host = self._host_outputs[rows]
        for h, t in zip(host, outputs, strict=True):
            h.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host
