"""A bf16 product of few rows that reads the weight once at the machine's memory speed (skinny_gemm.cpp).

A decode step of one to a few rows is a matrix-vector product that only moves weights. oneDNN's bf16 linear on a
prepacked weight moves them at about half the memory's speed at these rows, and inductor's C++ GEMM template
reaches that speed only over frozen weights: a copy of them per graph and minutes of build. This kernel reads the
plain weight tensors the model already holds, so every compiled graph and the eager model share them
(docs/BENCHMARKS.md, "Why these paths"). It is built once per machine with the C++ compiler inductor uses, into
inductor's cache folder, and called through ctypes as inductor calls its own kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from models import cpu

log = logging.getLogger("tinyserve")

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# Up to this many rows the kernel, on weights on huge pages, beats oneDNN's prepacked bf16 linear (SmolLM2-135M's
# shape: 1 row 11.6 against 25.0 ms, 8 rows 23.2 against 26.8; 16 rows slower; bench/bench_skinny_gemm.py).
MAX_ROWS = 8


def available() -> bool:
    """Whether the kernel serves on this CPU: AVX-512 BF16 as the code plans (models/cpu.py: aten's AVX-512 not
    switched off) and in the hardware (a test emulating the CPU runs the kernel only where it can)."""
    return cpu.cpu_features().avx512_bf16 and torch.cpu._is_avx512_bf16_supported()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use and kept by the digest of its source, flags and compiler; None where no
    compiler builds it (a log line says why: the prepacked layers serve instead)."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        log.warning("the few-row bf16 kernel is not built: no C++ compiler (%s) on PATH", compiler)
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # inductor's folder, TORCHINDUCTOR_CACHE_DIR

    try:
        digest = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
        built = Path(cache_dir()) / "tinyserve" / f"skinny_gemm-{digest}.so"
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            partial = built.with_suffix(f".{os.getpid()}.tmp")
            command = [compiler, *FLAGS, str(SOURCE), "-o", str(partial)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("the few-row bf16 kernel is not built: %s", done.stderr.strip()[-500:])
                return None
            partial.replace(built)  # whole or absent, for another process building it at once
    except OSError as e:  # e.g. a read-only cache folder, an install without the source
        log.warning("the few-row bf16 kernel is not built: %s", e)
        return None
    kernel = ctypes.CDLL(str(built))
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
