"""Background compiling: the default models first, and out of the requests' way."""

import gc
import shutil
import threading
import time

from server.config import Settings
from server.execution.compute_thread import YieldToRequests
from server.serving.registry import ModelRegistry


def _calls_made(gate: YieldToRequests, seconds: float, idle_after: float | None = None) -> int:
    """Python calls a thread gated by `gate` gets through in `seconds` (idle set after idle_after), each making a
    container as background work does (what starts the collections the gate waits at)."""
    count, stop, made = [0], threading.Event(), []

    def work() -> None:
        def one() -> None:
            count[0] += 1
            made.append([count])  # kept, as a compiler's graphs are: collections count what is kept

        with gate.gating():
            while not stop.is_set():
                one()

    thread = threading.Thread(target=work)
    thread.start()
    if idle_after is not None:
        time.sleep(idle_after)
        gate.idle.set()
    time.sleep(seconds - (idle_after or 0))
    stop.set()
    gate.idle.set()  # lets a paused thread see stop
    thread.join(5)
    return count[0]


def test_compiling_waits_while_the_compute_thread_has_work():
    busy = YieldToRequests(threading.Event(), patience_s=10, slice_s=1)
    assert _calls_made(busy, 0.5) <= 2 * gc.get_threshold()[0]  # paused at its first collection
    assert not any(getattr(c, "__self__", None) is busy for c in gc.callbacks)  # gone with the gated thread
    resumed = YieldToRequests(threading.Event(), patience_s=10, slice_s=1)
    # runs once the compute thread is idle: far past the paused bound above (57,516 calls beside a suite on 7 cores)
    assert _calls_made(resumed, 0.6, idle_after=0.3) > 20 * gc.get_threshold()[0]
    assert 0.25 < resumed.waited_s < 0.5


def test_under_endless_load_compiling_still_gets_slices():
    gate = YieldToRequests(threading.Event(), patience_s=0.2, slice_s=0.2)
    free = YieldToRequests(threading.Event(), patience_s=0.2, slice_s=0.2)
    free.idle.set()
    loaded, unloaded = _calls_made(gate, 1.2), _calls_made(free, 1.2)
    assert 0.1 * unloaded < loaded < 0.8 * unloaded  # about half the time: 0.2 s slices after 0.2 s waits
    assert gate.waited_s > 0.3


def test_the_default_models_compile_first(store, tmp_path, monkeypatch):
    """The store lists an MLM before the GPT; the default GPT (what a request without a model id gets)
    compiles first, then the default MLM, then the rest."""
    ordered = tmp_path / "store"
    for src, dst in [("tiny-mlm-softmax1", "a-mlm"), ("tiny-gpt", "b-gpt"), ("tiny-mlm-softmax0", "c-mlm")]:
        shutil.copytree(store / src, ordered / dst)
    seen = []
    monkeypatch.setattr("server.serving.registry.BackgroundCompiler.run", lambda compiler: seen.append(compiler))
    registry = ModelRegistry(Settings(store=ordered, compile_models=True, compile_max_batch=1))
    registry.load_all()
    try:
        registry.start()
        assert registry.compiled.wait(60)
        assert list(registry.models) == ["a-mlm", "b-gpt", "c-mlm"]
        targets = [c.passes[0][0] for c in seen]  # what each builds first
        assert targets == [
            registry.get(i).runner.step if i == "b-gpt" else registry.get(i).encoder_step
            for i in ("b-gpt", "a-mlm", "c-mlm")
        ]
    finally:
        registry.stop()


def test_each_build_collects_its_garbage_then_freezes_what_survives():
    """Python's full collections must not traverse what compiling leaves (they reached 800 ms and stalled
    requests): after each bucket the compiler collects the garbage, which freezing would keep forever,
    then freezes the survivors."""
    import gc
    import weakref

    import torch

    from server.execution.compiler import BackgroundCompiler

    class Unbuildable:  # every bucket fails at once: the settling must not depend on a build succeeding
        device, dtype, compiled = torch.device("cpu"), torch.float32, {}

        def matmul_rows(self, bucket):
            raise RuntimeError("not today")

    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage
    survivor = Cycle()
    survivor.me = survivor
    gone, kept = weakref.ref(garbage), weakref.ref(survivor)
    del garbage
    gc.unfreeze()
    threshold = gc.get_threshold()
    try:
        compiler = BackgroundCompiler.of(Unbuildable(), [1, 2], None, "test")
        compiler.run()
        assert set(compiler.failed) == {"Unbuildable_1", "Unbuildable_2"} and gone() is None
        assert gc.get_freeze_count() > 0 and kept() is survivor
        assert gc.get_threshold() == threshold  # Python's own collections as they were once compiling ends
    finally:
        gc.unfreeze()
