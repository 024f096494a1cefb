"""Compiled forward passes, built in the background and cached on disk; eager serves until each is ready.

The compiler fills the `compiled` dict (bucket -> compiled function) of its targets: `DecodeStep`, `PromptPass`,
`VerifyPass` (server/execution/decoder/) and `EncoderStep`; each reads its own dict at every call and serves a
bucket without an entry otherwise. A pass is built regionally (every block one nested compile region, the weights
graph inputs: quick to build) or whole (on the CPU frozen, for the C++ GEMM template: slower to build, so only where
the template serves, replacing the regional graph), on a background thread that yields to requests, then checked on
a real request's inputs against the eager function (step_check.py) before it serves, and kept per `cache_key` for
the next start; worker processes may build some of them meanwhile (compile_sharing.py). docs/ARCHITECTURE.md, "The
engine, the compute thread and compiled steps", says why each choice; docs/BENCHMARKS.md, "Compiling", what it costs.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path

import torch
from torch.compiler._cache import CacheArtifactManager  # with_fresh_cache: one build's artifacts

from server.execution.compile_cache import load_kept, save
from server.execution.compile_sharing import CompiledElsewhereError, CompileWorker, WorkerSpec, split
from server.execution.compute_thread import (
    inductor_on_one_thread,
    on_own_thread,
    one_openmp_thread,
    settle_garbage,
)
from server.execution.graph_call import GraphCapture, layout, model_tensors, own_code, skipping_guards
from server.execution.kernel_choice import PREPACKED, inductor_settings, template_takes
from server.execution.packaged import SharedConstants, load, package, templates_compiled_once
from server.execution.passes import Compilable, Pass
from server.execution.step_check import StepMismatchError, mismatch

log = logging.getLogger("tinyserve")
SHARED_MARK = ".shared"  # beside a bucket's would-be artifacts: the graph its buckets share serves it, checked


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
        self.latest: dict[Hashable, int] = {}  # bucket -> the index of the pass whose graph it runs
        self.handed: list[WorkerSpec] = []  # what each worker process builds (`share_with`)
        self.workers: list[CompileWorker] = []  # those processes, while `run` runs
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

    def run(self, report: Callable[[str, str], None] | None = None) -> None:
        """Build every pass in turn (on the calling thread), each `report`ed (label, state) once it is done; a pass
        a worker builds (`share_with`) is loaded from the cache once the worker reports it."""
        threshold = gc.get_threshold()
        # Python's own full collections made rare meanwhile (one per 100 younger ones, not 10): they would
        # run on whatever thread allocates, and settle_garbage runs one between builds
        gc.set_threshold(threshold[0], threshold[1], 100)
        try:
            settle_garbage()  # what loading left: the first build's collections then skip it
            started = time.perf_counter()
            self.workers = list(filter(None, map(CompileWorker.started, self.handed)))  # beside this one's first build
            for index, (_, bucket, regional) in enumerate(self.passes):
                if self.worker_of(self.label(bucket, regional)) is None:
                    self.build_pass(index, report)
                    self.collect(report, wait=False)
            self.collect(report, wait=True)
            self.building = None
            took = time.perf_counter() - started
            if self.failed:
                count, failed = f"{len(self.seconds)} of {len(self.passes)}", ", ".join(self.failed)
                log.warning("%s compiled %s passes in %.0f s; not built: %s", self.name, count, took, failed)
            else:
                log.info("%s at full speed: all %d passes compiled in %.0f s", self.name, len(self.passes), took)
        finally:
            for worker in self.workers:
                worker.close()
            self.constants.forget_offered()  # what no package binds is the model's to free
            gc.set_threshold(*threshold)
            self.done.set()

    def build_pass(self, index: int, report: Callable[[str, str], None] | None, elsewhere: str | None = None) -> None:
        """Build the index-th pass, or load it where a worker built it (`elsewhere`: the state it reported). A later
        pass of the bucket that is in place already (a worker's, loaded first) stays."""
        target, bucket, regional = self.passes[index]
        label = self.building = self.label(bucket, regional)
        try:
            if elsewhere is not None and elsewhere != "built":
                raise CompiledElsewhereError(elsewhere.removeprefix("not built: "))
            t = time.perf_counter()
            compiled = on_own_thread(self.build, bucket, regional)
            if self.latest.get(bucket, -1) < index:
                target.compiled[bucket], self.latest[bucket] = compiled, index
            here = round(time.perf_counter() - t, 1)
            self.seconds[label] = here if elsewhere is None else self.worker_of(label).seconds[label]
            log.info("compiled %s in %.1f s%s", label, self.seconds[label], " (in a worker)" if elsewhere else "")
        except Exception as e:  # the client never sees this
            self.failed[label] = str(e) if isinstance(e, CompiledElsewhereError) else f"{type(e).__name__}: {e}"
            kept = "keeps its regional graph" if bucket in target.compiled else "stays eager"
            log.warning("%s not built, the bucket %s: %s", label, kept, self.failed[label])
        settle_garbage()
        if report is not None:
            report(label, self.states()[label])

    def share_with(self, spec: WorkerSpec, workers: int) -> None:
        """Hand groups of passes to `workers` processes, started by `run`, which build them while this compiler builds
        its own (compile_sharing.py, `split`) and finds theirs in the cache."""
        if self.cache_dir is not None:  # what the cache holds already is loaded here in a second
            built = [p for p in self.passes if not self.kept(*p[1:])]
            labels = [self.label(p.bucket, p.regional) for p in built]
            shares = [p.regional and self.shared_key(p.bucket) for p in built]
            self.handed = [replace(spec, labels=tuple(ls)) for ls in split(labels, shares, workers)[1:]]

    def kept(self, bucket: Hashable, regional: bool) -> bool:
        """Whether the cache holds the pass: its artifacts, or for a regional one the mark that the graph its buckets
        share serves it (`compiled_here`)."""
        saved = self.artifact(bucket, regional)
        return saved.exists() or (regional and saved.with_suffix(SHARED_MARK).exists())

    def worker_of(self, label: str) -> CompileWorker | None:
        return next((w for w in self.workers if label in w.labels), None)

    def collect(self, report: Callable[[str, str], None] | None, wait: bool) -> None:
        """Load the workers' passes they reported built (with `wait`, every one, in build order)."""
        for index, (_, bucket, regional) in enumerate(self.passes):
            label = self.label(bucket, regional)
            if (worker := self.worker_of(label)) is None or label in self.seconds or label in self.failed:
                continue
            state = worker.result(label, wait)
            if state is not None or wait:  # None after waiting: the worker ended without it, built here
                self.build_pass(index, report, state)

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

    def build_seconds(self) -> dict[str, float]:
        """Each built pass's seconds, in build order (a worker's passes are loaded out of it)."""
        return {label: self.seconds[label] for label in self.states() if label in self.seconds}

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
                package(target, bucket, unchecked, {**self.kernels(bucket), "cpp.threads": self.threads})
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
        graph, mark = self.shared.get(key), saved and saved.with_suffix(SHARED_MARK)
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
        if regional and (key := self.shared_key(bucket)) is not None and saved.with_suffix(SHARED_MARK).exists():
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
        settings = self.kernels(bucket)
        fallback = PREPACKED if target.device.type == "cpu" else settings
        try:
            compiled = self.compile(bucket, settings)
        except Exception as e:
            if settings == fallback:
                raise
            # a product the C++ GEMM template cannot lower that `template_takes` does not know of
            log.warning("%s: C++ GEMM template failed (%s); prepacked linear layers instead", self.label(bucket), e)
            compiled = self.compile(bucket, fallback)
        return matching(bucket, target.traced, compiled)

    def kernels(self, bucket: Hashable) -> dict:
        """Inductor's settings for the bucket's whole graph: by its rows (kernel_choice.py), the C++ GEMM template
        left out for a model it cannot lower (`template_takes`)."""
        target = self.targets[bucket]
        settings = inductor_settings(target.device, target.matmul_rows(bucket), target.dtype, target.weights_bytes)
        if target.device.type == "cpu" and not template_takes(getattr(target, "model", None)):
            return dict(PREPACKED)
        return settings

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
        with torch._inductor.config.patch(config), templates_compiled_once():
            output = compiled(*example)
        weights = self.weights(bucket, regional) if target.device.type == "cpu" else None
        direct = capture.direct(fn, returns_tensor=isinstance(output, torch.Tensor), weights=weights)
        if direct is not None:
            if layout(direct(*target.example(bucket))) == layout(output):
                return direct
            log.info("%s: its graph's outputs are not the function's; called through dynamo", self.label(bucket))
        return skipping_guards(compiled)
