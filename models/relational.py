"""Relational attention heads, the second half of the GPT's dual-attention variants."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.positions import rope

if TYPE_CHECKING:
    from models.config import GPTConfig


class RelationalAttention(nn.Module):
    """Relational heads of dual attention (Altabaa et al., "Disentangling and Integrating Relational
    and Sensory Information in Transformer Architectures").

    Head h attends as usual, alpha_ij = normalise(q_i . k_j / sqrt(D)), but instead of x_j's value it
    retrieves how x_i relates to x_j, plus a symbol that says which j that was:

        out_i = sum_j alpha_ij (r_ij W_r + s_ij W_s),   r_ij = (<x_i Wq_l, x_j Wk_l> / sqrt(D))_{l=1..R}

    Symbols: "position_relative" s_ij depends on i - j (a learned table, W_s folded into it);
    "symbolic_attention" s_j = x_j attending over a learned library of symbols.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        H, D, C = config.n_relational_head, config.head_dim, config.d_model
        R = config.n_relations or H
        self.n_head, self.head_dim, self.n_relations = H, D, R
        self.symbol_type = config.symbol_type
        self.attn_qk = nn.Linear(C, 2 * H * D, bias=config.bias)  # selects j
        self.rel_qk = nn.Linear(C, 2 * R * D, bias=config.bias)  # the R relations r(x_i, x_j)
        self.w_r = nn.Parameter(torch.randn(H, R, D) * R**-0.5)  # relations -> head output
        if config.symbol_type == "position_relative":
            self.rel_symbols = nn.Parameter(torch.randn(config.context_length, H, D) * 0.02)  # s_(i-j) W_s
        else:
            self.symbol_query = nn.Linear(C, C, bias=False)
            self.symbol_keys = nn.Parameter(torch.randn(config.n_symbols, C) * 0.02)
            self.symbol_values = nn.Parameter(torch.randn(config.n_symbols, C) * 0.02)
            self.w_s = nn.Linear(C, H * D, bias=False)

    def cache_shapes(self) -> list[tuple[int, int]]:
        """(heads, head width) of what project() returns for the cache: keys, relation keys[, symbols]."""
        shapes = [(self.n_head, self.head_dim), (self.n_relations, self.head_dim)]
        return shapes + ([(self.n_head, self.head_dim)] if self.symbol_type == "symbolic_attention" else [])

    def project(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None):
        """(B, T, C) -> queries (q, q_rel) and what the cache keeps (k, k_rel[, symbols])."""
        B, T, C = x.shape
        q, k = self.attn_qk(x).view(B, T, 2 * self.n_head, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        if rotation is not None:
            q, k = rope(q, rotation), rope(k, rotation)
        q_rel, k_rel = self.rel_qk(x).view(B, T, 2 * self.n_relations, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        cached = [k, k_rel]  # (B, H, T, D), (B, R, T, D)
        if self.symbol_type == "symbolic_attention":
            pick = F.softmax(self.symbol_query(x) @ self.symbol_keys.T / math.sqrt(C), -1)  # (B, T, n_symbols)
            symbols = self.w_s(pick @ self.symbol_values)  # (B, T, H*D)
            cached.append(symbols.view(B, T, self.n_head, self.head_dim).transpose(1, 2))  # (B, H, T, D)
        return (q, q_rel), cached

    def forward(
        self, queries, cached, normalise, dropout_p: float, query_columns: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query_columns (B, T): the cache column of each query when it is not the last T (a static cache)."""
        (q, q_rel), (k, k_rel, *symbols) = queries, cached
        T, S = q.shape[2], k.shape[2]
        alpha = normalise((q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim))  # (B, H, T, S)
        a = F.dropout(alpha, dropout_p, self.training)
        relations = (q_rel @ k_rel.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, R, T, S)
        # two contractions, not one three-operand einsum: with opt_einsum installed, torch picks that one's
        # order from the sizes, and a compiled step's dynamic key columns S became a constant
        mixed = torch.einsum("bhts,brts->bhtr", a, relations)  # (B, H, T, R)
        y = torch.einsum("bhtr,hrd->bhtd", mixed, self.w_r)  # (B, H, T, D)
        if symbols:
            y = y + a @ symbols[0]
        else:  # distances beyond the table only occur for masked keys
            keys = torch.arange(S, device=q.device)
            if query_columns is None:  # query t sits in column S - T + t, in every row
                dist, spec = torch.arange(S - T, S, device=q.device).view(T, 1) - keys, "bhts,tshd->bhtd"  # (T, S)
            else:
                dist, spec = query_columns.unsqueeze(-1) - keys, "bhts,btshd->bhtd"  # (B, T, S)
            table = self.rel_symbols[dist.clamp(0, self.rel_symbols.shape[0] - 1)]  # (*, T, S, H, D)
            y = y + torch.einsum(spec, a, table.to(a.dtype))
        return y, alpha
