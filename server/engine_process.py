"""A completion model's engine in a process of its own (vLLM v1's API server / EngineCore split).

`engine_process=true`: the core process loads the checkpoint, builds its compiled decode steps and
runs the GenerationEngine on its compute thread with no HTTP work beside it; the server process
parses, tokenizes, routes and answers. They talk over a pipe: one message per request and per cancel
one way, one message per decode step (every event of that step, and the engine's figures) the other.
A core that dies fails its requests in flight with "error" (503 to their clients) and is started again.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from models.sampling import SamplingParams
from server.config import Settings
from server.engine import EngineStats, Event, FinishEvent, GenerationEngine, QueueFullError

log = logging.getLogger("tinyserve")


class CoreRequest:
    """The server process's handle on a request in the core: cancel() as GenerationRequest's."""

    def __init__(self, engine: CoreEngine, rid: int) -> None:
        self.engine, self.rid = engine, rid

    def cancel(self) -> None:
        self.engine._send(("cancel", self.rid))


class CoreEngine:
    """GenerationEngine's submitting side, with the engine itself in a core process."""

    def __init__(self, model_id: str, settings: Settings, context_length: int) -> None:
        self.model_id, self.settings, self.context_length = model_id, settings, context_length
        self.max_in_flight = settings.max_batch_size + settings.max_queue
        self.stats = EngineStats()  # the core's, as of its last message
        self.compiled = threading.Event()  # the core has built its compiled decode steps (or gave up)
        self._sinks: dict[int, Callable[[Event], None]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or OpenMP team inherited
        self._conn, child = ctx.Pipe()
        settings = self.settings.model_dump_json()
        self._proc = ctx.Process(target=core_main, args=(child, settings, self.model_id), daemon=True)
        self._proc.start()
        child.close()
        self.ready = threading.Event()
        threading.Thread(target=self._read, args=(self._conn,), name=f"core-{self.model_id}", daemon=True).start()

    # -- GenerationEngine's interface -------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[Event], None],
        timeout_s: float | None = None,
    ) -> CoreRequest:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.context_length}")
        if len(self._sinks) >= self.max_in_flight:
            raise QueueFullError(f"{len(self._sinks)} requests in flight (max_batch_size + max_queue)")
        rid = next(self._ids)
        self._sinks[rid] = sink
        self._send(("submit", rid, prompt_ids, params, timeout_s))
        return CoreRequest(self, rid)

    stream = GenerationEngine.stream
    generate = GenerationEngine.generate

    def stop(self) -> None:
        self._stopping = True
        self._send(None)
        self._proc.join(timeout=10)

    # -- the pipe ------------------------------------------------------------------------------

    def _send(self, message: object) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the core is gone: the reader fails its requests and starts a new one
            pass

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                message = conn.recv()
                if message == "ready":
                    self.ready.set()
                elif message == "compiled":
                    self.compiled.set()
                else:
                    events, self.stats = message
                    for rid, event in events:
                        sink = self._sinks.pop(rid) if isinstance(event, FinishEvent) else self._sinks.get(rid)
                        if sink is not None:
                            sink(event)
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        log.error(
            "engine core of %s exited (%s); failing %d requests, restarting", self.model_id, code, len(self._sinks)
        )
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(FinishEvent("error", "", 0, 0, f"the engine core exited ({code})"))
        self._start()


def core_main(conn: Connection, settings_json: str, model_id: str) -> None:
    """The core process: one model's registry (compute thread, engine, compiler) fed from the pipe."""
    from server.registry import ModelRegistry

    settings = Settings.model_validate_json(settings_json)
    settings = settings.model_copy(update={"models": [model_id], "ready_after": "all", "engine_process": False})
    registry = ModelRegistry(settings)
    registry.load_all()
    registry.start()
    engine = registry.get(model_id).engine
    lock = threading.Lock()  # the outbox and the pipe's sending end, shared by three threads
    outbox: list[tuple[int, Event]] = []
    handles = {}

    def send(message: object) -> None:
        with lock:
            conn.send(message)

    def flush() -> None:
        with lock:
            if outbox:
                conn.send((list(outbox), engine.stats))
                outbox.clear()

    run_once = engine.run_once

    def run_once_and_flush() -> None:  # one message per decode step
        run_once()
        flush()

    engine.run_once = run_once_and_flush
    send("ready")
    threading.Thread(target=lambda: (registry.compiled.wait(), send("compiled")), daemon=True).start()
    while (message := conn.recv()) is not None:
        if message[0] == "submit":
            _, rid, ids, params, timeout_s = message

            def sink(event: Event, rid: int = rid) -> None:
                with lock:
                    outbox.append((rid, event))
                if isinstance(event, FinishEvent):
                    handles.pop(rid, None)

            try:
                handles[rid] = engine.submit(ids, params, sink, timeout_s)
            except (QueueFullError, ValueError) as e:
                sink(FinishEvent("error", "", 0, len(ids), str(e)))
                flush()
        elif message[0] == "cancel" and (req := handles.get(message[1])) is not None:
            req.cancel()
            flush()
    registry.stop()
