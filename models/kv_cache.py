"""The KV caches of the GPT: a growing one (prefill, one-off generation) and a static one of slots (serving)."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer tensors (keys, values, ...) of the tokens seen so far, each (B, *, S, *).

    A layer stores whatever its attention needs to see past tokens again: keys and values for
    self-attention, plus relational keys and symbols for relational heads. The first `length`
    positions of each buffer are filled; appending writes in place and the buffers grow
    geometrically, so a decode step costs O(1) copies, not a concatenation of the whole history.
    """

    def __init__(self, n_layer: int) -> None:
        self.buffers: list[list[torch.Tensor] | None] = [None] * n_layer
        self.filled = [0] * n_layer

    @property
    def length(self) -> int:
        return self.filled[-1]  # the last layer is updated last: this is the committed length

    def update(self, layer: int, positions: torch.Tensor, *new: torch.Tensor) -> list[torch.Tensor]:
        """Append this step's (B, *, T, *) tensors; return views of the full (B, *, S, *) ones.

        Columns follow arrival, not positions (rows are right-aligned), so `positions` is not needed.
        """
        start, T = self.filled[layer], new[0].shape[2]
        if self.buffers[layer] is None or start + T > self.buffers[layer][0].shape[2]:
            self._grow(layer, new, max(16, 2 * (start + T)))
        for buf, x in zip(self.buffers[layer], new, strict=True):
            buf[:, :, start : start + T] = x
        self.filled[layer] = start + T
        return [buf[:, :, : start + T] for buf in self.buffers[layer]]

    def _grow(self, layer: int, like: tuple[torch.Tensor, ...], capacity: int) -> None:
        old, n = self.buffers[layer], self.filled[layer]
        grown = []
        for i, x in enumerate(like):
            buf = x.new_zeros(x.shape[0], x.shape[1], capacity, *x.shape[3:])
            if old is not None:
                buf[:, :, :n] = old[i][:, :, :n]
            grown.append(buf)
        self.buffers[layer] = grown


class StaticKVCache:
    """Preallocated per-layer (rows, *, context, *) buffers, written at each row's own positions.

    Rows are slots: a request keeps its slot from prefill to finish, its tokens left-aligned (column =
    position), and unwritten columns are masked by position, never read. A decode step over the first
    b slots then has the same shapes at every step, which is what a compiled step (or a CUDA graph)
    needs; `KVCache` grows and shifts instead, which suits prefill and one-off generation.
    """

    def __init__(self, buffers: list[list[torch.Tensor]]) -> None:
        self.buffers = buffers  # per layer, each (rows, *, context, *)

    @classmethod
    def like(cls, cache: KVCache, rows: int, context: int) -> StaticKVCache:
        """Empty buffers for `rows` slots shaped like a (prefilled) dynamic cache's tensors."""
        return cls([[b.new_zeros(rows, b.shape[1], context, *b.shape[3:]) for b in bufs] for bufs in cache.buffers])

    @property
    def context(self) -> int:
        return self.buffers[0][0].shape[2]

    def view(self, rows: int, columns: int) -> StaticKVCache:
        """The first `rows` slots and `columns` positions, as views: writes go to this cache's buffers."""
        return StaticKVCache([[b[:rows, :, :columns] for b in bufs] for bufs in self.buffers])

    def tensors(self) -> list[torch.Tensor]:
        return [b for bufs in self.buffers for b in bufs]

    def update(self, layer: int, positions: torch.Tensor, *new: torch.Tensor) -> list[torch.Tensor]:
        """Write this step's (B, *, T, *) tensors at positions (B, T); return the whole (B, *, context, *) buffers."""
        rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)  # (B, 1)
        for buf, x in zip(self.buffers[layer], new, strict=True):
            buf[rows, :, positions] = x.transpose(1, 2).to(buf.dtype)  # indexed as (B, T, *, *)
        return self.buffers[layer]

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) query positions -> (B, 1, T, context) bool: key j is visible iff j <= the query's position."""
        keys = torch.arange(self.context, device=positions.device)
        return (keys <= positions.unsqueeze(-1)).unsqueeze(1)

    def write(self, slot: int, cache: KVCache, row: int, start: int) -> None:
        """Copy row `row` of a right-aligned dynamic cache, its tokens from column `start`, into `slot`."""
        n = cache.length - start
        for bufs, src in zip(self.buffers, cache.buffers, strict=True):
            for buf, x in zip(bufs, src, strict=True):
                buf[slot, :, :n] = x[row, :, start : cache.length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a slot's first `length` columns to another slot (compacting the batch)."""
        for buf in self.tensors():
            buf[dst, :, :length] = buf[src, :, :length]
