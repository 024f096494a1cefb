"""Compiled decode steps, built in the background and cached on disk; eager serves until each is ready.

Measured on this project's CPU (bench/bench_decode_step.py): `torch.compile` with inductor's
freezing (weights become constants, so linear layers get prepacked oneDNN kernels) is the fastest
exact candidate; cpp_wrapper, max-autotune and AOTInductor packages were not faster. On CUDA the
same step is compiled with mode="reduce-overhead", which replays it as a CUDA graph.

A bucket's step is compiled on a background thread, on scratch tensors of the bucket's shapes, and
checked against the eager step before the engine may use it: a failure or a mismatch logs a line and
leaves that bucket eager. Inductor's artifacts are saved per checkpoint, dtype, device, bucket and
torch version (torch.compiler.save_cache_artifacts), so a restarted server builds from its cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import types
from pathlib import Path

import torch

from server.decode_step import DecodeStep, StepFn

log = logging.getLogger("tinyserve")


class StepMismatchError(RuntimeError):
    """The compiled step's logits differ from the eager step's beyond the dtype's tolerance."""


# max |logit difference| / (1 + max |logit|): float32 is held to 1e-4; half precision rounds each op
# at 3-4 significant digits, and a fused kernel rounds in other places than the eager ops
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def cache_key(folder: Path, dtype: torch.dtype, device: torch.device) -> str:
    """What a compiled step depends on: the weights and config (by hash), dtype, device, torch version."""
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    weights = {name: manifest[name]["sha256"] for name in ("config.json", "model.safetensors")}
    text = json.dumps([weights, str(dtype), device.type, torch.__version__], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compile_options(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mode": "reduce-overhead"}  # CUDA graphs over the fixed-shape step
    return {"options": {"freezing": True}}


def own_code(fn: StepFn, name: str) -> StepFn:
    """fn with a code object of its own: dynamo keeps compiled graphs per code object, so each bucket's
    graph is the only entry of its cache (no recompile limit to hit, no chain of guards per call)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class StepCompiler:
    """Compiles a DecodeStep's buckets, smallest first, on a thread of its own; `start` returns at once."""

    def __init__(self, decode: DecodeStep, cache_dir: Path | None, key: str, max_rows: int) -> None:
        self.decode = decode
        self.cache_dir = cache_dir / key if cache_dir is not None else None
        self.buckets = [(b, s) for b in decode.row_buckets if b <= max_rows for s in decode.column_buckets]
        self.failed: dict[tuple[int, int], str] = {}
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="step-compiler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for bucket in self.buckets:
                try:
                    t = time.perf_counter()
                    self.decode.compiled[bucket] = self.build(bucket)
                    log.info("compiled decode step %s x %s in %.1f s", *bucket, time.perf_counter() - t)
                except Exception as e:  # the bucket stays eager; the client never sees this
                    self.failed[bucket] = f"{type(e).__name__}: {e}"
                    log.warning("decode step %s x %s stays eager: %s", *bucket, self.failed[bucket])
        finally:
            self.done.set()

    def artifact(self, bucket: tuple[int, int]) -> Path | None:
        return self.cache_dir / f"step-{bucket[0]}x{bucket[1]}.bin" if self.cache_dir is not None else None

    @torch.inference_mode()
    def build(self, bucket: tuple[int, int]) -> StepFn:
        """Compile one bucket and check it against the eager step on the same scratch inputs."""
        saved = self.artifact(bucket)
        if saved is not None and saved.exists():
            torch.compiler.load_cache_artifacts(saved.read_bytes())
        live = self.decode.inputs(bucket)[2]  # shapes only: the live cache is the compute thread's
        generator = torch.Generator(device=self.decode.device).manual_seed(0)
        cache = [torch.randn(t.shape, generator=generator, device=t.device).to(t.dtype) for t in live]
        rows, columns = bucket
        tokens = torch.arange(rows, device=self.decode.device).view(rows, 1)
        positions = (torch.arange(rows, device=self.decode.device) * 7 % columns).view(rows, 1)
        step = own_code(self.decode.eager, f"decode_step_{rows}x{columns}")
        compiled = torch.compile(step, fullgraph=True, dynamic=False, **compile_options(tokens.device))
        got = compiled(tokens, positions, *[t.clone() for t in cache]).float()
        expected = self.decode.eager(tokens, positions, *[t.clone() for t in cache]).float()
        dtype = live[0].dtype
        diff = float((got - expected).abs().max() / (1 + expected.abs().max()))
        if diff > TOLERANCE[dtype] or (dtype == torch.float32 and not torch.equal(got.argmax(-1), expected.argmax(-1))):
            raise StepMismatchError(f"relative logit difference {diff:.1e} > {TOLERANCE[dtype]:.0e}, or another argmax")
        if saved is not None and not saved.exists() and (artifacts := torch.compiler.save_cache_artifacts()):
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_bytes(artifacts[0])
        return compiled
