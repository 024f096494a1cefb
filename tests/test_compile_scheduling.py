"""Background compiling: the default models first, and out of the requests' way."""

import gc
import shutil
import threading
import time

from server.config import Settings
from server.execution.compute_thread import YieldToRequests
from server.serving.registry import ModelRegistry


class GatedWork:
    """A thread gated by `gate` making Python calls, each making a container as background work does (what starts
    the collections the gate waits at); `calls` counts them."""

    def __init__(self, gate: YieldToRequests) -> None:
        self.gate, self.calls, self.made, self.stop = gate, 0, [], threading.Event()
        self.thread = threading.Thread(target=self.work)

    def work(self) -> None:
        with self.gate.gating():
            while not self.stop.is_set():
                self.calls += 1
                self.made.append([self.calls])  # kept, as a compiler's graphs are: collections count what is kept

    def __enter__(self) -> "GatedWork":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.gate.idle.set()  # lets a paused thread see stop
        self.thread.join(5)


def wait_for(condition, timeout_s: float = 60) -> bool:
    """Whether condition() came true within timeout_s (a bound for a stalled thread, not a timing)."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def paused(work: GatedWork) -> bool:
    """Whether the work stopped making calls (it waits at the gate)."""
    before = work.calls
    time.sleep(0.1)
    return work.calls == before


# Far past what a paused thread makes (one collection's worth of calls, give or take one): the thread ran.
RAN = 20


def test_compiling_waits_while_the_compute_thread_has_work():
    busy = YieldToRequests(threading.Event(), patience_s=600, slice_s=1)
    with GatedWork(busy) as work:
        assert wait_for(lambda: work.calls > 0 and paused(work))  # at its first collection: requests go first
        held = time.monotonic()
        assert work.calls <= 2 * gc.get_threshold()[0] and paused(work)  # and it stays paused
        waited = time.monotonic() - held
        busy.idle.set()  # the compute thread is idle: the work runs, far past the paused bound
        assert wait_for(lambda: work.calls > RAN * gc.get_threshold()[0])
    assert not any(getattr(c, "__self__", None) is busy for c in gc.callbacks)  # gone with the gated thread
    assert busy.waited_s >= waited  # the time it gave to requests is counted (at least what was seen of it)


def test_under_endless_load_compiling_still_gets_slices():
    gate = YieldToRequests(threading.Event(), patience_s=0.2, slice_s=0.2)
    free = YieldToRequests(threading.Event(), patience_s=0.2, slice_s=0.2)
    free.idle.set()
    with GatedWork(gate) as loaded:
        # the compute thread never idles: the work waits out its patience, runs a slice, waits again, and still
        # gets far past the paused bound
        assert wait_for(lambda: gate.waited_s >= 2 * 0.9 * gate.patience_s)
        assert wait_for(lambda: loaded.calls > RAN * gc.get_threshold()[0])
    with GatedWork(free) as unloaded:
        assert wait_for(lambda: unloaded.calls > RAN * gc.get_threshold()[0])
    assert free.waited_s == 0  # with nothing to wait for it never waits


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
