"""The model-runner seam: what the engine, inspection, service and routers need from a causal language
model, whatever its family (our GPT, a transformers causal LM). A new family is one class with these
methods, registered in server/execution/__init__.py (docs/ADDING_A_MODEL_FAMILY.md).

Rows and blocks: the engine keeps up to `facts.slots` running sequences; sequence i of a decode step is row i.
Our decoder keeps keys and values in a paged pool of `facts.kv_blocks` blocks (models/kv_cache.py, `PagedKVCache`)
that the engine hands out (server/engine/kv_blocks.py) and names per sequence in a block table; a transformers
model keeps them in a static slot a row (`SlotCache`, its facts.kv_blocks 0), and ignores the tables.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer


def start_tokens(plain: list[int], full: list[int]) -> list[int]:
    """The special tokens a tokenizer puts before a text (a BOS, or none), from one probe text's ids
    encoded without and with its special tokens (a template may append an end-of-sequence token too)."""
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    return full[: starts[0]] if plain and starts else []


PROBE = "Hello world"  # encodes to ids in every tokenizer


class TextCodec:
    """Text <-> token ids with the checkpoint's own `tokenizers` tokenizer (transformers' fast tokenizers wrap
    one): encode puts its start-of-sequence tokens (`prefix`, e.g. Llama's BOS) before a text and nothing after
    it; decode shows no special tokens (end-of-text decodes to '')."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix = start_tokens(*(tokenizer.encode(PROBE, add_special_tokens=b).ids for b in (False, True)))

    def encode(self, text: str) -> list[int]:
        return self.prefix + self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(frozen=True)
class ModelFacts:
    """A served model's facts, declared once: what the engine checks and /models, /info and the demo page show
    (limits, vocabulary, attention shape). Every runner makes its own; the registry makes a masked LM's."""

    family: str  # "gpt" (ours) or the checkpoint's transformers architecture, e.g. "LlamaForCausalLM"
    context_length: int
    vocab_size: int
    eos_id: int
    layers: int
    heads: int
    normaliser: str  # the attention normaliser: softmax0 or softmax1
    attention_settings: dict = field(default_factory=dict)  # what /models and the demo page show
    config: dict = field(default_factory=dict)  # the checkpoint's config as loaded
    parameters: int = 0  # the checkpoint's, counted at load (its layers may be packed later)
    kv_cache_bytes: int = 0  # what the runner's KV cache holds (0: none preallocated)
    slots: int = 0  # sequences it keeps at once: the engine's batch is at most this (set by every runner)
    kv_blocks: int = 0  # blocks of its paged KV pool (the engine hands them out); 0: a static slot a sequence
    verify_tokens: int = 0  # tokens its draft check takes (the pending one and drafts); 0: it has none
    steer_width: int = 0  # the residual stream's width that steering vectors add to (d_model); 0: it cannot steer
    weights: str = ""  # what its weights are held as and what computes them (server/execution/loader.py)


def context_within(per_position: int, rows: int, context: int, budget_bytes: int | None, spare: int = 0) -> int:
    """The positions each of `rows` slots keeps so that rows x (positions + spare) x per_position bytes of
    keys and values fit the KV budget (kv_cache_mb): the context, or less (a multiple of 16), as llama.cpp
    splits its context over its slots; ValueError below 16."""
    if budget_bytes is None or rows * (context + spare) * per_position <= budget_bytes:
        return context
    fits = (budget_bytes // (rows * per_position) - spare) // 16 * 16
    if fits < 16:
        need = -(-rows * (16 + spare) * per_position // 2**20)
        raise ValueError(f"kv_cache_mb: {rows} slots of 16 positions need {need} MB ({per_position} bytes a position)")
    return fits


def right_padded(
    slots: list[int], prompts: list[list[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill group as one batch: ids (B, T) right-padded with `pad`, positions (B, T) and each row's
    last index (B,). Its slots must be consecutive (the batch writes slots[0]..slots[0]+B-1)."""
    if slots != list(range(slots[0], slots[0] + len(slots))):
        raise ValueError(f"prefill slots must be consecutive, got {slots}")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt)
    positions = torch.arange(T, device=device).expand(len(prompts), T)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    return ids.to(device), positions, last


@dataclass
class DecodeRows:
    """A decode step's inputs, element i for row i: the token, the position it goes to, the bias added to its
    end-of-text logit, the tokens its greedy choice may take ((V,) bool, a constraint's mask; None: any), its
    block table and its row of the steering table (0: not steered; CausalLMRunner.steer)."""

    tokens: list[int]
    positions: list[int]
    eos_bias: list[float]
    allowed: list[np.ndarray | None]
    tables: list[list[int]]
    steer_rows: list[int] | None = None  # None: none steered


@dataclass
class StepOutput:
    """A decode step's result for n rows: each row's greedy next token (its EOS bias applied) and that
    token's logprob under the model, and the raw logits (n, vocab) in the runner's device and dtype,
    from which the engine samples the rows that are not greedy."""

    greedy: list[int]
    logprobs: list[float]
    logits: torch.Tensor


@dataclass
class TokenLogprobs:
    """log p(ids[t] | ids[:t]) for t = 1..T-1 of a sequence, with the top alternatives at each position."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per position: (token id, logprob), most likely first


class CausalLMRunner(Protocol):
    facts: ModelFacts
    tokenizer: TextCodec
    model: torch.nn.Module  # the weights (its device and dtype; the compute thread's guard sits on it)

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        tables: list[list[int]],
        starts: list[int],
        steer_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Run each prompt into its slot (the engine gives consecutive free rows) or through its block table, from
        its start on (the positions before it are cached blocks; 0 where facts.kv_blocks is 0), steered by its row of
        the steering table; next-token logits (n, vocab), float32 on the CPU."""
        ...

    def steer(self, vectors: torch.Tensor) -> int:
        """A row of the steering table holding a sequence's vectors (facts.layers, facts.steer_width), added to the
        residual stream after each block at every position it computes (where facts.steer_width > 0)."""
        ...

    def unsteer(self, row: int) -> None:
        """The sequence that held this row has ended."""
        ...

    def decode(self, rows: DecodeRows) -> StepOutput:
        """One step for the sequences of rows 0..n-1."""
        ...

    def verify(
        self, tokens: list[int], position: int, eos_bias: list[float], table: list[int]
    ) -> tuple[list[int], list[float]] | None:
        """The draft check of one sequence (its block table given; where facts.verify_tokens > 0): its pending token
        and drafts, facts.verify_tokens of them from `position`, in one pass; the greedy token after each (eos_bias[i]
        added to the end-of-text logit after token i) and its logprob. None where no fast pass is ready: decode
        instead."""
        ...

    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's first `length` positions now belong to row dst (the engine compacts its batch; nothing to do
        for a paged cache)."""
        ...

    def logits(self, ids: list[int], steer: torch.Tensor | None = None) -> torch.Tensor:
        """Every position's next-token logits (T, vocab) of one sequence, no cache: scoring; steered by the
        (facts.layers, facts.steer_width) vectors where given."""
        ...

    def attention(self, ids: list[int]) -> list[torch.Tensor]:
        """Per layer, the (heads, T, T) attention weights of one sequence."""
        ...

    def compile_passes(self, max_rows: int) -> list[tuple[object, Hashable]]:
        """What server/execution/compiler.py builds for this model, in build order: (target, bucket) pairs, e.g. the
        fixed-shape decode step's buckets of at most max_rows rows; empty when the family has none."""
        ...

    def compiler_done(self) -> None:
        """The compiler has built what it builds, or will not run (on the compute thread): what only it read may
        go."""
        ...


@torch.inference_mode()
def token_logprobs(
    runner: CausalLMRunner, ids: list[int], top_n: int, steer: torch.Tensor | None = None
) -> TokenLogprobs:
    """log p(ids[t] | ids[:t]) for t >= 1 and the top alternatives at each position. /score and the echoed
    prompts of /v1/completions both read their logprobs here.

    A sequence longer than the context is read in windows of the context length that advance by half
    of it; each token is scored in the first window that gives it at least half a context before it
    (all of its tokens, near the start), as training/evaluate.py's perplexity does."""
    L = runner.facts.context_length
    stride = max(1, L // 2)
    logprobs: list[float] = []
    top: list[list[tuple[int, float]]] = []
    start = 0
    while len(logprobs) < len(ids) - 1:
        window = ids[start : start + L]
        first = len(logprobs) + 1 - start  # the window's first target not scored yet
        logp = torch.log_softmax(
            runner.logits(window, steer)[first - 1 : -1].float(), dim=-1
        )  # row r predicts window[first + r]
        targets = torch.tensor(window[first:], device=logp.device)
        logprobs += logp[torch.arange(len(targets), device=logp.device), targets].tolist()
        if top_n:
            vals, alt = logp.topk(top_n, dim=-1)
            top += [list(zip(a, v, strict=True)) for a, v in zip(alt.tolist(), vals.tolist(), strict=True)]
        else:
            top += [[] for _ in range(len(targets))]
        start += stride
    return TokenLogprobs(logprobs, top)
