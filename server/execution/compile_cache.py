"""The compile cache: its key (what a compiled pass depends on, so that no entry serves another model, dtype, CPU or
version of the code it was traced from), and how a pass compiled in-process is kept in it. What the cache holds
passed the check when it was built (compiler.py), and is loaded without running it again; a graph the engine calls
directly (graph_call.py) is loaded with how its inputs are found, so a restart traces nothing."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from models import cpu
from server.execution.graph_call import BoundGraph


@functools.cache
def traced_code() -> str:
    """A digest of the code the compiled passes are traced and packaged from (models/ and this folder)."""
    root = Path(__file__).resolve().parents[2]
    files = sorted([*(root / "models").rglob("*.py"), *Path(__file__).parent.rglob("*.py")])
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:20]


def cache_key(folder: Path, dtype: torch.dtype, device: torch.device, weights="native", cache_shape=()) -> str:
    """What a compiled step depends on: the weights and config (by hash), dtype, device, the weights' form (native
    or int8), the KV cache's (slots, positions), torch version, the code traced, and on the CPU what it computes
    natively (models/cpu.py): inductor's own cache, shared by an AVX2-emulated and a native process, aborted the
    native one. What the cache holds passed the check when it was built, and is not checked again."""
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    files = {name: manifest[name]["sha256"] for name in ("config.json", "model.safetensors")}
    form = [] if weights == "native" else [weights]
    capability = [cpu.cpu_features().as_dict()] if device.type == "cpu" else []
    shape = [list(cache_shape)] if cache_shape else []
    facts = [files, str(dtype), device.type, torch.__version__, traced_code(), *form, *capability, *shape]
    text = json.dumps(facts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def save(compiled: Callable, artifacts: tuple, path: Path) -> None:
    """A build's inductor artifacts at `path` (torch's CompiledArtifact), and for a graph called directly how its
    inputs are found (the JSON beside it, written first: the artifacts mark the pass kept)."""
    from torch._inductor.standalone_compile import CacheCompiledArtifact

    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(compiled, BoundGraph):
        inputs = {"inputs": compiled.recipes, "returns_tensor": compiled.returns_tensor}
        path.with_suffix(".json").write_text(json.dumps(inputs))
    CacheCompiledArtifact(compiled, artifacts).save(path=str(path), format="binary")


def load_kept(path: Path, weights: dict[str, torch.Tensor]) -> BoundGraph | None:
    """The kept graph bound to its inputs by name; None for a pass called through dynamo, whose artifacts are only
    loaded into inductor's caches (the next compile of the same graph then builds nothing)."""
    graph = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
    if not (inputs := path.with_suffix(".json")).exists():
        return None
    kept = json.loads(inputs.read_text())
    return BoundGraph(graph, kept["inputs"], weights, kept["returns_tensor"])
