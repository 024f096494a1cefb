"""Sharing a model's builds with worker processes (compile_worker.py): on the CPU a build is mostly one thread of
Python (dynamo, AOT autograd, inductor's code generation), so on two cores two builds at once take about as long as
one. Which passes each process builds (`split`), and the server's side of a worker (`CompileWorker`): the worker
builds and checks its passes into the compile cache as any build, says so a line each, and the server's compiler
loads them from the cache as at a warm start (docs/ARCHITECTURE.md, "The engine, the compute thread and compiled
steps")."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("tinyserve")


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs to build the same passes as the server: load_runner's arguments as the server called it
    (the device and dtype as text, e.g. "cpu", "bfloat16"), the compiler's, and the labels of the passes it builds."""

    load: tuple
    compile_max_batch: int
    cache_dir: str
    key: str
    threads: int
    name: str
    labels: tuple[str, ...]


class CompiledElsewhereError(RuntimeError):
    """A worker's build of the pass failed (the reason as it reported it)."""


def groups(labels: Sequence[str], shares: Sequence[Hashable]) -> list[list[str]]:
    """The passes in build order, in groups a process builds together: the buckets sharing one regional graph
    (`shares`: each pass's shared-graph key, falsy for a graph of its own) go with the first, which builds it."""
    out: list[list[str]] = []
    first: dict[Hashable, list[str]] = {}
    for label, key in zip(labels, shares, strict=True):
        if key and key in first:
            first[key].append(label)
            continue
        out.append([label])
        if key:
            first[key] = out[-1]
    return out


def split(labels: Sequence[str], shares: Sequence[Hashable], workers: int) -> list[list[str]]:
    """Each process's passes: the server's (index 0) and each worker's, the groups dealt out in build order (the
    server's first pass is the first: the smallest decode bucket, what a lone request runs); no empty worker's."""
    dealt: list[list[str]] = [[] for _ in range(workers + 1)]
    for i, group in enumerate(groups(labels, shares)):
        dealt[i % (workers + 1)].extend(group)
    return dealt[:1] + [labels for labels in dealt[1:] if labels]


class CompileWorker:
    """The worker process of one model's compiler: started at once (its import and load beside the server's first
    build), read a line a pass; `result` is a pass's state as the worker reported it ("built", "not built: why") or
    None once the worker ended without one (the server then builds it itself)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.labels = set(spec.labels)
        self.seconds: dict[str, float] = {}
        self._results: dict[str, str] = {}
        self._ended = False
        self._changed = threading.Condition()
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads)}
        root = Path(__file__).resolve().parents[2]  # where `server` imports from, wherever the server was started
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server.execution.compile_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=root,
        )  # fmt: skip
        self.process.stdin.write(json.dumps(asdict(spec)) + "\n")
        self.process.stdin.flush()  # kept open: the worker ends when the server does
        threading.Thread(target=self._read, name="compile-worker-reader", daemon=True).start()

    @classmethod
    def started(cls, spec: WorkerSpec) -> CompileWorker | None:
        """The worker, or None where it could not start (its passes are then built in the server)."""
        try:
            return cls(spec)
        except OSError as e:
            log.warning("no compile worker for %s (%s); the server builds its passes", spec.name, e)
            return None

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                report = json.loads(line)
                label, state = report["label"], report["state"]
            except (ValueError, KeyError, TypeError):
                continue  # not a report (a library printed something)
            with self._changed:
                self._results[label] = state
                self.seconds[label] = float(report.get("seconds", 0.0))
                self._changed.notify_all()
        self.process.wait()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def result(self, label: str, wait: bool = True) -> str | None:
        """The pass's reported state; without `wait`, None until it is reported."""
        with self._changed:
            while wait and label not in self._results and not self._ended:
                self._changed.wait()
            return self._results.get(label)

    def close(self) -> None:
        """End the worker (its passes are collected, or the server stops)."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
