"""The steering table: the vectors each running sequence adds to the residual stream after each block (activation
steering, as llama.cpp's control vectors), one row a steered sequence, read by every compiled pass as an input.

A pass takes the table (S, n_layer, C) and each row's index into it (B,): a plain row reads row 0, all zeros, so
steered and plain sequences share one batch and one graph (models/gpt.py adds `steer[:, l]` after block l). Rows are
written when a steered request is admitted and freed when it ends (server/engine/core.py); the table has a row for
every sequence the engine runs at once, so admission never waits for one.
"""

from __future__ import annotations

import torch


class SteeringTable:
    def __init__(self, layers: int, width: int, sequences: int, device: torch.device) -> None:
        self.vectors = torch.zeros((sequences + 1, layers, width), device=device)  # row 0: a plain sequence's
        self.free = list(range(sequences, 0, -1))  # popped from the end: row 1 first

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, width): what a sequence's vectors are."""
        return tuple(self.vectors.shape[1:])

    def take(self, steer: torch.Tensor) -> int:
        """A row holding these vectors (n_layer, C); IndexError where every row is taken."""
        if tuple(steer.shape) != self.shape:
            raise ValueError(f"steering vectors of shape {tuple(steer.shape)}, the model's are {self.shape}")
        row = self.free.pop()
        self.vectors[row].copy_(steer)
        return row

    def drop(self, row: int) -> None:
        """The row back to the free ones (its values stay until the next take overwrites them: no row reads it)."""
        if row:
            self.free.append(row)

    def scratch(self) -> torch.Tensor:
        """A zeroed table of the same shape, for tracing and checking a pass off the live one."""
        return torch.zeros_like(self.vectors)
