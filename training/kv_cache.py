"""The KV cache of the GPT: past tokens' per-layer tensors, and the batch surgery continuous batching needs."""

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

    # Batch surgery for continuous batching: rows are right-aligned (left-padded), so every row's
    # newest token sits in the last filled column and one forward pass serves rows of different lengths.

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (a finished request leaves the batch)."""
        self.buffers = [[b.index_select(0, rows) for b in bufs] for bufs in self.buffers]

    def trim_left(self, n: int) -> None:
        """Drop the first n columns (padding that no remaining row needs)."""
        self.buffers = [[b[:, :, n:] for b in bufs] for bufs in self.buffers]
        self.filled = [f - n for f in self.filled]

    @staticmethod
    def concat(caches: list[KVCache]) -> KVCache:
        """Stack caches along the batch, right-aligned: shorter ones are left-padded with zeros."""
        S = max(c.length for c in caches)
        capacity = max(S + 16, *(c.buffers[0][0].shape[2] for c in caches))
        out = KVCache(len(caches[0].buffers))
        for layer in range(len(out.buffers)):
            n_tensors = len(caches[0].buffers[layer])
            out.buffers[layer] = [
                KVCache._right_aligned([c.buffers[layer][i][:, :, : c.length] for c in caches], S, capacity)
                for i in range(n_tensors)
            ]
        out.filled = [S] * len(out.buffers)
        return out

    @staticmethod
    def _right_aligned(parts: list[torch.Tensor], S: int, capacity: int) -> torch.Tensor:
        """(b_i, H, S_i, D) tensors -> one (sum b_i, H, capacity, D) buffer, each part ending at column S."""
        _, H, _, *rest = parts[0].shape
        buf = parts[0].new_zeros(sum(p.shape[0] for p in parts), H, capacity, *rest)
        row = 0
        for p in parts:
            buf[row : row + p.shape[0], :, S - p.shape[2] : S] = p
            row += p.shape[0]
        return buf


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
