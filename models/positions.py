"""Position signals of the GPT: the sinusoidal table and rotary embeddings (RoPE), from one angle formula."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(
    dim: int, theta: float = 10000.0, scaling: dict | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """1 / theta^(2i/dim) for i < dim/2, float32, adjusted by a static rope_scaling of transformers' kinds:
    "linear" (positions / factor) or "llama3" (long wavelengths / factor, short ones kept, a blend between),
    or "factors" (each frequency / its own factor, as a GGUF's rope_freqs tensor gives them)."""
    half = torch.arange(0, dim, 2, dtype=torch.float32, device=device)
    inv_freq = torch.exp(-math.log(theta) * half / dim)  # (dim/2,)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        blend = ((old / wavelength - low) / (high - low)).clamp(0, 1)  # 0: long wavelength, 1: short
        return (1 - blend) * inv_freq / factor + blend * inv_freq
    if kind == "factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device=device)
    if kind != "default":
        raise ValueError(f"rope_scaling kind {kind!r} is not supported (default, linear, llama3, factors)")
    return inv_freq


def sinusoidal_angles(positions: torch.Tensor, dim: int, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """positions (B, T) -> angles p * inv_freq, (B, T, dim/2): shared by sinusoidal PE and RoPE."""
    inv_freq = inverse_frequencies(dim, device=positions.device) if inv_freq is None else inv_freq
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


def rope_rotation(
    positions: torch.Tensor, dim: int, dtype: torch.dtype, inv_freq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> cos and sin of RoPE's angles, (B, 1, T, dim/2) each, in `dtype`: computed once a
    forward pass and shared by every layer (per layer they were half of an eager decode step's ops)."""
    angles = sinusoidal_angles(positions, dim, inv_freq).unsqueeze(1)  # (B, 1, T, dim/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], pairs: str = "interleaved") -> torch.Tensor:
    """Rotary position embedding (Su et al.): rotate pairs of channels by position-dependent angles.

    x (B, H, T, D), rotation (cos, sin) (B, 1, T, r/2) from rope_rotation -> (B, H, T, D): the first r
    channels rotated, in pairs (2i, 2i+1) ("interleaved", ours and llama.cpp's) or (i, i + r/2) ("half",
    transformers' rotate_half); the rest as they are (GPT-NeoX rotates a quarter). The dot product of a
    rotated query and key then depends on their positions only through the difference.
    """
    cos, sin = (t.to(x.dtype) for t in rotation)  # under autocast, x is bf16 where the weights are not
    r = 2 * cos.shape[-1]
    rotated = x if r == x.shape[-1] else x[..., :r]
    if pairs == "interleaved":
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., : r // 2], rotated[..., r // 2 :]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated if r == x.shape[-1] else torch.cat([rotated, x[..., r:]], dim=-1)
