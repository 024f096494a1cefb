"""Which kernels inductor builds a step's matrix products with, by the rows they have and what the CPU has
(compiler.py reads it for every whole build; DecodeStep.freezes for which buckets get a whole, frozen graph)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from models import cpu
from server.execution import skinny_gemm

# On a CPU with AVX-512, up to this many rows a step's matrix products run faster in inductor's C++ GEMM
# template than in the prepacked linear layers freezing makes (oneDNN's in bf16, MKL's in float32); above it
# the prepacked layers win. Without AVX-512 the template wins at every row count: MKL's float32 GEMM is slower
# there, and oneDNN has no bf16 (docs/BENCHMARKS.md, "Why these paths"). The template is the only choice
# offered, so nothing is benchmarked at compile time.
TEMPLATE_GEMM_MAX_ROWS = 4
PREPACKED = {"freezing": True}


@functools.cache
def last_level_cache_bytes() -> int:
    """The CPU's largest cache, as sysfs gives it (0 where it gives none)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = size.read_text().strip()
            sizes.append(int(text.rstrip("KMG")) * units.get(text[-1], 1))
    return max(sizes, default=0)


def template_serves(rows: int | None, dtype: torch.dtype, weights_bytes: int | None = None) -> bool:
    """Whether a CPU step whose products have `rows` rows compiles them in the C++ GEMM template (None: rows
    that vary at run time, which the prepacked layers take: the template would need a choice for the
    attention's batched products too). In bf16 where the skinny kernel runs (skinny_gemm.py) only for a model
    whose weights (`weights_bytes`) fit the CPU's last-level cache: there the frozen graph's step is faster
    (docs/BENCHMARKS.md, "Why these paths"); beyond it the kernel reads the plain weights at about the memory's
    speed, and a frozen graph would copy them and take minutes to build for a model of many layers."""
    if dtype == torch.bfloat16 and skinny_gemm.usable():
        if weights_bytes is None or weights_bytes > last_level_cache_bytes():
            return False
    return rows is not None and (rows <= TEMPLATE_GEMM_MAX_ROWS or not cpu.cpu_features().avx512)


def template_takes(model: torch.nn.Module | None) -> bool:
    """Whether the C++ GEMM template can lower every product of the model's graphs: not a GPT's with relational
    heads, whose batched product over the cached symbols torch 2.13 offers no template choice for (the build
    fails: compiler.py builds such a step with the prepacked layers, once)."""
    config = getattr(model, "config", None)
    return not getattr(config, "n_relational_head", 0)


def inductor_settings(
    device: torch.device, rows: int | None, dtype: torch.dtype, weights_bytes: int | None = None
) -> dict:
    """Inductor's config while a step whose matrix products have `rows` rows compiles. Freezing must be
    set in inductor's config itself: torch.compile(options={"freezing": True}) reaches inductor after
    the freezing decision was made, and the weights stay graph inputs (no prepacked linear appears in the
    graph)."""
    if device.type == "cuda":
        return {}
    if template_serves(rows, dtype, weights_bytes):
        return {**PREPACKED, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    return dict(PREPACKED)
