"""softmax1 attention for Hugging Face models, through the library's own extension points.

Registering "softmax1" with `AttentionInterface` makes every transformers model that dispatches its
attention through `ALL_ATTENTION_FUNCTIONS` (RoBERTa and ModernBERT do) accept `attn_implementation="softmax1"`.
The matching `AttentionMaskInterface` registration is what turns the padding mask into the additive
mask this function expects: without it the mask would be None and padding silently attended to.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from models.softmax import softmax1

SOFTMAX1 = "softmax1"


def softmax1_attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, H, S, D)
    value: torch.Tensor,  # (B, H, S, D)
    attention_mask: torch.Tensor | None,  # (B, 1, T, S) additive: 0 = keep, dtype-min = masked
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with softmax1 as the normaliser; returns (B, T, H, D) output and weights."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = (query @ key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = softmax1(scores, -1)  # rows sum to < 1: the rest goes to "nothing"
    out = nn.functional.dropout(weights, p=dropout, training=module.training) @ value
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(SOFTMAX1, softmax1_attention)
AttentionMaskInterface.register(SOFTMAX1, eager_mask)
