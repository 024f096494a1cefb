"""Compiled forward passes, built in the background and cached on disk; eager serves until each is ready.

The compiler fills the `compiled` dict (bucket -> compiled function) of four classes, its targets: `DecodeStep`
(server/execution/decoder/step.py: one bucket per row count, its key columns a dynamic dimension), `PromptPass`
(prompt_pass.py beside it: one graph, group size and prompt length dynamic), `VerifyPass` (verify_pass.py beside
it: the draft check, one graph, on the CPU only) and `EncoderStep` (server/execution/encoder_step.py: one bucket
per padded length). `BackgroundCompiler.run` writes a bucket's entry once its graph is built and checked; each
class reads its own dict at every call, on the compute thread, and serves a bucket without an entry otherwise
(eagerly, or, for the decode step, on a larger built bucket; the runner has no draft check without one).

A pass is built regionally or whole. Regional (the GPT's decode steps, first): every block is one nested compile
region, traced and built once for all layers, the weights graph inputs: on the CPU the eager model's prepacked
layers (server/execution/decoder/prepacked.py), bound to the graph's direct call; quick to build; on the CPU one
graph serves every decode bucket of 2 or more rows (`shared_graph`, the rows dynamic). Whole, on the
CPU with inductor's freezing: the weights become constants, which the C++ GEMM template needs, and oneDNN's linear
layers take their bias and activation: slower to build, and a copy of the weights, so only a bucket the template
serves (DecodeStep.freezes) is then built whole too, its frozen graph replacing the regional one: compiled steps
soon after start-up, the fastest ones later (docs/BENCHMARKS.md, "Compiling"). Freezing is set in inductor's config
around the first call (passed as torch.compile(options=...) it never takes effect). On CUDA a step is built
regionally with inductor's defaults (Triton kernels), and the compute thread replays it as a CUDA graph per shape
(server/execution/decoder/cuda_graphs.py).

A bucket's pass is compiled on a background thread (at the lowest CPU priority, pausing while the compute thread
has work: compute_thread.py, `YieldToRequests`), on scratch tensors of the bucket's shapes, and checked on a real
request's inputs against the traced function run eagerly (server/execution/step_check.py) before the engine may use
it: a failure or a mismatch logs a line, shows in `states()`, and leaves the bucket as it was. The engine then
calls the built graph itself, not through dynamo (server/execution/graph_call.py). What is built is kept per
`cache_key`: inductor's artifacts, or for a whole CPU pass of a target that exports, an AOTInductor package
(server/execution/packaged.py); a restart loads them.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import time
import types
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch.compiler._cache import CacheArtifactManager  # with_fresh_cache: one build's artifacts

from server.execution.compile_cache import load_kept, save
from server.execution.compute_thread import (
    inductor_on_one_thread,
    on_own_thread,
    one_openmp_thread,
    settle_garbage,
)
from server.execution.graph_call import GraphCapture, model_tensors, skipping_guards
from server.execution.kernel_choice import PREPACKED, inductor_settings
from server.execution.packaged import SharedConstants, load, package
from server.execution.step_check import StepMismatchError, mismatch

log = logging.getLogger("tinyserve")


class Compilable(Protocol):
    device: torch.device
    dtype: torch.dtype  # the coarsest its products round to: chooses the kernels
    check_rounding: torch.dtype  # the coarsest rounding on its path (int8: quantized layers'): the check's tolerance
    model: torch.nn.Module  # what `traced` reads
    traced: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]  # compiled whole; run eagerly, the reference
    # the decode step and the prompts' pass also have `regional`: the same function over `regional_model`, a copy
    # of the model whose blocks are one compile region (decoder/regional.py), traced with the weights as graph inputs
    # bucket -> compiled, written by BackgroundCompiler.run when built and checked; read by the target's own call
    compiled: dict[Hashable, Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]]

    def example(self, bucket: Hashable) -> tuple[torch.Tensor, ...]:
        """Scratch inputs of the bucket's shapes, the same values at every call (the function may write to them)."""
        ...

    def real_inputs(self, bucket: Hashable) -> tuple[torch.Tensor, ...]:
        """Inputs a real request gives the bucket (text's tokens, a cache its prompts filled), new at every call."""
        ...

    def logits(self, output) -> torch.Tensor:
        """The next-token logits (..., vocab) in what the function returned: what the check compares."""
        ...

    def matmul_rows(self, bucket: Hashable) -> int | None:
        """The rows of the bucket's matrix products (what picks their kernel); None: any (a dynamic dimension)."""
        ...


def own_code(fn: Callable, name: str) -> Callable:
    """fn with a code object of its own: dynamo keeps compiled graphs per code object, so each bucket's
    graph is the only entry of its cache (no recompile limit to hit, no chain of guards per call)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def layout(output: torch.Tensor | tuple[torch.Tensor, ...]) -> list:
    """What a step returns, element by element: (dtype, shape), or the value of what is not a tensor."""
    outputs = output if isinstance(output, tuple) else (output,)
    return [(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in outputs]


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Sizes with their own shapes: smallest, doubling while below limit, then limit."""
    sizes = [smallest]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    return [size for size in sizes if size < limit] + [limit]


class Pass(NamedTuple):
    """One graph to build: a target's bucket, whole (frozen on the CPU) or regional (the target's `regional`
    function, its blocks one region, the weights graph inputs: quick to build)."""

    target: Compilable
    bucket: Hashable
    regional: bool = False


class BackgroundCompiler:
    """Builds a model's passes (each a target's bucket: the decode step's row counts, the prompts' pass, the draft
    check, the encoder's lengths) in the given order, on the thread that calls `run` (the server's: the registry's
    background thread, server/execution/compute_thread.py, `behind_requests`) or on one of its own (`start`,
    which returns at once). A later pass of a bucket replaces an earlier one's graph when it is built (a frozen
    graph after the regional one)."""

    def __init__(
        self,
        passes: list[Pass | tuple],
        cache_dir: Path | None,
        key: str,
        threads: int | None = None,
        name: str = "the model",
    ) -> None:
        self.passes = [Pass(*p) for p in passes]
        self.name = name  # what the log calls the model
        self.targets = {p.bucket: p.target for p in self.passes}  # a bucket's passes are one target's
        # the OpenMP threads the compiled code runs with (the compute thread's): inductor compiles on one
        # (inductor_on_one_thread) and would size its loops to that
        self.threads = threads or torch.get_num_threads()
        self.cache_dir = cache_dir / key if cache_dir is not None else None
        # a bucket whose whole pass is packaged in the cache loads it in about a second: its regional graph, which
        # would come from inductor's cache in several, is not built
        on_disk = {p.bucket for p in self.passes if self.packages(*p[1:]) and self.artifact(p.bucket).exists()}
        self.passes = [p for p in self.passes if not (p.regional and p.bucket in on_disk)]
        self.constants = SharedConstants()  # what the model's packages bind: one packed copy of its weights
        # (target's class, `shared_graph` key) -> the regional graph several of its buckets share; None where
        # that graph failed to build (each bucket then builds its own)
        self.shared: dict[tuple[str, Hashable], Callable | None] = {}
        self.failed: dict[str, str] = {}  # pass label -> why it was not built
        self.seconds: dict[str, float] = {}  # pass label -> seconds its build took (/info reports them)
        self.building: str | None = None  # the pass label being built
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="compiler", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, target: Compilable, buckets: list[Hashable], *args, **kwargs) -> BackgroundCompiler:
        """The compiler of one target's buckets, whole."""
        return cls([Pass(target, bucket) for bucket in buckets], *args, **kwargs)

    @property
    def buckets(self) -> list[Hashable]:
        return [p.bucket for p in self.passes]

    def run(self) -> None:
        """Build every pass in turn (on the calling thread)."""
        threshold = gc.get_threshold()
        # Python's own full collections made rare meanwhile (one per 100 younger ones, not 10): they would
        # run on whatever thread allocates, and settle_garbage runs one between builds
        gc.set_threshold(threshold[0], threshold[1], 100)
        try:
            settle_garbage()  # what loading left: the first build's collections then skip it
            started = time.perf_counter()
            for target, bucket, regional in self.passes:
                label = self.building = self.label(bucket, regional)
                try:
                    t = time.perf_counter()
                    target.compiled[bucket] = on_own_thread(self.build, bucket, regional)
                    self.seconds[label] = round(time.perf_counter() - t, 1)
                    log.info("compiled %s in %.1f s", label, self.seconds[label])
                except Exception as e:  # the client never sees this
                    self.failed[label] = f"{type(e).__name__}: {e}"
                    kept = "keeps its regional graph" if bucket in target.compiled else "stays eager"
                    log.warning("%s not built, the bucket %s: %s", label, kept, self.failed[label])
                settle_garbage()
            self.building = None
            took = time.perf_counter() - started
            if self.failed:
                log.warning(
                    "%s compiled %d of %d passes in %.0f s; not built: %s",
                    self.name,
                    len(self.seconds),
                    len(self.passes),
                    took,
                    ", ".join(self.failed),
                )
            else:
                log.info("%s at full speed: all %d passes compiled in %.0f s", self.name, len(self.passes), took)
        finally:
            self.constants.forget_offered()  # what no package binds is the model's to free
            gc.set_threshold(*threshold)
            self.done.set()

    def states(self) -> dict[str, str]:
        """Each pass's state, in build order (/info): "built", "building", "waiting", or "not built: <why>"."""
        states = {}
        for _, bucket, regional in self.passes:
            label = self.label(bucket, regional)
            if label in self.seconds:
                states[label] = "built"
            elif label in self.failed:
                states[label] = f"not built: {self.failed[label]}"
            else:
                states[label] = "building" if label == self.building else "waiting"
        return states

    def label(self, bucket: Hashable, regional: bool = False) -> str:
        """e.g. DecodeStep_8, EncoderStep_16, PromptPass (bucket None), DecodeStep_1_regional: names the compiled
        function and its cache file."""
        name = type(self.targets[bucket]).__name__
        if bucket is not None:
            name += "_" + ("x".join(map(str, bucket)) if isinstance(bucket, tuple) else str(bucket))
        return name + "_regional" if regional else name

    def packages(self, bucket: Hashable, regional: bool = False) -> bool:
        """Whether the pass is kept as an AOTInductor package (packaged.py): a whole CPU pass of a target that
        says how to export it, with a cache to keep it in."""
        target = self.targets[bucket]
        exportable = hasattr(target, "exported") and target.device.type == "cpu"
        return not regional and exportable and self.cache_dir is not None

    def artifact(self, bucket: Hashable, regional: bool = False) -> Path | None:
        """Where the pass's build is kept: its AOTInductor package, or inductor's artifacts."""
        if self.cache_dir is None:
            return None
        suffix = ".pt2" if self.packages(bucket, regional) else ".bin"
        return self.cache_dir / f"{self.label(bucket, regional)}{suffix}"

    @torch.inference_mode()
    def build(self, bucket: Hashable, regional: bool = False) -> Callable[..., torch.Tensor]:
        """Compile one bucket, checked against the eager function, what was built kept for the next start."""
        if self.packages(bucket, regional):
            return self.packaged(bucket)
        return self.compiled_here(bucket, regional, self.artifact(bucket, regional))

    def packaged(self, bucket: Hashable) -> Callable[..., torch.Tensor]:
        """The whole pass from its package in the cache; where there is none, packaged, checked, and kept only then
        (a package in the cache passed the check). A pass that does not export or package is compiled in this
        process instead (and not kept)."""
        target, path = self.targets[bucket], self.artifact(bucket)
        kept, unchecked = path.exists(), path.with_name(path.stem + ".unchecked.pt2")
        try:
            if not kept:
                settings = inductor_settings(target.device, target.matmul_rows(bucket), target.dtype)
                package(target, bucket, unchecked, {**settings, "cpp.threads": self.threads})
            self.constants.add(itertools.chain(target.model.parameters(), target.model.buffers()))
            compiled = load(path if kept else unchecked, self.constants)
        except Exception as e:  # an OSError: e.g. a read-only cache
            with contextlib.suppress(OSError):
                unchecked.unlink(missing_ok=True)
            why = "could not cache" if isinstance(e, OSError) else "could not package"
            log.warning("%s %s (%s); compiled in this process", why, path, e)
            return self.compiled_here(bucket, False, None)
        if not kept:
            try:
                self.matching(bucket, target.traced, compiled)
                unchecked.replace(path)
            finally:
                unchecked.unlink(missing_ok=True)
        return compiled

    def compiled_here(self, bucket: Hashable, regional: bool, saved: Path | None) -> Callable[..., torch.Tensor]:
        """The bucket compiled in this process and checked, its compiler artifacts saved to `saved` for the next start
        (this build's alone: the record is per process); where they are kept already (only a checked build's are),
        loaded instead."""
        if saved is not None and saved.exists():
            try:
                return self.loaded(bucket, regional, saved)
            except Exception as e:  # e.g. a file cut short: built again
                log.warning("%s: could not load %s (%s); built again", self.label(bucket, regional), saved, e)
        # each bucket served by the graph its buckets share has a mark: the one it was built for beside its
        # artifacts, the others (checked on it, kept with the first's) instead of them
        key = self.shared_key(bucket) if regional else None
        graph, mark = self.shared.get(key), saved and saved.with_suffix(".shared")
        if graph is not None and mark is not None and mark.exists():
            return graph
        with CacheArtifactManager.with_fresh_cache():
            compiled = self.checked(bucket, regional)
            try:
                if saved is not None and (artifacts := torch.compiler.save_cache_artifacts()):
                    save(compiled, artifacts, saved)
                if mark is not None and key is not None and compiled is self.shared.get(key):
                    mark.touch()
            except (OSError, RuntimeError) as e:  # e.g. a read-only file system: only the cache is lost
                log.warning("could not cache %s: %s", saved, e)
        return compiled

    def loaded(self, bucket: Hashable, regional: bool, saved: Path) -> Callable[..., torch.Tensor]:
        """A kept pass, unchecked (it passed when built): its graph bound by the inputs kept beside it (nothing is
        traced), or, for a pass called through dynamo, compiled again from inductor's artifacts it holds."""
        bound = load_kept(saved, self.weights(bucket, regional))
        if bound is None:
            return self.checked(bucket, regional, check=False)
        # the shared graph, where it was built for this bucket (not a graph of its own, built when sharing failed)
        if regional and (key := self.shared_key(bucket)) is not None and saved.with_suffix(".shared").exists():
            self.shared.setdefault(key, bound)
        return bound

    def weights(self, bucket: Hashable, regional: bool) -> dict[str, torch.Tensor]:
        """The tensors the pass's function reads by name: graph inputs a direct call binds."""
        target = self.targets[bucket]
        return model_tensors(target.regional_model if regional else target.model)

    def checked(self, bucket: Hashable, regional: bool = False, check: bool = True) -> Callable[..., torch.Tensor]:
        """The bucket's compiled function, after its outputs on a real request's inputs matched the eager
        function's (`check`)."""
        target = self.targets[bucket]
        matching = self.matching if check else lambda bucket, reference, compiled: compiled
        if regional:  # inductor's defaults: nothing frozen, the products the eager model's (prepacked on the CPU)
            key = self.shared_key(bucket)
            if self.shared.get(key) is not None:  # built for an earlier bucket: checked on this one's inputs
                return matching(bucket, target.regional, self.shared[key])
            try:
                compiled = self.regional_graph(bucket, key)
            except Exception as e:
                # where torch specialises a reused region's dynamic sizes (decoder/regional.py: rows_linear)
                log.warning("%s: regional build failed (%s); one whole graph instead", self.label(bucket, True), e)
                return self.checked(bucket, check=check)
            compiled = matching(bucket, target.regional, compiled)
            if key is not None:
                self.shared.setdefault(key, compiled)
            return compiled
        settings = inductor_settings(target.device, target.matmul_rows(bucket), target.dtype)
        fallback = PREPACKED if target.device.type == "cpu" else settings
        try:
            compiled = self.compile(bucket, settings)
        except Exception as e:
            if settings == fallback:
                raise
            # the C++ GEMM template loses a dynamic size in some graphs (the additive attention score's)
            log.warning("%s: C++ GEMM template failed (%s); prepacked linear layers instead", self.label(bucket), e)
            compiled = self.compile(bucket, fallback)
        return matching(bucket, target.traced, compiled)

    def shared_key(self, bucket: Hashable) -> tuple[str, Hashable] | None:
        """The regional graph the bucket shares with others of its target (`shared_graph`), or None: its own."""
        target = self.targets[bucket]
        key = target.shared_graph(bucket) if hasattr(target, "shared_graph") else None
        return None if key is None else (type(target).__name__, key)

    def regional_graph(self, bucket: Hashable, key: tuple[str, Hashable] | None) -> Callable[..., torch.Tensor]:
        """The bucket's regional graph: the one it shares where it has one (failing that, once, its own)."""
        if key is not None and key not in self.shared:
            try:
                return self.compile(bucket, {}, regional=True, shared=True)
            except Exception as e:
                self.shared[key] = None
                log.warning("%s: no graph shared by its buckets (%s); one of its own", self.label(bucket, True), e)
        return self.compile(bucket, {}, regional=True)

    def matching(self, bucket: Hashable, reference: Callable, compiled: Callable[..., torch.Tensor]) -> Callable:
        """compiled, where on a real request's inputs it passes the check against the reference run eagerly."""
        if (why := mismatch(self.targets[bucket], bucket, reference, compiled, self.label(bucket))) is not None:
            raise StepMismatchError(why)
        return compiled

    def compile(self, bucket: Hashable, settings: dict, regional: bool = False, shared: bool = False) -> Callable:
        """The bucket's compiled function (the first call compiles it on scratch inputs; the engine calls it
        directly, the weights bound where they are graph inputs). shared: the graph its target's buckets share,
        traced on inputs whose shared dimension is dynamic."""
        target = self.targets[bucket]
        fn = own_code(target.regional if regional else target.traced, self.label(bucket, regional))
        # inductor's defaults; on CUDA no mode="reduce-overhead": the compute thread captures the CUDA graphs
        config = dict(settings)
        capture = GraphCapture("inductor")
        if target.device.type == "cpu":  # inductor compiles on one thread, for code run on self.threads
            capture, config["cpp.threads"] = GraphCapture(inductor_on_one_thread), self.threads
            # no stride asserts in the wrapper (1/6 of a regional one-row step): callers pass the traced views
            config |= {"size_asserts": False, "alignment_asserts": False}
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=capture)
        with one_openmp_thread():  # the first team of this thread comes with the compiled step's first run
            example = target.example(bucket, shared=True) if shared else target.example(bucket)
        with torch._inductor.config.patch(config):
            output = compiled(*example)
        weights = self.weights(bucket, regional) if target.device.type == "cpu" else None
        direct = capture.direct(fn, returns_tensor=isinstance(output, torch.Tensor), weights=weights)
        if direct is not None:
            if layout(direct(*target.example(bucket))) == layout(output):
                return direct
            log.info("%s: its graph's outputs are not the function's; called through dynamo", self.label(bucket))
        return skipping_guards(compiled)
