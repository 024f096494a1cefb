"""Several decode steps between two schedules (`steps_per_schedule`): the same tokens as a schedule every step,
and back to one step a schedule wherever a row's next token needs the engine."""

import ctypes

import pytest

from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server.engine.core import GenerationEngine
from server.engine.events import Sampled
from server.execution.decoder.runner import GPTRunner
from tests.conftest import run_together, tiny_gpt

FREE = {"temperature": 0, "eos_bias": float("-inf"), "logprobs": True}


@pytest.fixture
def model(tiny_tokenizer):
    return tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=64)


def engine(model, tokenizer, steps: int, rows: int = 4) -> GenerationEngine:
    return GenerationEngine(GPTRunner(model, tokenizer, rows), max_batch_size=rows, steps_per_schedule=steps)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=21, **FREE),
        SamplingParams(max_new_tokens=20, min_new_tokens=7, temperature=0, eos_bias=1e4),  # EOS from the 8th token
        SamplingParams(max_new_tokens=20, temperature=0, eos_bias=-3.0, eos_bias_decay=0.5, eos_bias_start=2),
    ],
)
def test_steps_back_to_back_give_the_tokens_of_a_schedule_every_step(model, tiny_tokenizer, params):
    prompts = [tiny_tokenizer.encode(t).ids for t in ("The castle was built in", "River", "A short one")]
    one = engine(model, tiny_tokenizer, 1)
    expected = run_together(one, prompts, params)
    eight = engine(model, tiny_tokenizer, 8)
    assert run_together(eight, prompts, params) == expected
    assert eight.stats.decode_steps == one.stats.decode_steps  # none run past a row's end


def test_constrained_rows_run_back_to_back_to_the_tokens_of_a_schedule_every_step(model, tiny_tokenizer):
    """A grammar's mask follows each token of a multi-step run, and the run ends where the grammar does."""
    from llguidance import LLMatcher, LLTokenizer

    vocabulary = LLTokenizer(tiny_tokenizer.to_str(), n_vocab=model.config.vocab_size, eos_token=0)
    grammars = ['start: "the " WORD " was " WORD\nWORD: /[a-z]{2,12}/', 'start: /[a-z ]{40,60}/']
    prompts = [tiny_tokenizer.encode(t).ids for t in ("The castle was built in", "River", "A short one")]
    for grammar in grammars:
        params = SamplingParams(max_new_tokens=40, constraint=LLMatcher(vocabulary, LLMatcher.grammar_from_lark(
            grammar)), **FREE)  # fmt: skip
        one = engine(model, tiny_tokenizer, 1)
        expected = run_together(one, prompts, params)
        eight = engine(model, tiny_tokenizer, 8)
        assert run_together(eight, prompts, params) == expected
        assert eight.stats.decode_steps == one.stats.decode_steps  # none run past a row's end
        assert {reason for _, _, reason in expected} == {"eos_token"}  # complete grammars, before 40 tokens


def test_a_row_that_ends_ends_the_steps(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("The castle was built in").ids
    free = run_together(engine(model, tiny_tokenizer, 1), [ids], SamplingParams(max_new_tokens=20, **FREE))[0][0]
    stop = free[4]
    first = free.index(stop)
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop])
    eight = engine(model, tiny_tokenizer, 8)
    tokens, _, reason = run_together(eight, [ids], params)[0]
    assert (tokens, reason) == (free[: first + 1], "eos_token")
    assert eight.stats.decode_steps == first  # the step that drew it was the last


@pytest.mark.parametrize("event", ["arrives", "cancelled"])
def test_the_steps_stop_for_a_request_that_arrives_or_one_cancelled(model, tiny_tokenizer, event):
    """Not started: each run_once is one schedule, called here."""
    ids = tiny_tokenizer.encode("The castle was built in").ids
    eng = engine(model, tiny_tokenizer, 8)
    first = eng.submit(ids, SamplingParams(max_new_tokens=30, **FREE), lambda e: None)
    eng.run_once()  # its prefill
    decode = eng.runner.decode

    def decode_once_then(*args):
        eng.runner.decode = decode
        if event == "arrives":
            eng.submit(ids, SamplingParams(max_new_tokens=5, **FREE), lambda e: None)
        else:
            first.cancel()
        return decode(*args)

    eng.runner.decode = decode_once_then
    eng.run_once()
    assert eng.stats.decode_steps == 1
    eng.run_once()  # the newcomer admitted, the cancelled row retired
    assert eng.stats.running == (2 if event == "arrives" else 0)


def test_a_burst_that_arrives_in_two_parts_decodes_level(model, tiny_tokenizer):
    """Requests admitted while the rows running have only their first token are prefilled before those rows' next
    step, so every row of the burst ends at the same step (decoding first left the later part 8 steps behind)."""
    prompts = [tiny_tokenizer.encode(t).ids for t in ("The castle was built in", "River", "A short one")]
    params = SamplingParams(max_new_tokens=12, **FREE)
    alone = run_together(engine(model, tiny_tokenizer, 1), prompts, params)
    eng = engine(model, tiny_tokenizer, 8)
    outs: list[list] = [[] for _ in prompts]
    eng.submit(prompts[0], params, outs[0].append)
    eng.run_once()  # the first part's prefill
    for ids, out in zip(prompts[1:], outs[1:], strict=True):
        eng.submit(ids, params, out.append)
    eng.run_once()  # the second part's prefill, and no step
    assert eng.stats.decode_steps == 0
    assert [len(out) for out in outs] == [1, 1, 1]
    while eng.has_work():
        eng.run_once()
    assert eng.stats.decode_steps == params.max_new_tokens - 1  # every step ran all three rows
    assert [[e.id for e in out if isinstance(e, Sampled)] for out in outs] == [tokens for tokens, _, _ in alone]


def test_rows_under_way_step_once_before_a_newcomers_prefill(model, tiny_tokenizer):
    """Rows past their first token are not held back by arrivals (a stream of them would starve the rows), nor
    run a multi-step run ahead of the newcomer (its first token would wait 8 steps)."""
    ids = tiny_tokenizer.encode("The castle was built in").ids
    params = SamplingParams(max_new_tokens=30, **FREE)
    eng = engine(model, tiny_tokenizer, 8)
    eng.submit(ids, params, lambda e: None)
    eng.run_once()  # its prefill
    eng.run_once()  # a multi-step run
    assert eng.stats.decode_steps == 8
    eng.submit(ids, params, lambda e: None)
    eng.run_once()
    assert (eng.stats.decode_steps, eng.stats.prefill_passes, eng.stats.running) == (9, 2, 2)


class AnyToken:
    """What the engine reads of an llguidance matcher, allowing every token."""

    def deep_copy(self):
        return self

    def unsafe_compute_mask_ptr(self, address, size):
        ctypes.memset(address, 0xFF, size)

    def consume_token(self, token):
        return True

    def is_stopped(self):
        return False

    def is_error(self):
        return False


def test_one_step_a_schedule_where_the_engine_chooses_the_token(model, tiny_tokenizer):
    """Sampled rows and rows with stop sequences need the engine between two steps; greedy rows, constrained ones
    too (their mask follows each token), run up to steps_per_schedule steps, no more than their max_new_tokens
    leave."""
    ids = tiny_tokenizer.encode("The castle was built in").ids
    cases = [
        (SamplingParams(max_new_tokens=30, **FREE), 8),
        (SamplingParams(max_new_tokens=4, **FREE), 3),  # the prefill drew the first of its 4
        (SamplingParams(max_new_tokens=30, temperature=1.0, seed=0, eos_bias=float("-inf")), 1),
        (SamplingParams(max_new_tokens=30, stop=["zzz"], **FREE), 1),
        (SamplingParams(max_new_tokens=30, constraint=AnyToken(), **FREE), 8),
    ]
    for params, steps in cases:
        eng = engine(model, tiny_tokenizer, 8)
        eng.submit(ids, params, lambda e: None)
        eng.run_once()
        eng.run_once()
        assert eng.stats.decode_steps == steps, params
