"""A burst of requests is prefilled together (`burst_gap_ms`): the engine waits while they keep arriving, never
for a request that arrives alone, at most ten gaps, and not when the batch has no room for more."""

import threading
import time

import pytest

from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server import engine_requests
from server.engine import GenerationEngine
from server.runners.decoder.runner import GPTRunner
from tests.conftest import tiny_gpt

PARAMS = SamplingParams(max_new_tokens=4, temperature=0)


@pytest.fixture
def model(tiny_tokenizer):
    return tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=64)


def engine(model, tokenizer, gap_ms: float, rows: int = 8) -> GenerationEngine:
    """Not started: each run_once is one schedule, called here."""
    return GenerationEngine(GPTRunner(model, tokenizer, rows), max_batch_size=rows, max_queue=64, burst_gap_ms=gap_ms)


def submit_later(eng: GenerationEngine, ids: list[int], delays_s: list[float]) -> threading.Thread:
    def run() -> None:
        for delay in delays_s:
            time.sleep(delay)
            eng.submit(ids, PARAMS, lambda e: None)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def timed_schedule(eng: GenerationEngine) -> float:
    t = time.monotonic()
    eng.run_once()
    return time.monotonic() - t


def test_a_burst_that_keeps_arriving_is_prefilled_in_one_pass(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("The castle was built in").ids
    eng = engine(model, tiny_tokenizer, gap_ms=300)
    for _ in range(2):  # the second arrives within a gap of the first: a burst
        eng.submit(ids, PARAMS, lambda e: None)
    later = submit_later(eng, ids, [0.1, 0.1])  # two more, 0.1 s apart
    eng.run_once()
    later.join()
    assert eng.stats.running == 4 and eng.stats.prefill_passes == 1


def test_a_request_that_arrives_alone_waits_for_nothing(model, tiny_tokenizer):
    eng = engine(model, tiny_tokenizer, gap_ms=2000)
    eng.submit(tiny_tokenizer.encode("River").ids, PARAMS, lambda e: None)
    assert timed_schedule(eng) < 1.0
    assert eng.stats.running == 1


def test_a_burst_is_waited_for_until_ten_gaps_after_its_start(model, tiny_tokenizer, monkeypatch):
    """A steady stream is an endless burst: past its first ten gaps, what arrives is admitted as it comes."""
    ids = tiny_tokenizer.encode("River").ids
    eng = engine(model, tiny_tokenizer, gap_ms=50, rows=32)
    for _ in range(2):
        eng.submit(ids, PARAMS, lambda e: None)
    later = submit_later(eng, ids, [0.02] * 29)  # one every 20 ms for 0.58 s: the burst outlasts 10 gaps (0.5 s)
    waited = timed_schedule(eng)
    later.join()
    assert 0.45 < waited < 0.58 + 0.2
    assert 2 < eng.stats.running < 31
    sleeps: list[float] = []
    monkeypatch.setattr(engine_requests.time, "sleep", sleeps.append)
    eng.submit(ids, PARAMS, lambda e: None)  # the same burst, less than a gap after the last
    eng.run_once()
    assert sleeps == []


def test_no_wait_when_the_batch_is_full(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("River").ids
    eng = engine(model, tiny_tokenizer, gap_ms=2000, rows=2)
    for _ in range(2):
        eng.submit(ids, PARAMS, lambda e: None)
    later = submit_later(eng, ids, [0.1])
    assert timed_schedule(eng) < 1.0
    later.join()
    assert eng.stats.running == 2
