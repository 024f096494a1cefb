"""Our C++ kernels (skinny_gemm.cpp, group_gemm.cpp): each built once per machine with the C++ compiler inductor
uses, into inductor's cache folder, kept by the digest of its source (and the headers beside it: bf16.h), flags,
compiler and torch, and loaded with ctypes. They may register ops with torch's dispatcher through its stable ABI
(torch/csrc/stable: light headers, a build of ~2 s), so they are built against torch's headers and libraries."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("tinyserve")

LOADED: dict[Path, ctypes.CDLL] = {}  # source -> the library this process loaded
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def torch_flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags for torch's headers and libraries, as the wheel lays them out (the stable ABI's
    symbols are in libtorch_cpu; libraries go after the source, or an --as-needed linker drops them)."""
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return [f"-I{root / 'include'}"], [f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]


def inductor_cache_dir() -> str:
    """Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, or its default), from the module torch keeps free of torch's
    imports: `import torch._inductor` first imports dynamo and inductor, ~2 s that a warm start then waited for
    before loading any weights (the compiler's imports run beside the load instead: registry.py)."""
    import importlib.util

    name = "tinyserve_inductor_cache_dir"
    if name not in sys.modules:
        path = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name].cache_dir()


def build(source: Path, what: str, shapes: dict[str, Callable] | None = None) -> ctypes.CDLL | None:
    """The library of `source`, built if this machine has none yet; None where no compiler builds it (a log line
    names `what` and why). `shapes`: the shape function (fake) of each op the library registers, given to torch when
    it is loaded."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        log.warning("%s is not built: no C++ compiler (%s) on PATH", what, compiler)
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    try:
        texts = [source.read_text(), *(h.read_text() for h in sorted(source.parent.glob("*.h")))]  # and its headers
        includes, links = torch_flags()
        flags = [*FLAGS, *includes]
        facts = [*texts, *flags, *links, version, torch.__version__]
        digest = hashlib.sha256("\0".join(facts).encode()).hexdigest()[:16]
        built = Path(inductor_cache_dir()) / "tinyserve" / f"{source.stem}-{digest}.so"
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            partial = built.with_suffix(f".{os.getpid()}.tmp")
            command = [compiler, *flags, str(source), "-o", str(partial), *links]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("%s is not built: %s", what, done.stderr.strip()[-500:])
                return None
            partial.replace(built)  # whole or absent, for another process building it at once
    except OSError as e:  # e.g. a read-only cache folder, an install without the source
        log.warning("%s is not built: %s", what, e)
        return None
    if source not in LOADED:  # once a process: a second build's ops would register twice, which aborts
        try:
            LOADED[source] = ctypes.CDLL(str(built))
        except OSError as e:  # e.g. built against another torch's libraries
            log.warning("%s is not loaded: %s", what, e)
            return None
        for op, shape in (shapes or {}).items():
            torch.library.register_fake(op, shape)
    return LOADED[source]
