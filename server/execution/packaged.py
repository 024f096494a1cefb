"""A whole CPU pass kept as an AOTInductor package in the compile cache, so a restart loads it in seconds.

Inductor's own cache cannot hold a frozen graph (its oneDNN constants do not pickle: torch/_inductor/codecache.py,
"mkldnn tensors unpickleable"), nor can `aot_compile` (freezing has no serializable compiler), so the frozen
buckets were built again at every start (70-90 s each for a 135M model). An AOTInductor package holds the frozen,
packed weights in its shared library: loading it is a dlopen and one copy of them (docs/BENCHMARKS.md,
"Real checkpoints"). The server's compiler (compiler.py) packages a target's whole pass where the target says how
to export it (`exported`) and a cache folder is set; without one it compiles in its own process, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Protocol

import torch

from server.execution.compute_thread import one_openmp_thread


class Exportable(Protocol):
    def exported(self, bucket: Hashable) -> tuple[WholePass, tuple[torch.Tensor, ...], tuple]:
        """(the traced function over its model, scratch inputs, each input's dynamic sizes as torch.export takes
        them: None, or {dimension: torch.export.Dim})."""
        ...


class WholePass(torch.nn.Module):
    """A pass's function as a module whose parameters are its model's (what the export freezes)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fn(*inputs)


def package(target: Exportable, bucket: Hashable, path: Path, settings: dict) -> None:
    """Export the bucket's pass and compile it into an AOTInductor package at `path` (written whole or not at all).
    Inductor's own torch ops (freezing's constant folding) run on one OpenMP thread (compute_thread.py says why)."""
    partial = path.with_name(path.stem + ".partial.pt2")
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False), torch.no_grad(), one_openmp_thread():  # export takes no inference tensors
        module, args, shapes = target.exported(bucket)
        program = torch.export.export(module, args, dynamic_shapes=(shapes,), strict=False)  # (shapes,): *inputs
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=settings)
    partial.replace(path)


def load(path: Path) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The packaged pass, called with the traced function's arguments; returns its outputs."""
    return torch._inductor.aoti_load_package(str(path))
