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

LIBRARY = torch.library.Library("tinyserve", "FRAGMENT")
LIBRARY.define("group_linear(Tensor x, Tensor codes, int bits, Tensor scales, Tensor? zeros, Tensor? bias) -> Tensor")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use (native.build); None where no compiler builds it."""
    kernel = native.build(SOURCE, "the group-quantized kernel")
    if kernel is not None:
        v, i64 = ctypes.c_void_p, ctypes.c_int64
        kernel.group_gemm_bf16.argtypes = [v, v, ctypes.c_int, v, v, ctypes.c_int, v, v, i64, i64, i64, ctypes.c_int]
        kernel.group_gemm_bf16.restype = None
        kernel.group_dequantize_bf16.argtypes = [v, ctypes.c_int, v, v, ctypes.c_int, v, i64, i64, ctypes.c_int]
        kernel.group_dequantize_bf16.restype = None
    return kernel


def usable() -> bool:
    """Whether the kernel runs here: AVX-512 VNNI (with AVX-512 BF16, as the skinny kernel plans) and it is built."""
    return skinny_gemm.available() and cpu.cpu_features().vnni and library() is not None


def group_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x (..., K) @ w.T + bias for w = code * scale + zero in groups (GroupQuantLinear's fields)."""
    n, groups = scales.shape
    k = round(codes.shape[1] / BYTES_PER_CODE[bits])
    if not serves(x, k, scales):
        layer = GroupQuantLinear(codes, scales, zeros, bias, bits)
        return F.linear(x, layer.dequantized(x.dtype), bias)
    x = x.contiguous()
    bias = bias.to(torch.bfloat16).contiguous() if bias is not None else None
    zeros_at = zeros.data_ptr() if zeros is not None else None
    rows, threads, bias_at = x.numel() // k, torch.get_num_threads(), bias.data_ptr() if bias is not None else None
    if rows > KERNEL_MAX_ROWS:  # a prompt: the weight in bf16 once, for oneDNN's GEMM
        w = x.new_empty((n, k))
        dequantize = library().group_dequantize_bf16
        dequantize(codes.data_ptr(), bits, scales.data_ptr(), zeros_at, k // groups, w.data_ptr(), n, k, threads)
        return F.linear(x, w, bias)
    out = x.new_empty((*x.shape[:-1], n))
    product = library().group_gemm_bf16
    product(x.data_ptr(), codes.data_ptr(), bits, scales.data_ptr(), zeros_at, k // groups, bias_at, out.data_ptr(),
            rows, n, k, threads)  # fmt: skip
    return out


def serves(x: torch.Tensor, k: int, scales: torch.Tensor) -> bool:
    """Whether the kernel computes this product: bf16 activations, float16 scales (`use_kernel` makes them), K a
    multiple of 64, on a CPU that has it."""
    return x.dtype is torch.bfloat16 and scales.dtype is torch.float16 and not k % 64 and x.device.type == "cpu"


LIBRARY.impl("group_linear", group_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyserve::group_linear", lib=LIBRARY)
def _(x, codes, bits, scales, zeros, bias):
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


def product(x, codes, bits, scales, zeros, bias) -> torch.Tensor:
    """GroupQuantLinear's product: the op when traced (opaque to the compiler), the function itself in eager."""
    if torch.compiler.is_dynamo_compiling():
        return torch.ops.tinyserve.group_linear.default(x, codes, bits, scales, zeros, bias)
    return group_linear(x, codes, bits, scales, zeros, bias)


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
        layer.product = product
    return len(layers)
