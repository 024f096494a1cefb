"""Speculative decoding from the sequence's own n-grams (`draft_tokens`): the same tokens as decoding step by step,
fewer passes where the model agrees with its drafts."""

import types

import pytest

from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server.engine.core import GenerationEngine
from server.engine.speculation import PromptLookup, agreed, speculate
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner
from server.execution.decoder.verify_pass import VerifyPass
from server.execution.passes import Pass
from tests.conftest import run_together, tiny_gpt

FREE = {"temperature": 0, "eos_bias": float("-inf"), "logprobs": True}


def test_a_draft_is_what_followed_the_longest_earlier_match():
    lookup, tokens = PromptLookup(), [5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
    lookup.index(tokens)
    assert lookup.draft(tokens, 3) == [9, 4, 6]  # "6 7" last went on with 9 (not 8), and "4 6 7" never came before
    tokens += [9, 4]
    lookup.index(tokens)
    assert lookup.draft(tokens, 2) == [6, 7]  # "9 4" went on with 6 7
    assert lookup.draft(tokens, 10) == [6, 7, 9, 4]  # no further than the sequence
    tokens += [3]
    lookup.index(tokens)
    assert lookup.draft(tokens, 3) == []  # 3 never came before


def test_the_index_grown_token_by_token_is_the_index_made_at_once():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 3, 1]
    whole, grown = PromptLookup(), PromptLookup()
    whole.index(tokens)
    for i in range(len(tokens)):
        grown.index(tokens[: i + 1])
        partial = PromptLookup()
        partial.index(tokens[: i + 1])
        assert grown.draft(tokens[: i + 1], 3) == partial.draft(tokens[: i + 1], 3)
    assert grown.draft(tokens, 3) == whole.draft(tokens, 3) == [2, 4, 1]  # "3 1" went on with 2 4 1


def test_the_model_agrees_with_a_draft_up_to_its_first_other_token():
    assert agreed([4, 5, 6], [4, 5, 7, 1]) == 2
    assert agreed([4, 5, 6], [9, 5, 6, 1]) == 0
    assert agreed([4], [4, 2]) == 1


class Checker:
    """A runner's draft check as the engine sees it: records each call, answers with given tokens."""

    def __init__(self, greedy: list[int], context: int = 20) -> None:
        self.facts = types.SimpleNamespace(verify_tokens=4, context_length=context)
        self.greedy, self.calls = greedy, []

    def verify(self, tokens, position, eos_bias, table):
        self.calls.append((tokens, position, eos_bias))
        return self.greedy, [-float(i) for i in range(len(self.greedy))]


def test_a_check_takes_the_pending_token_and_padded_drafts_with_each_tokens_eos_bias():
    lookup, tokens = PromptLookup(), [1, 2, 3, 9, 1, 2]
    lookup.index(tokens)
    runner = Checker([3, 9, 5, 7])
    made = speculate(runner, lookup, tokens, 6, lambda i: 10.0 * i, limit=3, table=[1])
    assert runner.calls == [([2, 3, 9, 1], 6, [0.0, 10.0, 20.0, 30.0])]  # "1 2" went on with 3 9 1
    assert made == ([3, 9, 5], [0.0, -1.0, -2.0], 3)  # 3 and 9 agreed, then the model's own 5
    speculate(runner, lookup, tokens, 6, lambda i: 0.0, limit=1, table=[1])
    assert runner.calls[-1][0] == [2, 3, 3, 3]  # one draft, padded


def test_no_check_runs_past_the_context_or_without_a_draft():
    lookup, tokens = PromptLookup(), [1, 2, 1]
    lookup.index(tokens)
    runner = Checker([2, 1, 2, 1], context=20)
    assert speculate(runner, lookup, tokens, 16, lambda i: 0.0, limit=3, table=[1, 2]) is not None  # positions 16..19
    assert speculate(runner, lookup, tokens, 17, lambda i: 0.0, limit=3, table=[1, 2]) is None
    tokens += [7]
    lookup.index(tokens)
    assert speculate(runner, lookup, tokens, 10, lambda i: 0.0, limit=3, table=[1]) is None
    assert len(runner.calls) == 1


@pytest.fixture
def model(tiny_tokenizer):
    return tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=64)


def engine(model, tokenizer, drafts: int, checked: bool = True) -> GenerationEngine:
    """An engine of one row whose draft check runs eagerly (its graph counts as built), or is not ready."""
    runner = GPTRunner(model, tokenizer, 1)
    if checked:
        runner.verifier.compiled[VerifyPass.BUCKET] = runner.verifier.uncompiled
    return GenerationEngine(runner, max_batch_size=1, draft_tokens=drafts)


def same(got, expected):
    """The same tokens and finish reason, logprobs within float32 rounding (another pass computed them)."""
    assert (got[0], got[2]) == (expected[0], expected[2])
    assert got[1] == pytest.approx(expected[1], abs=1e-4)


PROMPTS = ["The castle was built in the castle was built in", "River river river", "A short one"]


@pytest.mark.parametrize("text", PROMPTS)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=40, **FREE),
        # EOS from the 6th or 7th token: inside a run of 8 (the prefill drew the first), at a check's later tokens
        SamplingParams(max_new_tokens=20, min_new_tokens=5, temperature=0, eos_bias=1e4),
        SamplingParams(max_new_tokens=20, min_new_tokens=6, temperature=0, eos_bias=1e4),
        SamplingParams(max_new_tokens=30, temperature=0, eos_bias=-3.0, eos_bias_decay=0.5, eos_bias_start=2),
    ],
)
def test_drafts_checked_give_the_tokens_of_step_by_step(model, tiny_tokenizer, text, params):
    ids = tiny_tokenizer.encode(text).ids
    plain = engine(model, tiny_tokenizer, 0)
    expected = run_together(plain, [ids], params)[0]
    drafting = engine(model, tiny_tokenizer, 3)
    same(run_together(drafting, [ids], params)[0], expected)
    assert drafting.stats.decode_steps <= plain.stats.decode_steps
    assert drafting.stats.draft_tokens_agreed <= drafting.stats.draft_tokens


def test_agreed_drafts_save_passes(model, tiny_tokenizer):
    """An untrained model's greedy text repeats itself: most of its drafts are its own tokens."""
    ids = tiny_tokenizer.encode(PROMPTS[0]).ids
    params = SamplingParams(max_new_tokens=40, **FREE)
    plain, drafting = engine(model, tiny_tokenizer, 0), engine(model, tiny_tokenizer, 3)
    same(run_together(drafting, [ids], params)[0], run_together(plain, [ids], params)[0])
    s = drafting.stats
    assert s.draft_tokens_agreed > 0
    assert s.decode_steps == plain.stats.decode_steps - s.draft_tokens_agreed  # one pass saved per agreed token


def test_a_stop_token_drawn_in_a_check_ends_the_row_there(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPTS[0]).ids
    free = run_together(engine(model, tiny_tokenizer, 0), [ids], SamplingParams(max_new_tokens=40, **FREE))[0][0]
    stop = free[12]
    params = SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=[stop])
    tokens, _, reason = run_together(engine(model, tiny_tokenizer, 3), [ids], params)[0]
    assert (tokens, reason) == (free[: free.index(stop) + 1], "eos_token")


def test_rows_up_to_the_context_and_max_new_tokens_keep_their_tokens(model, tiny_tokenizer):
    """The last checks near the end of the context (64) or of max_new_tokens make no token past either."""
    ids = tiny_tokenizer.encode(" ".join(["The castle was built in"] * 4)).ids
    for params in (SamplingParams(max_new_tokens=200, **FREE), SamplingParams(max_new_tokens=17, **FREE)):
        expected = run_together(engine(model, tiny_tokenizer, 0), [ids], params)[0]
        same(run_together(engine(model, tiny_tokenizer, 3), [ids], params)[0], expected)


def test_draft_tokens_caps_each_draft(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPTS[0]).ids
    one = engine(model, tiny_tokenizer, 1)
    checks = []
    verify = one.runner.verify
    one.runner.verify = lambda *args: checks.append(args) or verify(*args)
    run_together(one, [ids], SamplingParams(max_new_tokens=40, **FREE))
    assert checks and one.stats.draft_tokens == len(checks)  # one draft token a check


def test_no_check_until_its_pass_is_built_nor_with_two_rows(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPTS[0]).ids
    params = SamplingParams(max_new_tokens=30, **FREE)
    unbuilt = engine(model, tiny_tokenizer, 3, checked=False)
    run_together(unbuilt, [ids], params)
    assert unbuilt.stats.draft_tokens == 0
    runner = GPTRunner(model, tiny_tokenizer, 2)
    runner.verifier.compiled[VerifyPass.BUCKET] = runner.verifier.uncompiled
    two = GenerationEngine(runner, max_batch_size=2, draft_tokens=3)
    run_together(two, [ids, ids], params)
    assert two.stats.draft_tokens == 0


@pytest.mark.compile
def test_the_compiled_check_is_built_and_gives_the_eager_tokens(model, tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPTS[0]).ids
    params = SamplingParams(max_new_tokens=40, **FREE)
    expected = run_together(engine(model, tiny_tokenizer, 0), [ids], params)[0]
    runner = GPTRunner(model, tiny_tokenizer, 1)
    passes = [p for p in runner.compile_passes(1) if p.target is runner.verifier]
    assert passes == [Pass(runner.verifier, VerifyPass.BUCKET)]  # built last, after the decode step's
    compiler = BackgroundCompiler(passes, None, "test")
    compiler.run()
    assert not compiler.failed and VerifyPass.BUCKET in runner.verifier.compiled
    drafting = GenerationEngine(runner, max_batch_size=1, draft_tokens=3)
    same(run_together(drafting, [ids], params)[0], expected)
    assert drafting.stats.draft_tokens_agreed > 0
