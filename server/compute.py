"""The compute thread: the one thread of the process that runs torch operations.

Every thread that runs a parallel torch op gets its own OpenMP team; two teams on two cores take
turns spinning on the cores the other one needs, which halved decode speed (docs/BENCHMARKS.md).
So models are loaded, warmed up, decoded and inspected on this one thread: the engines' scheduling
loop runs here, and one-off work (fill-mask, attention, score, loading) is queued to it and runs
between two decode steps. A forward pre-hook on every served model refuses a call from any other
thread, so a route that forgets to queue its work fails loudly instead of slowing everything down.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import torch


class Scheduler(Protocol):
    """What the compute thread drives: an engine's scheduling loop, one iteration per call."""

    wake: Callable[[], None]  # set by the thread: call it when work arrives

    def has_work(self) -> bool: ...

    def run_once(self) -> None: ...

    def cancel_all(self, message: str) -> None: ...


T = TypeVar("T")


class WrongThreadError(RuntimeError):
    """A served model was called from a thread other than the compute thread."""


class ComputeThread:
    def __init__(self, name: str = "compute") -> None:
        self.name = name
        self._jobs: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._engines: list[Scheduler] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.idle = threading.Event()  # set while the thread waits for work (compiling runs then)

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
        engine.wake = self.wake

    def wake(self) -> None:
        """An engine got work."""
        with self._wake:
            self._wake.notify()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Queue fn(*args, **kwargs) to run between two decode steps."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the compute thread is stopping")
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
                    self.idle.set()
                    self._wake.wait()
                self.idle.clear()
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
