"""Our C++ kernels (skinny_gemm.cpp, group_gemm.cpp): each built once per machine with the C++ compiler inductor
uses, into inductor's cache folder, kept by the digest of its source (and the headers beside it: bf16.h), flags and
compiler, and loaded with ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("tinyserve")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def build(source: Path, what: str) -> ctypes.CDLL | None:
    """The library of `source`, built if this machine has none yet; None where no compiler builds it (a log line
    names `what` and why)."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        log.warning("%s is not built: no C++ compiler (%s) on PATH", what, compiler)
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # inductor's folder, TORCHINDUCTOR_CACHE_DIR

    try:
        texts = [source.read_text(), *(h.read_text() for h in sorted(source.parent.glob("*.h")))]  # and its headers
        digest = hashlib.sha256("\0".join([*texts, *FLAGS, version]).encode()).hexdigest()[:16]
        built = Path(cache_dir()) / "tinyserve" / f"{source.stem}-{digest}.so"
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            partial = built.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run([compiler, *FLAGS, str(source), "-o", str(partial)], capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("%s is not built: %s", what, done.stderr.strip()[-500:])
                return None
            partial.replace(built)  # whole or absent, for another process building it at once
    except OSError as e:  # e.g. a read-only cache folder, an install without the source
        log.warning("%s is not built: %s", what, e)
        return None
    return ctypes.CDLL(str(built))
