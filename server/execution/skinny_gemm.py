"""A bf16 product of few rows that reads the weight once at the machine's memory speed (skinny_gemm.cpp).

A decode step of one to a few rows is a matrix-vector product that only moves weights. oneDNN's bf16 linear on a
prepacked weight moves them at about half the memory's speed at these rows, and inductor's C++ GEMM template
reaches that speed only over frozen weights: a copy of them per graph and minutes of build. This kernel reads the
plain weight tensors the model already holds, so every compiled graph and the eager model share them
(docs/BENCHMARKS.md, "Why these paths"). It is built once per machine (server/execution/native.py) and called
through ctypes as inductor calls its own kernels.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from models import cpu
from server.execution import native

SOURCE = Path(__file__).with_suffix(".cpp")
# Up to this many rows the kernel, on weights on huge pages, beats oneDNN's prepacked bf16 linear (SmolLM2-135M's
# shape: 1 row 11.6 against 25.0 ms, 8 rows 23.2 against 26.8; 16 rows slower; bench/bench_skinny_gemm.py).
MAX_ROWS = 8


def available() -> bool:
    """Whether the kernel serves on this CPU: AVX-512 BF16 as the code plans (models/cpu.py: aten's AVX-512 not
    switched off) and in the hardware (a test emulating the CPU runs the kernel only where it can)."""
    return cpu.cpu_features().avx512_bf16 and torch.cpu._is_avx512_bf16_supported()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use (native.build); None where no compiler builds it (a log line says why: the
    prepacked layers serve instead)."""
    kernel = native.build(SOURCE, "the few-row bf16 kernel")
    if kernel is not None:
        kernel.skinny_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        kernel.skinny_gemm_bf16.restype = None
    return kernel


def usable() -> bool:
    """Whether the kernel runs here: the CPU has it and it is built."""
    return available() and library() is not None


def serves(x: torch.Tensor) -> bool:
    """Whether the kernel computes x's product with a weight it is usable for (bf16, at most MAX_ROWS rows): cheap,
    as it runs at every product."""
    return x.dtype is torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1]


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T + bias (N,): (..., N), bf16 (contiguous weight and bias), summed in float32."""
    x = x.contiguous()
    n, k = weight.shape
    out = x.new_empty((*x.shape[:-1], n))
    bias_at = bias.data_ptr() if bias is not None else None
    threads = torch.get_num_threads()
    library().skinny_gemm_bf16(x.data_ptr(), weight.data_ptr(), bias_at, out.data_ptr(), x.numel() // k, n, k, threads)
    return out
