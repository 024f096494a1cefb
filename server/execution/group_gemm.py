"""Products of group-quantized weights (GGUF's blocks as codes, scales and zeros: models/quantize.py,
GroupQuantLinear) that read the codes, not a float copy (group_gemm.cpp).

A decode step of a small model reads every weight once a token: 4-bit codes are a quarter of bf16's bytes. Up to
KERNEL_MAX_ROWS rows, our kernel turns a few rows of codes at a time into bytes in the cache and runs every row of x
over them with integer dot products (x rounded to int8 per group of 32, as llama.cpp rounds its activations), so each
byte of codes leaves memory once whatever the rows; more rows dequantize the weight into bf16 once for oneDNN's GEMM
(bench/bench_group_quant.py measures both against bf16's product and aten's int4 kernel). The kernel takes bf16
activations and needs AVX-512 VNNI and BF16; elsewhere, and for float32 activations, the loader widens the layers to
the dtype instead (server/execution/loader.py). The op is opaque to inductor, so a compiled graph calls it as it is
and folds no float copy of the weights into a constant.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import cpu
from models.quantize import BYTES_PER_CODE, GroupQuantLinear
from server.execution import native, skinny_gemm

SOURCE = Path(__file__).with_suffix(".cpp")
# up to this many rows the integer kernel; more (a prompt) dequantize the weight into bf16 for oneDNN's GEMM, faster
# from about 8 rows on (bench/bench_group_quant.py)
KERNEL_MAX_ROWS = 8

LIBRARY = torch.library.Library("tinyserve", "FRAGMENT")  # tinyserve::group_gemm is defined in group_gemm.cpp
LIBRARY.define("group_linear(Tensor x, Tensor codes, int bits, Tensor scales, Tensor? zeros, Tensor? bias) -> Tensor")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use (native.build); loading it registers the op tinyserve::group_gemm. None where no
    compiler builds it."""
    return native.build(SOURCE, "the group-quantized kernel", {"tinyserve::group_gemm": _shape})


def _shape(x, codes, bits, scales, zeros, bias, max_rows=0):
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


def usable() -> bool:
    """Whether the kernel runs here: AVX-512 VNNI (with AVX-512 BF16, as the skinny kernel plans) and it is built."""
    return skinny_gemm.available() and cpu.cpu_features().vnni and library() is not None


def serves(x: torch.Tensor, codes: torch.Tensor, bits: int, scales: torch.Tensor) -> bool:
    """Whether the kernel computes this product: bf16 activations, float16 scales (`use_kernel` makes them), K a
    multiple of 64, on a CPU that has it."""
    k = round(codes.shape[1] / BYTES_PER_CODE[bits])
    return x.dtype is torch.bfloat16 and scales.dtype is torch.float16 and not k % 64 and x.device.type == "cpu"


def group_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x (..., K) @ w.T + bias for w = code * scale + zero in groups (GroupQuantLinear's fields), where the kernel
    does not serve: the weight widened to x's dtype."""
    return F.linear(x, GroupQuantLinear(codes, scales, zeros, bias, bits).dequantized(x.dtype), bias)


LIBRARY.impl("group_linear", group_linear, "CompositeExplicitAutograd")
torch.library.register_fake("tinyserve::group_linear", lib=LIBRARY)(_shape)


def product(x, codes, bits, scales, zeros, bias) -> torch.Tensor:
    """GroupQuantLinear's product: our kernel's op where it serves (a C++ kernel of the dispatcher: no Python a call,
    and opaque to the compiler, which folds no float copy of the weights), else the widened weight's."""
    if serves(x, codes, bits, scales):
        return torch.ops.tinyserve.group_gemm.default(x, codes, bits, scales, zeros, bias, KERNEL_MAX_ROWS)
    return torch.ops.tinyserve.group_linear.default(x, codes, bits, scales, zeros, bias)


def in_use(model: nn.Module) -> bool:
    """Whether some layer of the model computes through our kernel (`use_kernel` set it)."""
    return any(isinstance(m, GroupQuantLinear) and m.product is not None for m in model.modules())


def use_kernel(model: nn.Module) -> int:
    """Where the kernel runs, every GroupQuantLinear of the model computes through `product`, its scales and zeros in
    float16 (the kernel's: 11 bits of mantissa, against float32's 24, for a quarter fewer bytes a 4-bit weight; a
    GGUF scale, a float16 times a 6-bit integer, rounds by at most 2^-12 of itself). The number of layers."""
    if not usable():
        return 0
    layers = [m for m in model.modules() if isinstance(m, GroupQuantLinear)]
    for layer in layers:
        layer.scales = layer.scales.to(torch.float16)
        layer.zeros = layer.zeros.to(torch.float16) if layer.zeros is not None else None
        layer.bias = layer.bias.to(torch.bfloat16) if layer.bias is not None else None  # as the kernel adds it
        layer.product = product
    return len(layers)
