"""Additive (Bahdanau) attention scores, one of the attention variants of the experiments (docs/experiments/)."""

from __future__ import annotations

import torch
import torch.nn as nn


class AdditiveScore(nn.Module):
    """Additive (Bahdanau) scores per head: score(q_i, k_j) = w2 . tanh(W1 [q_i; k_j]).

    W1 [q; k] is computed as W1q q + W1k k, so the (B, H, T, S, D) tanh argument is one broadcast
    add; it is still T*S times the work of a dot product, which is why this variant trains slowly.
    """

    def __init__(self, n_head: int, head_dim: int) -> None:
        super().__init__()
        scale = head_dim**-0.5
        self.w1_q = nn.Parameter(torch.randn(n_head, head_dim, head_dim) * scale)
        self.w1_k = nn.Parameter(torch.randn(n_head, head_dim, head_dim) * scale)
        self.w2 = nn.Parameter(torch.randn(n_head, head_dim) * scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # (B, H, T, D), (B, H, S, D)
        a = torch.einsum("bhtd,hde->bhte", q, self.w1_q).unsqueeze(3)  # (B, H, T, 1, D)
        b = torch.einsum("bhsd,hde->bhse", k, self.w1_k).unsqueeze(2)  # (B, H, 1, S, D)
        return torch.einsum("bhtse,he->bhts", torch.tanh(a + b), self.w2)  # (B, H, T, S)
