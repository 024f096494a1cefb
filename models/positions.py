"""Position signals of the GPT: the sinusoidal table and rotary embeddings (RoPE), from one angle formula."""

from __future__ import annotations

import math

import torch


def sinusoidal_angles(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """positions (B, T) -> angles p / 10000^(2i/dim), (B, T, dim/2): shared by sinusoidal PE and RoPE."""
    half = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = torch.exp(-math.log(10000.0) * half / dim)  # (dim/2,)
    return positions.float().unsqueeze(-1) * inv_freq


def sinusoidal_encoding(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i/C)), PE[p, 2i+1] = cos(...). (B, T) int -> (B, T, C) float.

    Computed from the positions on the fly, so any position (e.g. deep into a KV cache) works.
    """
    angles = sinusoidal_angles(positions, d_model)  # (B, T, C/2)
    pe = torch.zeros(*positions.shape, d_model, device=positions.device)
    pe[..., 0::2] = torch.sin(angles)
    pe[..., 1::2] = torch.cos(angles)
    return pe


def rope_rotation(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> cos and sin of RoPE's angles, (B, 1, T, dim/2) each, in `dtype`: computed once a
    forward pass and shared by every layer (per layer they were half of an eager decode step's ops)."""
    angles = sinusoidal_angles(positions, dim).unsqueeze(1)  # (B, 1, T, dim/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary position embedding (Su et al.): rotate pairs of channels by position-dependent angles.

    x (B, H, T, D), rotation (cos, sin) from rope_rotation -> (B, H, T, D). The dot product of a rotated
    query and key then depends on their positions only through the difference.
    """
    cos, sin = (t.to(x.dtype) for t in rotation)  # under autocast, x is bf16 where the weights are not
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
