"""A bf16 product of few rows that reads the weight once at the machine's memory speed (skinny_gemm.cpp).

A decode step of one to a few rows is a matrix-vector product that only moves weights. oneDNN's bf16 linear on a
prepacked weight moves them at about half the memory's speed at these rows, and inductor's C++ GEMM template
reaches that speed only over frozen weights: a copy of them per graph and minutes of build. This kernel reads the
plain weight tensors the model already holds, so every compiled graph and the eager model share them
(docs/BENCHMARKS.md, "Why these paths"). It is built once per machine (server/execution/native.py) with the op the
prepacked layers call (tinyserve::skinny_linear, a C++ kernel of the dispatcher: it picks this kernel or oneDNN by
the rows at each call).
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
    """The kernel, built on first use (native.build); loading it registers tinyserve::skinny_linear. None where no
    compiler builds it (a log line says why: the prepacked layers serve instead)."""
    return native.build(SOURCE, "the few-row bf16 kernel", {"tinyserve::skinny_linear": _shape})


def _shape(x, weight, packed, bias, max_rows):
    return x.new_empty((*x.shape[:-1], (weight if weight is not None else packed).shape[0]))


def usable() -> bool:
    """Whether the kernel runs here: the CPU has it and it is built."""
    return available() and library() is not None


def serves(x: torch.Tensor) -> bool:
    """Whether the kernel computes x's product with a weight it is usable for (bf16, at most MAX_ROWS rows): cheap,
    as it runs at every product."""
    return x.dtype is torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1]


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T + bias (N,): (..., N), bf16 (contiguous weight and bias), summed in float32, by the
    kernel whatever the rows (benchmarks, tests)."""
    return torch.ops.tinyserve.skinny_linear.default(x, weight, None, bias, x.numel())
