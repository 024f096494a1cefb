"""A decode step's inputs besides the pools, one set a row bucket (server/execution/decoder/step.py)."""

from __future__ import annotations

import torch

from server.execution.runner import DecodeRows


class StepInputs:
    """A row bucket's inputs besides the pools, preallocated and written in place each step (what a compiled
    graph, and on CUDA a captured one, needs): tokens (b, 1), positions (b, 1), EOS bias (b,), allowed
    tokens (b, vocab) bool, block tables (b, the most blocks a row has), read as views of their first N columns,
    and each row's row of the steering table (b,).

    A step's values are written into host arrays: on the CPU numpy views of the inputs themselves (far cheaper
    than writing them through torch), on CUDA views of pinned twins, copied to the device without a
    synchronisation (each pageable copy waited for the device: three waits a step)."""

    def __init__(self, rows: int, vocab_size: int, max_blocks: int, device: torch.device) -> None:
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.eos_bias = torch.zeros(rows, device=device)
        self.allowed = torch.ones((rows, vocab_size), dtype=torch.bool, device=device)
        self.table = torch.zeros((rows, max_blocks), dtype=torch.long, device=device)
        self.steer_rows = torch.zeros(rows, dtype=torch.long, device=device)
        self.masked: set[int] = set()  # the rows of `allowed` that are not all True
        host = self.tensors() if device.type == "cpu" else tuple(pinned_like(t) for t in self.tensors())
        self.uploads = [] if device.type == "cpu" else list(zip(host, self.tensors(), strict=True))  # (host, device)
        self.arrays = tuple(t.numpy() for t in host)  # made once
        self.views: dict[int, torch.Tensor] = {}  # N -> the tables' first N columns

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.positions, self.eos_bias, self.table, self.steer_rows, self.allowed

    def write(self, rows: DecodeRows) -> None:
        """A step's values into rows 0..n-1; padding rows write at position 0 of the null block. Only the rows
        with a mask, and those that had one, touch `allowed`."""
        n = len(rows.tokens)
        tok, pos, bias, table, steer, ok = self.arrays
        tok[:n, 0] = rows.tokens
        pos[:n, 0] = rows.positions
        pos[n:] = 0
        bias[:n] = rows.eos_bias
        for i, blocks in enumerate(rows.tables):
            table[i, : len(blocks)] = blocks
        table[n:] = 0  # padding rows: the null block, never another sequence's
        steer[:n] = rows.steer_rows if rows.steer_rows is not None else 0
        steer[n:] = 0
        masks = {i: m for i, m in enumerate(rows.allowed) if m is not None}
        touched = bool(masks or self.masked)
        if touched:
            for i in self.masked - masks.keys():
                ok[i] = True
            for i, m in masks.items():
                ok[i] = m
            self.masked = set(masks)
        # pinned twins are rewritten only after the last step's outputs were read back (DecodeStep.read_back),
        # i.e. after the device finished these copies
        for h, t in self.uploads[: 6 if touched else 5]:
            t.copy_(h, non_blocking=True)

    def table_view(self, blocks: int) -> torch.Tensor:
        if blocks not in self.views:
            self.views[blocks] = self.table[:, :blocks]
        return self.views[blocks]


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of t: the device copies from and to it without the host waiting."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
