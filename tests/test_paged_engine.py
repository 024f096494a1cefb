"""The engine over the paged KV pool: requests up to the context while blocks are free, admission by blocks,
prefix caching, and no block lost whatever the order of arrivals, ends and cancellations."""

import queue
import random
import threading

import pytest
import torch

from models.kv_cache import BLOCK_TOKENS
from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.engine.events import Retired
from server.execution.decoder.runner import GPTRunner
from tests.conftest import run_together, tiny_gpt
from tests.test_compiled_step import _NoText

GREEDY = dict(temperature=0, eos_bias=float("-inf"), logprobs=True)
SAMPLED = dict(temperature=1.0, seed=7, eos_bias=float("-inf"), logprobs=True)  # tokens that vary, reproducibly


def same(got: list[tuple], want: list[tuple]) -> None:
    """The same tokens and finish reasons, the logprobs within float32's batching differences."""
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
    for (_, a, _), (_, b, _) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(vocab_size=97, context_length=256, positions="rope").eval()


def engine(model, blocks: int | None = None, rows: int = 8, **kwargs) -> GenerationEngine:
    served = GenerationEngine(GPTRunner(model, None, rows, blocks=blocks), max_batch_size=rows, max_queue=128, **kwargs)
    served.tokenizer = _NoText()  # token ids are all these tests read
    return served


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 96 + 1 for i in range(n)]


def alone(model, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Each prompt on an engine of its own, a pool of every row's whole context, prefix caching off."""
    return [run_together(engine(model, rows=1, prefix_caching=False), [p], params)[0] for p in prompts]


def test_a_long_prompt_runs_while_short_ones_decode_each_with_its_own_tokens(model):
    """The pool holds one long request and seven short ones, not eight long ones: the long one may use what the
    short ones leave (a static cache of the same memory gave each of 8 slots a 26th of its context)."""
    params = SamplingParams(max_new_tokens=12, **SAMPLED)
    prompts = [prompt(200, 0)] + [prompt(10 + i, i + 1) for i in range(7)]
    blocks = 1 + (200 + 12 + 4) // BLOCK_TOKENS + 1 + 7 * 2  # the long one's, and two a short one
    served = engine(model, blocks)
    assert served.runner.facts.context_length == 256 and served.kv.pool.usable < 8 * 256 // BLOCK_TOKENS
    got = run_together(served, prompts, params)
    same(got, alone(model, prompts, params))
    assert served.kv.pool.held() == 0 and served.kv.pool.reserved == 0


def test_requests_beyond_the_pool_wait_for_blocks_and_all_finish_with_their_own_tokens(model):
    """64 requests of 10 to 200 tokens, far more than the pool holds at once: each waits for blocks in turn
    (none is refused, none gets another's keys), and once all have ended no block is held or lost."""
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=6, **SAMPLED)
    prompts = [prompt(rng.randrange(10, 200), seed) for seed in range(64)]
    served = engine(model, blocks=40)  # 39 usable: two long requests at most at once
    assert sum(len(p) for p in prompts) > 10 * 39 * BLOCK_TOKENS
    got = run_together(served, prompts, params)
    assert [reason for *_, reason in got] == ["length"] * 64
    same(got, alone(model, prompts, params))
    assert served.kv.pool.held() == 0 and served.kv.pool.reserved == 0 and len(served.kv.pool.free) == 39


def test_a_shared_prefix_is_read_from_cache_with_the_tokens_and_logprobs_of_a_whole_prefill(model):
    system = prompt(3 * BLOCK_TOKENS + 5, 9)  # three full blocks, then a partial one
    turns = [system + prompt(9, 1), system + prompt(20, 2), system[:40] + prompt(30, 3)]
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    results = {}
    for caching in (True, False):
        served = engine(model, prefix_caching=caching)
        served.start()
        results[caching] = []
        for ids in turns:  # one after the other: each finds what the ones before it left
            tokens, finish = served.generate(ids, params)
            results[caching].append(([e.id for e in tokens], [e.logprob for e in tokens]))
        stats = served.kv.pool.stats
        served.stop()
        # the second: the first's three full blocks; the third: two of them (40 tokens share two whole blocks)
        assert stats.cached_tokens == ((3 + 2) * BLOCK_TOKENS if caching else 0)
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    for (_, on), (_, off) in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(torch.tensor(on), torch.tensor(off), rtol=1e-5, atol=1e-5)


def test_a_chats_next_turn_finds_the_first_turns_prompt_and_reply(model):
    """The blocks a reply's tokens fill are kept too: the next turn, which repeats the reply, reads them."""
    served = engine(model)
    served.start()
    try:
        first = prompt(50, 4)
        tokens, _ = served.generate(first, SamplingParams(max_new_tokens=30, **GREEDY))
        history = first + [e.id for e in tokens]  # 80 tokens: the prompt, then the reply
        before = served.kv.pool.stats.cached_tokens
        served.generate(history + prompt(7, 5), SamplingParams(max_new_tokens=2, **GREEDY))
        assert served.kv.pool.stats.cached_tokens - before == (len(history) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    finally:
        served.stop()


def test_after_a_storm_of_arrivals_and_cancellations_no_block_is_held(model):
    rng = random.Random(1)
    served = engine(model, blocks=30)
    served.start()
    done = threading.Event()
    left = 48
    lock = threading.Lock()

    def sink(out):
        nonlocal left
        if isinstance(out, Retired):
            with lock:
                left -= 1
                if left == 0:
                    done.set()

    try:
        requests = []
        stem = prompt(40, 7)
        for i in range(48):
            ids = stem[: rng.randrange(1, 40)] + prompt(rng.randrange(1, 120), i)
            params = SamplingParams(max_new_tokens=rng.randrange(1, 40), temperature=rng.choice([0, 0.8]), seed=i)
            requests.append(served.submit(ids, params, sink))
            if rng.random() < 0.3:
                rng.choice(requests).cancel()
        assert done.wait(120)  # every request's end heard: its blocks were let go before
        assert served.kv.pool.held() == 0 and served.kv.pool.reserved == 0
        assert len(served.kv.pool.free) == served.kv.pool.usable
    finally:
        served.stop()


def test_a_prompt_longer_than_the_pool_is_refused_naming_the_limit(model):
    served = engine(model, blocks=5)  # 4 usable blocks: 64 positions, fewer than the 256 of the context
    assert served.context_length == 4 * BLOCK_TOKENS
    with pytest.raises(ValueError, match="context is 64"):
        served.submit(prompt(64, 0), SamplingParams(), queue.Queue().put)
