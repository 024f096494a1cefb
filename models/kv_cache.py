"""The GPT's KV cache: preallocated slots, written at each token's own position (gpt-fast's design)."""

from __future__ import annotations

import torch


class StaticKVCache:
    """Per-layer (rows, *, context, *) buffers: keys and values, plus what relational heads keep.

    Rows are slots: a sequence keeps its slot for its whole life, its tokens left-aligned (column =
    position). A query at position p sees the columns <= p, so whatever lies beyond a row's last
    written position (a shorter prompt's padding, a previous occupant's tokens) is never read and is
    overwritten as the row grows. Shapes never change, which is what a compiled step (or a CUDA graph)
    needs, and prompts of different lengths share one prefill pass, right-padded, with no padding mask.
    """

    def __init__(self, buffers: list[list[torch.Tensor]]) -> None:
        self.buffers = buffers  # per layer, each (rows, *, context, *)

    @classmethod
    def empty(
        cls,
        shapes: list[list[tuple[int, int]]],
        rows: int,
        context: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: int | None = None,
    ) -> StaticKVCache:
        """Zeroed buffers; shapes: per layer, (heads, head width) of each tensor it caches. With `zeroed`, only
        each row's first `zeroed` positions: a scratch cache that is never read further holds no memory there."""

        def buffer(heads: int, width: int) -> torch.Tensor:
            if zeroed is None:
                return torch.zeros(rows, heads, context, width, dtype=dtype, device=device)
            b = torch.empty(rows, heads, context, width, dtype=dtype, device=device)
            b[:, :, :zeroed].zero_()
            return b

        return cls([[buffer(h, d) for h, d in layer] for layer in shapes])

    @property
    def context(self) -> int:
        return self.buffers[0][0].shape[2]

    @property
    def rows(self) -> int:
        return self.buffers[0][0].shape[0]

    def view(self, rows: int, columns: int, start: int = 0) -> StaticKVCache:
        """Slots start..start+rows-1 and their first `columns` positions, as views: writes reach this cache."""
        return StaticKVCache([[b[start : start + rows, :, :columns] for b in bufs] for bufs in self.buffers])

    def tensors(self) -> list[torch.Tensor]:
        return [b for bufs in self.buffers for b in bufs]

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], n_layer: int) -> StaticKVCache:
        """The inverse of tensors(): a flat list (what a compiled step takes) back into layers."""
        per_layer = len(tensors) // n_layer
        return cls([list(tensors[i * per_layer : (i + 1) * per_layer]) for i in range(n_layer)])

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) query positions -> (B, 1, T, context) bool: key j is visible iff j <= the query's position."""
        keys = torch.arange(self.context, device=positions.device)
        return (keys <= positions.unsqueeze(-1)).unsqueeze(1)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a slot's first `length` columns to another slot (compacting the batch)."""
        for buf in self.tensors():
            buf[dst, :, :length] = buf[src, :, :length]


def write_layer(buffers: list[torch.Tensor], positions: torch.Tensor, *new: torch.Tensor) -> list[torch.Tensor]:
    """One layer's update: this step's (B, *, T, *) tensors written at positions (B, T) of its buffers, which
    are returned (B, *, context, *). A block takes its layer's buffers alone, so that every block's call has
    the same form (a compiler traces one and reuses it for all: models/gpt.py, Block)."""
    rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)  # (B, 1)
    for buf, x in zip(buffers, new, strict=True):
        buf[rows, :, positions] = x.transpose(1, 2).to(buf.dtype)  # indexed as (B, T, *, *)
    return buffers
