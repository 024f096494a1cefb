"""The GPT's KV cache: preallocated slots, written at each token's own position (gpt-fast's design)."""

from __future__ import annotations

import math
import mmap

import torch


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU over an anonymous mapping: its pages read as the system's zero page until written,
    so a process holds the part of a KV budget it has used, not all of it at start (torch.zeros writes every byte)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping


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

    def at(self, positions: torch.Tensor) -> StaticKVCache:
        return self  # a row's slot is its row, a position its column

    def layer(self, i: int) -> list[torch.Tensor]:
        return self.buffers[i]

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
    """One layer's update: this step's (B, *, T, *) tensors written at positions (B, T), and what the layer attends
    over returned, (B, *, S, *). A static cache's layer is its buffers (S = context); a paged one's
    (PagedKVCache.layer) is its addresses (slots (B, T): the pool rows written; the block table (B, N)) then its
    pools. A block takes its layer's
    tensors alone, so that every block's call has the same form (a compiler traces one and reuses it for all:
    models/gpt.py, Block)."""
    if len(buffers) == len(new):  # static: row b's slot, column = position
        rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)  # (B, 1)
        for buf, x in zip(buffers, new, strict=True):
            buf[rows, :, positions] = x.transpose(1, 2).to(buf.dtype)  # indexed as (B, T, *, *)
        return buffers
    slots, table, *pools = buffers
    read = []
    for pool, x in zip(pools, new, strict=True):
        rows = x.transpose(1, 2).flatten(0, 1).to(pool.dtype)  # (B * T, *, width)
        pool.index_copy_(0, slots.flatten(), rows)  # at their pool rows
        blocks = pool.unflatten(0, (-1, BLOCK_TOKENS))[table]  # (B, N, 16, *, width): whole blocks gathered
        read.append(blocks.flatten(1, 2).transpose(1, 2))  # (B, *, S, width)
    return read


BLOCK_TOKENS = 16  # positions a block holds


def blocks_for(positions: int) -> int:
    """Blocks that hold this many positions."""
    return -(-positions // BLOCK_TOKENS)


class PagedKVCache:
    """Keys and values in blocks of BLOCK_TOKENS positions from one pool per cached tensor, shared by every sequence
    (vLLM's paged attention): a sequence holds the blocks it has filled, not a slot of the longest context.

    A pool is (blocks * BLOCK_TOKENS, *, width), token-major, so a block is one contiguous run. A forward over B rows
    takes a block table (B, N) int64: row b's position p lives in block table[b, p // BLOCK_TOKENS] at offset
    p % BLOCK_TOKENS, and the row attends over the N * BLOCK_TOKENS positions its table names (gathered in order:
    column = position, as in the static cache, so masks, relational heads and the compiled steps read them alike).
    A table's unused entries name any block (0, say): their columns lie past the row's positions and are never seen.
    """

    def __init__(self, pools: list[list[torch.Tensor]], table: torch.Tensor | None = None) -> None:
        self.pools = pools  # per layer, each (blocks * BLOCK_TOKENS, *, width)
        self.table = table  # (B, N) block ids, or None: not bound to rows yet
        self.addresses: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots (B, T), table (B, N)), `at`

    @classmethod
    def empty(
        cls, shapes: list[list[tuple[int, int]]], blocks: int, dtype: torch.dtype, device: torch.device
    ) -> PagedKVCache:
        """Zeroed pools of `blocks` blocks (a never-written column reads 0: a masked one times its zero weight stays
        finite), resident as they are written; shapes: per layer, (heads, head width) of each tensor it caches."""
        return cls([[zero_pages((blocks * BLOCK_TOKENS, h, d), dtype, device) for h, d in layer] for layer in shapes])

    @property
    def blocks(self) -> int:
        return self.pools[0][0].shape[0] // BLOCK_TOKENS

    @property
    def context(self) -> int:
        return self.table.shape[1] * BLOCK_TOKENS

    def rows(self, table: torch.Tensor) -> PagedKVCache:
        """The same pools, bound to the rows of this block table (B, N)."""
        return PagedKVCache(self.pools, table)

    def at(self, positions: torch.Tensor) -> PagedKVCache:
        """Bound to a forward's positions (B, T): the pool rows each new token's keys and values go to."""
        table = self.table
        slots = table.gather(1, positions // BLOCK_TOKENS) * BLOCK_TOKENS + positions % BLOCK_TOKENS  # (B, T)
        bound = PagedKVCache(self.pools, table)
        bound.addresses = slots, table
        return bound

    def layer(self, i: int) -> list[torch.Tensor]:
        """What layer i's attention takes (write_layer): its addresses, then its pools."""
        return [*self.addresses, *self.pools[i]]

    def tensors(self) -> list[torch.Tensor]:
        return [p for pools in self.pools for p in pools]

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], n_layer: int) -> PagedKVCache:
        """The inverse of tensors(): a flat list of pools (what a compiled pass takes) back into layers."""
        per_layer = len(tensors) // n_layer
        return cls([list(tensors[i * per_layer : (i + 1) * per_layer]) for i in range(n_layer)])

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) query positions -> (B, 1, T, S) bool: key j is visible iff j <= the query's position."""
        keys = torch.arange(self.context, device=positions.device)
        return (keys <= positions.unsqueeze(-1)).unsqueeze(1)
