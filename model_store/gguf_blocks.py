"""GGUF's quantized blocks as integer codes with a scale and a zero per group of columns, exactly: every type
llama.cpp's quantizer writes for our families holds, per group of 16 or 32 weights, w = code * scale + zero
(IQ4_NL: a code from its fixed table times the block's scale).

How a block's bytes split into the codes' bits and the header (scales, minimums, their 6-bit packing) is the type's
business; here only the code bytes' place in a block is named (`CODE_BYTES`). The group's scale and zero come from
gguf's own dequantizer run on two copies of the blocks, one with every code 0 (w = zero) and one with every code 1
(w = scale + zero); each weight's code is then (w - zero) / scale, an integer, checked. So the header is read by
llama.cpp's reference code, not by a second reading of its bit layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# per type: (weights a group, bits a code, the code bytes' [start, end) ranges within a block, and the bytes that
# make every code 1: codes are the low bits of those ranges, high bits (qh, hmask) in the later ranges)
CODE_BYTES: dict[str, tuple[int, int, list[tuple[int, int]], list[int]]] = {
    "Q4_0": (32, 4, [(2, 18)], [0x11]),
    "Q4_1": (32, 4, [(4, 20)], [0x11]),
    "Q5_0": (32, 5, [(6, 22), (2, 6)], [0x11, 0x00]),
    "Q5_1": (32, 5, [(8, 24), (4, 8)], [0x11, 0x00]),
    "Q8_0": (32, 8, [(2, 34)], [0x01]),
    "Q2_K": (16, 2, [(16, 80)], [0x55]),
    "Q3_K": (16, 3, [(32, 96), (0, 32)], [0x55, 0x00]),
    "Q4_K": (32, 4, [(16, 144)], [0x11]),
    "Q5_K": (32, 5, [(48, 176), (16, 48)], [0x11, 0x00]),
    "Q6_K": (16, 6, [(0, 128), (128, 192)], [0x11, 0x00]),
}
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
GROUPED_TYPES = (*CODE_BYTES, "IQ4_NL")


@dataclass
class Groups:
    """A weight (N, K) as codes (N, K) with a scale and a zero per group of `group` columns: w = code * scale + zero.
    Unsigned codes of `bits` bits (0 .. 2^bits - 1), or signed bytes: Q8_0's, and IQ4_NL's table values (bits 8)."""

    codes: np.ndarray  # (N, K) uint8, or int8 (Q8_0, IQ4_NL)
    scales: np.ndarray  # (N, K / group) float32
    zeros: np.ndarray | None  # (N, K / group) float32
    bits: int
    group: int


def unpack(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Groups:
    """A quantized tensor's blocks (gguf's reader gives them as uint8 rows) as codes, scales and zeros."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    n, k = shape
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    if type_name == "IQ4_NL":  # a table, not a line: its code is the table value, its scale the block's d
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
        nibbles = np.concatenate([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], axis=1)  # low halves first, as ggml
        return Groups(IQ4_NL_VALUES[nibbles].reshape(n, k), d.reshape(n, -1), None, 8, block_weights)
    if type_name == "Q8_0":  # the common embedding type, read directly: a float16 scale, then 32 signed bytes
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return Groups(blocks[:, 2:].view(np.int8).reshape(n, k), d.reshape(n, -1), None, 8, block_weights)
    group, bits, ranges, ones = CODE_BYTES[type_name]

    def dequantized(fill: list[int] | None) -> np.ndarray:
        b = blocks
        if fill is not None:
            b = blocks.copy()
            for (start, end), value in zip(ranges, fill, strict=True):
                b[:, start:end] = value
        return np.asarray(gguf.quants.dequantize(b, qtype), dtype=np.float32).reshape(n, k // group, group)

    w = dequantized(None)
    zeros = dequantized([0] * len(ranges))[..., 0]  # (N, G): every code 0
    scales = dequantized(ones)[..., 0] - zeros  # every code 1
    safe = np.where(scales == 0, 1, scales)
    codes = np.rint((w - zeros[..., None]) / safe[..., None])
    codes = np.where(scales[..., None] == 0, 0, codes)
    low = -128 if type_name == "Q8_0" else 0  # Q8_0's codes are signed bytes
    if codes.min() < low or codes.max() >= low + 2**bits:
        raise ValueError(f"{type_name} codes outside {low}..{low + 2**bits - 1}: the blocks are not of this type")
    codes = codes.astype(np.int8 if low else np.uint8)
    back = codes * scales[..., None] + zeros[..., None]
    if not np.allclose(back, w, rtol=1e-5, atol=1e-6 * max(float(np.abs(w).max()), 1e-30)):
        raise ValueError(f"{type_name} blocks are not code * scale + zero per group of {group}")
    return Groups(codes.reshape(n, k), scales, zeros, bits, group)


def dense(g: Groups) -> np.ndarray:
    """The (N, K) float32 weight the groups hold."""
    n, k = g.codes.shape
    w = g.codes.astype(np.float32).reshape(n, -1, g.group) * g.scales[..., None]
    if g.zeros is not None:
        w = w + g.zeros[..., None]
    return w.reshape(n, k)


def join(parts: list[Groups]) -> Groups:
    """Groups stacked along their rows, in a form that holds each exactly: the smallest group (a 32-group's scale
    and zero repeated over its two 16-groups), unsigned codes of the widest part's bits where every part's are
    unsigned (else signed bytes), zeros where any part has them (0 for the others)."""
    group = min(p.group for p in parts)
    unsigned = all(p.codes.dtype == np.uint8 for p in parts)

    def per_group(values: np.ndarray, p: Groups) -> np.ndarray:
        return np.repeat(values, p.group // group, axis=1)

    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = np.concatenate(
            [per_group(p.zeros if p.zeros is not None else np.zeros_like(p.scales), p) for p in parts]
        )
    codes = np.concatenate([p.codes.astype(np.uint8 if unsigned else np.int8) for p in parts])
    scales = np.concatenate([per_group(p.scales, p) for p in parts])
    return Groups(codes, scales, zeros, max(p.bits for p in parts) if unsigned else 8, group)
