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
# Up to this many rows (a decode step's largest bucket by default) the kernel serves; more (a prompt's prefill) go to
# oneDNN on the same plain weights, so nothing is prepacked and the weights are held once. Up to 8 rows the kernel
# beats oneDNN's prepacked linear; at 16 and 32 it is 14-21 % slower than it but faster than oneDNN on the plain
# weights: a small model keeps the prepacked copy too (decoder/prepacked.py, BOTH_COPIES_MAX_BYTES), a larger one
# would double its weights' memory (docs/BENCHMARKS.md, "Why these paths"). With AMX, oneDNN's tiles over the plain
# weight serve more than 8 rows (not measured against the kernel above 8).
MAX_ROWS = 32
AMX_MAX_ROWS = 8
FASTEST_ROWS = 8  # up to here it beats oneDNN's prepacked linear (decoder/prepacked.py keeps both for a small model)


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


def max_rows() -> int:
    """The most rows the kernel computes on this CPU; oneDNN more."""
    return AMX_MAX_ROWS if cpu.cpu_features().amx else MAX_ROWS


def serves(x: torch.Tensor) -> bool:
    """Whether the kernel computes x's product with a weight it is usable for (bf16, at most max_rows() rows)."""
    return x.dtype is torch.bfloat16 and x.numel() <= max_rows() * x.shape[-1]


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T + bias (N,): (..., N), bf16 (contiguous weight and bias), summed in float32, by the
    kernel whatever the rows (benchmarks, tests)."""
    return torch.ops.tinyserve.skinny_linear.default(x, weight, None, bias, x.numel())
