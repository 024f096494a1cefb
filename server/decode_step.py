"""One decode step of the GPT over a static KV cache: eager, or compiled per batch-size bucket.

The engine's running rows own slots 0..n-1 of a `StaticKVCache`. A step over n rows runs on the
smallest bucket (1, 2, 4, ... max rows) that holds them, padding rows included, so each bucket has
fixed shapes: its inputs are preallocated tensors written in place, which is what a compiled graph
(and on CUDA, a captured graph) needs. Until a bucket's compiled step is ready (server/compiled.py
builds them off the request path), the same step runs eagerly; both give the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model_store import GPT, KVCache
from training.kv_cache import StaticKVCache

# (tokens (b, 1), positions (b, 1), *cache tensors) -> logits (b, vocab); mutates the cache tensors
StepFn = Callable[..., torch.Tensor]


def buckets(max_rows: int) -> list[int]:
    """Batch sizes with their own shapes: powers of two below max_rows, then max_rows."""
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return sizes + [max_rows]


def eager_step(model: GPT, n_layer: int) -> StepFn:
    """The decode step as a plain function of tensors (the form every compiler takes)."""

    def step(tokens: torch.Tensor, positions: torch.Tensor, *cache: torch.Tensor) -> torch.Tensor:
        per_layer = len(cache) // n_layer
        static = StaticKVCache([list(cache[i * per_layer : (i + 1) * per_layer]) for i in range(n_layer)])
        return model.forward(tokens, position_ids=positions, kv_cache=static).logits[:, -1]  # (b, vocab)

    return step


class DecodeStep:
    def __init__(self, model: GPT, max_rows: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.buckets = buckets(max_rows)
        self.device = next(model.parameters()).device
        self.cache: StaticKVCache | None = None  # allocated at the first prefill (its shapes come from it)
        self.eager = eager_step(model, model.config.n_layer)
        self.compiled: dict[int, StepFn] = {}  # bucket -> compiled step, added when ready
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def write(self, slot: int, cache: KVCache, row: int, start: int) -> None:
        """A prefilled row (columns start.. of a right-aligned dynamic cache) into a slot."""
        if self.cache is None:
            self.cache = StaticKVCache.like(cache, self.max_rows, self.model.config.context_length)
        self.cache.write(slot, cache, row, start)

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The bucket's fixed input tensors: tokens (b, 1), positions (b, 1), cache views of the first b slots."""
        if bucket not in self._inputs:
            zeros = torch.zeros((bucket, 1), dtype=torch.long, device=self.device)
            self._inputs[bucket] = (zeros, zeros.clone(), self.cache.first(bucket).tensors())
        return self._inputs[bucket]

    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Next-token logits (n, vocab), float32 on the CPU, for n rows in slots 0..n-1."""
        n, b = len(tokens), self.bucket(len(tokens))
        tok, pos, cache = self.inputs(b)
        tok[:n, 0] = torch.tensor(tokens)
        pos[:n, 0] = torch.tensor(positions)
        pos[n:] = 0  # padding rows write to column 0 of free slots, which a prefill overwrites
        logits = self.compiled.get(b, self.eager)(tok, pos, *cache)
        return logits[:n].float().cpu()
