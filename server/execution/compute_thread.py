"""The compute thread: the one thread of the process that runs torch operations.

Every thread that runs a parallel torch op gets its own OpenMP team; two teams on two cores take
turns spinning on the cores the other one needs, which slows decoding badly (docs/BENCHMARKS.md, "Why these
paths").
So models are loaded, warmed up, decoded and inspected on this one thread: the engines' scheduling
loop runs here, and one-off work (fill-mask, attention, score, loading) is queued to it and runs
between two decode steps. A forward pre-hook on every served model refuses a call from any other
thread, so a route that forgets to queue its work fails loudly instead of slowing everything down.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import torch

log = logging.getLogger("tinyserve")


class Scheduler(Protocol):
    """What the compute thread drives: an engine's scheduling loop, one iteration per call; the engine calls the
    thread's `wake` when work arrives."""

    def has_work(self) -> bool: ...

    def run_once(self) -> None: ...

    def cancel_all(self, message: str) -> None: ...


T = TypeVar("T")


class WrongThreadError(RuntimeError):
    """A served model was called from a thread other than the compute thread."""


class ComputeStopping(RuntimeError):
    """Work handed to a compute thread that is stopping (the server shuts down)."""


class ComputeThread:
    def __init__(self, name: str = "compute") -> None:
        self.name = name
        self._jobs: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._engines: list[Scheduler] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.idle = threading.Event()  # set while the thread waits for work (background work runs then)
        self.busy = threading.Event()  # its complement: set while the thread has work

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the queued jobs, cancel every engine's requests and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def ident(self) -> int | None:
        return self._thread.ident if self._thread is not None else None

    def on_thread(self) -> bool:
        return self._thread is threading.current_thread()

    # -- work ----------------------------------------------------------------------------------

    def attach(self, engine: Scheduler) -> None:
        """Drive this engine's scheduling loop (admit, decode step) from the compute thread."""
        with self._wake:
            self._engines.append(engine)

    def wake(self) -> None:
        """An engine got work."""
        with self._wake:
            self._wake.notify()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Queue fn(*args, **kwargs) to run between two decode steps."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping:
                raise ComputeStopping("the compute thread is stopping")
            self._jobs.append((lambda: fn(*args, **kwargs), future))
            self._wake.notify()
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the compute thread and wait for its result (inline when already on it)."""
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call` for the event loop: awaits the result without holding a worker thread."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def guard(self, model: torch.nn.Module) -> None:
        """Refuse forward calls of this model from any other thread."""

        def check(module: torch.nn.Module, args: tuple) -> None:
            if not self.on_thread():
                raise WrongThreadError(
                    f"{type(module).__name__} called on thread {threading.current_thread().name!r}; "
                    f"queue the work to the compute thread ({self.name!r}) instead"
                )

        model.register_forward_pre_hook(check)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._jobs and not any(e.has_work() for e in self._engines):
                    self.busy.clear()
                    self.idle.set()
                    self._wake.wait()
                if not self.busy.is_set():  # on the change only: each Event call takes its lock, set() wakes waiters
                    self.idle.clear()
                    self.busy.set()
                jobs = list(self._jobs)
                self._jobs.clear()
                stopping = self._stopping
            for fn, future in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # the caller gets it; the thread keeps serving
                        future.set_exception(e)
            if stopping:
                break
            for engine in self._engines:
                if engine.has_work():
                    engine.run_once()
        for engine in self._engines:
            engine.cancel_all("server shutting down")


# background work waits for requests this long at most, then runs this long even under load
PATIENCE_S, SLICE_S = 5.0, 1.0


_gated = threading.local()  # .gate: the YieldToRequests that gates this thread, if any


class YieldToRequests:
    """A gate for background threads: at each garbage collection one of them starts, requests go first.

    Background work (loading models behind /health's 200, compiling: dynamo's tracing, inductor's code
    generation) is Python on a thread beside the compute thread, and the compute thread takes the GIL
    back after each torch op: with a thread that never waits, every take can cost a whole switch
    interval (5 ms). So while the compute thread has work, the background thread waits; under load
    that never ends, it runs `slice_s` out of every `patience_s + slice_s` seconds, so that a busy
    server still gets its models and compiled steps.

    The gate is a `gc.callbacks` entry: that work keeps what it allocates (graphs, kernels), so its thread starts
    a collection every 700 container allocations (Python's default), and between them the gate costs nothing. A
    trace function (the gate at each Python call) took CPython off its fast path on that thread: builds ran far
    slower with one, even an empty one, than with this gate, which the work still reaches every few milliseconds
    of its CPU time. More frequent collections built slower and served no faster meanwhile (docs/BENCHMARKS.md,
    "Start-up").
    """

    def __init__(self, idle: threading.Event, patience_s: float = PATIENCE_S, slice_s: float = SLICE_S) -> None:
        self.idle = idle
        self.patience_s, self.slice_s = patience_s, slice_s
        self.slice_end = 0.0
        self.waited_s = 0.0  # time the background work gave to requests
        self._threads: set[int] = set()

    @staticmethod
    def of_this_thread() -> YieldToRequests | None:
        return getattr(_gated, "gate", None)

    @contextlib.contextmanager
    def gating(self) -> Iterator[None]:
        """The calling thread waits for requests at its collections while inside."""
        self._threads.add(threading.get_ident())
        outer, _gated.gate = YieldToRequests.of_this_thread(), self
        if len(self._threads) == 1:
            gc.callbacks.append(self._on_collection)
        try:
            yield
        finally:
            self._threads.discard(threading.get_ident())
            _gated.gate = outer
            if not self._threads:
                gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start" and threading.get_ident() in self._threads:
            self.wait_turn()

    def wait_turn(self) -> None:
        """Wait while the compute thread has work, at most patience_s, then run slice_s unasked."""
        if self.idle.is_set() or time.monotonic() < self.slice_end:
            return
        t = time.monotonic()
        if not self.idle.wait(self.patience_s):
            self.slice_end = time.monotonic() + self.slice_s
        self.waited_s += time.monotonic() - t


class HelpersPaused:
    """While the compute thread has work, this process's helper processes are stopped (SIGSTOP).

    The background work's heavy part runs in other processes: inductor's compile workers and the C++
    compilers they start, and our compile worker (compile_worker.py). Niced, they still take a core whenever the
    compute thread's OpenMP team sleeps between two ops, and slowed the eager decode step beside them
    (docs/BENCHMARKS.md, "Start-up").
    Stopped while requests run, they cost requests nothing; the same patience and slice as YieldToRequests keep
    a busy server compiling. Only compile helpers are stopped (`helper_processes`), never another child.
    """

    def __init__(self, compute: ComputeThread, patience_s: float = PATIENCE_S, slice_s: float = SLICE_S) -> None:
        self.compute, self.patience_s, self.slice_s = compute, patience_s, slice_s
        self.done = threading.Event()
        self.paused_s = 0.0
        self._stopped: list[int] = []

    def run(self) -> None:
        atexit.register(self.resume)  # before torch's own exit handler, which waits for its workers
        while not self.done.is_set():
            if not self.compute.busy.wait(0.5):
                continue
            t = time.monotonic()
            self._stopped = self._signal(helper_processes(), signal.SIGSTOP)
            try:
                self.compute.idle.wait(self.patience_s)
            finally:
                self.resume(finished=False)
                self.paused_s += time.monotonic() - t
            if not self.compute.idle.is_set():
                self.done.wait(self.slice_s)  # a busy server: the helpers get their slice

    def resume(self, finished: bool = True) -> None:
        """Let the stopped helpers go on (and, at exit or when the work is done, stop pausing them)."""
        if finished:
            self.done.set()
        stopped, self._stopped = self._stopped, []
        self._signal(stopped, signal.SIGCONT)

    @staticmethod
    def _signal(pids: list[int], sig: signal.Signals) -> list[int]:
        done = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                done.append(pid)
        return done


# what a helper's command line contains: inductor's compile workers, ours (compile_worker.py), the C/C++ compilers
HELPER_MARKS = (
    b"torch/_inductor", b"torch._inductor", b"server.execution.compile_worker", b"g++", b"gcc", b"c++", b"clang"
)  # fmt: skip


def helper_processes() -> list[int]:
    """This process's children that are compile helpers (HELPER_MARKS), with all their descendants; any
    other child (a server a test started, an engine of its own) is none of the pause's business."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = open(f"/proc/{entry.name}/stat").read()  # noqa: SIM115
                    children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    found, todo = [], [pid for pid in children[os.getpid()] if _is_helper(pid)]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children[pid])
    return found


def _is_helper(pid: int) -> bool:
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115
    except OSError:
        return False  # gone, or not ours to read: leave it alone
    return any(mark in cmdline for mark in HELPER_MARKS)


def behind_requests(work: Callable[[], None], compute: ComputeThread, name: str = "background") -> threading.Thread:
    """Run `work` on a thread that yields to the compute thread and runs at the lowest CPU priority, as do
    the processes it starts (inductor's compile workers), which are stopped while requests run."""
    pause = HelpersPaused(compute)

    def run() -> None:
        with contextlib.suppress(OSError):  # a thread's own niceness (Linux); its children inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        gate = YieldToRequests(compute.idle)
        threading.Thread(target=pause.run, name=f"{name}-pause", daemon=True).start()
        try:  # the server may stop first: what is left to load or build is then not wanted
            with contextlib.suppress(ComputeStopping), gate.gating():
                work()
        finally:
            pause.resume()
            waited = f"it waited {gate.waited_s:.1f} s for requests, its helper processes {pause.paused_s:.1f} s"
            log.info("%s work done; %s", name, waited)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


# The compiler must not give the process a second OpenMP team while requests run. libgomp lets a team's
# idle workers spin only while the process has no more OpenMP threads than CPUs; with a second team (the
# compiling thread's, from freezing's constant folding) it spins them 100 iterations, so the compute
# thread's worker fell asleep between two ops and every op paid its wake-up, which slowed the eager decode
# step while the server compiled (docs/BENCHMARKS.md, "Why these paths"). So inductor compiles on one
# thread, and what runs the compiled step (its first call, the check against eager) runs on a thread that
# ends with the bucket's build: libgomp frees a thread's team when the thread ends.


@contextlib.contextmanager
def one_openmp_thread() -> Iterator[None]:
    """This thread's torch ops on one OpenMP thread (no team), its count set back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def inductor_on_one_thread(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor as torch.compile's backend, its own torch ops (freezing's constant folding) on one OpenMP
    thread. Dynamo's guards record the thread count of the call around it, which the compute thread
    matches: the count is set back before dynamo sees it."""
    from torch._inductor.compile_fx import compile_fx

    with one_openmp_thread():
        return compile_fx(graph, example_inputs)


def on_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread that ends with it, gated as the caller is (YieldToRequests: requests go first);
    its result, or its exception raised here. The compiler builds on one: libgomp frees a thread's OpenMP team
    when the thread ends (server/execution/compiler.py)."""
    outcome: list = []
    gate = YieldToRequests.of_this_thread()

    def run() -> None:
        with gate.gating() if gate is not None else contextlib.nullcontext():
            try:
                outcome.append((True, fn(*args)))
            except BaseException as e:  # handed to the caller
                outcome.append((False, e))

    thread = threading.Thread(target=run, name=f"{threading.current_thread().name}-build", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def settle_garbage() -> None:
    """Collect what a build left, freeze what survived out of later collections (full collections run on
    whichever thread allocates, the compute thread too: docs/BENCHMARKS.md, "Start-up"), and hand the C heap's
    freed memory back (glibc kept 0.9 GB a 135M model's 32-row build freed). On the compiling thread, which waits
    for running requests first (YieldToRequests)."""
    gc.collect()
    gc.freeze()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


# glibc's malloc_trim, where the C library has one (not macOS's, nor musl's)
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
MALLOC_TRIM = getattr(LIBC, "malloc_trim", None)
