import statistics
import threading

import pytest

from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server.engine.core import GenerationEngine
from server.engine.detokenizer import Detokenizer
from server.engine.events import FinishEvent, Retired
from server.engine.rows import QueueFullError
from server.execution.decoder.runner import GPTRunner
from tests.conftest import run_together, tiny_gpt


@pytest.fixture
def engine(tiny_tokenizer):
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=64)
    eng = GenerationEngine(GPTRunner(model, tiny_tokenizer, 8), max_batch_size=8, max_queue=16)
    eng.start()
    yield eng
    eng.stop()


def prompt(engine, text="The castle was built in"):
    return engine.tokenizer.encode(text)


def test_greedy_generation_reports_tokens_and_finish(engine):
    tokens, fin = engine.generate(
        prompt(engine), SamplingParams(max_new_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    )
    assert fin.reason in {"length", "eos_token"} and fin.generated_tokens == len(
        [t for t in tokens if t.id != engine.eos_id]
    )
    assert fin.text == "".join(t.text for t in tokens) + fin.tail
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in tokens)
    assert fin.prompt_tokens == len(prompt(engine))


def test_same_seed_same_output(engine):
    p = SamplingParams(max_new_tokens=20, temperature=1.0, seed=123, eos_bias=float("-inf"))
    a = engine.generate(prompt(engine), p)[1].text
    b = engine.generate(prompt(engine), p)[1].text
    c = engine.generate(prompt(engine), SamplingParams(max_new_tokens=20, seed=124, eos_bias=float("-inf")))[1].text
    assert a == b and a != c


def test_continuous_batching_gives_the_same_tokens_as_running_alone(engine):
    """Requests that join and leave around a request never change its output, and they share its steps."""
    greedy = SamplingParams(max_new_tokens=30, temperature=0, eos_bias=float("-inf"))
    alone = [t.id for t in engine.generate(prompt(engine), greedy)[0]]
    others = [("A short one", 5), ("The museum was opened in 1850 , by workers from the valley", 12), ("River", 25)]
    results: dict[int, list[int]] = {}

    def run(i: int, text: str, n: int) -> None:
        params = SamplingParams(max_new_tokens=n, temperature=0, eos_bias=float("-inf"))
        results[i] = [t.id for t in engine.generate(prompt(engine, text), params)[0]]

    steps_before = engine.stats.decode_steps
    events = engine.stream(prompt(engine), greedy)
    first = [next(events).id for _ in range(3)]  # the others join a request already running
    threads = [threading.Thread(target=run, args=(i, text, n)) for i, (text, n) in enumerate(others)]
    for t in threads:
        t.start()
    watched = first + [e.id for e in events if not isinstance(e, FinishEvent)]
    for t in threads:
        t.join()
    assert watched == alone and all(len(results[i]) == n for i, (_, n) in enumerate(others))
    # one step gives every running row its token: one request at a time, the 72 tokens take 68 steps
    assert engine.stats.decode_steps - steps_before < 72 - 10


def test_eos_bias_changes_output_length(engine):
    """More negative EOS bias -> longer outputs on average; -inf never stops; a huge bias stops at once."""
    base = {engine.eos_id: 6.0}  # make this untrained model want to stop, then push back

    def mean_length(bias: float) -> float:
        lengths = [
            engine.generate(prompt(engine), SamplingParams(max_new_tokens=40, seed=s, logit_bias=base, eos_bias=bias))[
                1
            ].generated_tokens
            for s in range(12)
        ]
        return statistics.mean(lengths)

    short, longer = mean_length(0.0), mean_length(-6.0)
    assert longer > short + 2
    never = engine.generate(prompt(engine), SamplingParams(max_new_tokens=15, logit_bias=base, eos_bias=float("-inf")))[
        1
    ]
    assert never.reason == "length" and never.generated_tokens == 15
    now = engine.generate(prompt(engine), SamplingParams(max_new_tokens=15, eos_bias=1e4))[1]
    assert now.reason == "eos_token" and now.generated_tokens == 0


def test_eos_bias_decay_relaxes_the_penalty(engine):
    base = {engine.eos_id: 6.0}
    fixed = SamplingParams(max_new_tokens=40, seed=1, logit_bias=base, eos_bias=-12.0)
    relaxing = SamplingParams(
        max_new_tokens=40, seed=1, logit_bias=base, eos_bias=-12.0, eos_bias_decay=0.5, eos_bias_start=3
    )
    assert (
        engine.generate(prompt(engine), relaxing)[1].generated_tokens
        < engine.generate(prompt(engine), fixed)[1].generated_tokens
    )


def test_min_new_tokens(engine):
    fin = engine.generate(prompt(engine), SamplingParams(max_new_tokens=20, min_new_tokens=7, eos_bias=1e4))[1]
    assert fin.generated_tokens == 7 and fin.reason == "eos_token"


def test_stop_sequence_across_token_boundaries(engine):
    greedy = SamplingParams(max_new_tokens=30, temperature=0, eos_bias=float("-inf"))
    text = engine.generate(prompt(engine), greedy)[1].text
    stop = text[5:9]  # four characters, usually spanning tokens
    tokens, fin = engine.generate(
        prompt(engine), SamplingParams(max_new_tokens=30, temperature=0, eos_bias=float("-inf"), stop=[stop])
    )
    assert fin.reason == "stop_sequence"
    assert fin.text == text[: text.index(stop)]
    assert "".join(t.text for t in tokens) == fin.text  # nothing of the stop sequence was streamed


def test_a_stop_sequence_found_on_the_output_side_ends_the_request_in_the_engine(engine):
    """The text (and so the stop sequence) is found on the consumer's side; the engine then retires the
    row as a stop instead of running to max_new_tokens (how many steps it runs meanwhile depends on how soon the
    consumer's thread runs: on a loaded machine more than a few)."""
    greedy = SamplingParams(max_new_tokens=60, temperature=0, eos_bias=float("-inf"))
    text = engine.generate(prompt(engine), greedy)[1].text
    stop = text[3:6]
    before, stopped = engine.stats.tokens_generated, engine.stats.finished["stop_sequence"]
    fin = engine.generate(prompt(engine), SamplingParams(**{**vars(greedy), "stop": [stop]}))[1]
    assert fin.reason == "stop_sequence" and fin.generated_tokens < 10
    engine.generate(prompt(engine), SamplingParams(max_new_tokens=1))  # the step after the stop has run
    assert engine.stats.finished["stop_sequence"] == stopped + 1  # retired as what the output side found
    assert engine.stats.tokens_generated - before - 1 < 60  # not the 60 asked for (1: the request after)


def test_text_is_made_on_the_consumers_thread_not_the_compute_thread(engine, monkeypatch):
    """Detokenizing, stop sequences and the alternatives' text run where the events are read."""
    threads: set[str] = set()
    tokenizer = engine.tokenizer

    class Watched:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return tokenizer.decode(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "tokenizer", Watched())
    params = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stop=["zzz"])
    tokens, fin = engine.generate(prompt(engine), params)
    assert fin.text and threads == {threading.current_thread().name}


def test_cancel_stops_generation(engine):
    events = []
    done = threading.Event()

    def sink(e):
        events.append(e)
        if isinstance(e, Retired):
            done.set()

    req = engine.submit(prompt(engine), SamplingParams(max_new_tokens=60, eos_bias=float("-inf")), sink)
    req.cancel()
    assert done.wait(10)
    assert events[-1].reason == "cancelled" and events[-1].generated_tokens < 60


def test_timeout(engine):
    fin = engine.generate(prompt(engine), SamplingParams(max_new_tokens=60, eos_bias=float("-inf")), timeout_s=1e-6)[1]
    assert fin.reason == "timeout" and "time limit" in fin.message


def test_queue_full_and_bad_prompts(tiny_tokenizer):
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), context_length=16)
    eng = GenerationEngine(GPTRunner(model, tiny_tokenizer), max_queue=2)  # not started: nothing drains
    for _ in range(2):
        eng.submit([5, 6], SamplingParams(), lambda e: None)
    with pytest.raises(QueueFullError):
        eng.submit([5, 6], SamplingParams(), lambda e: None)
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], SamplingParams(), lambda e: None)
    with pytest.raises(ValueError, match="context is 16"):
        eng.submit(list(range(5, 21)), SamplingParams(), lambda e: None)


def test_a_cancelled_request_leaves_the_queue_at_once(tiny_tokenizer):
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), context_length=16)
    eng = GenerationEngine(GPTRunner(model, tiny_tokenizer), max_queue=2)  # not started: nothing drains
    events: list = []
    first = eng.submit([5, 6], SamplingParams(), events.append)
    eng.submit([5, 6], SamplingParams(), lambda e: None)
    first.cancel()
    assert [(type(e), e.reason) for e in events] == [(Retired, "cancelled")]
    assert eng.stats.queued == 1
    eng.submit([5, 6], SamplingParams(), lambda e: None)  # its place is free: no QueueFullError
    first.cancel()  # cancelling twice is harmless
    assert len(events) == 1
    assert eng.stats.finished["cancelled"] == 1  # counted where /metrics reads it, with no row ever made


def test_generation_stops_at_the_context_length(engine):
    fin = engine.generate(prompt(engine), SamplingParams(max_new_tokens=1000, eos_bias=float("-inf")))[1]
    assert fin.reason == "length" and fin.generated_tokens == 64 - len(prompt(engine))


def test_engine_survives_a_failing_request(engine):
    fin = engine.generate([10**6], SamplingParams(max_new_tokens=3))[1]  # token id out of range: prefill fails
    assert fin.reason == "error"
    assert (
        engine.generate(prompt(engine), SamplingParams(max_new_tokens=3, eos_bias=float("-inf")))[1].generated_tokens
        == 3
    )


def test_a_failing_sink_does_not_hurt_the_batch(engine):
    def broken(_event):
        raise RuntimeError("client gone")

    engine.submit(prompt(engine), SamplingParams(max_new_tokens=30, eos_bias=float("-inf")), broken)
    fin = engine.generate(prompt(engine), SamplingParams(max_new_tokens=10, eos_bias=float("-inf")))[1]
    assert fin.reason == "length" and fin.generated_tokens == 10


def test_incremental_detokenisation_is_exact_across_split_characters(engine):
    text = "naïve café, 東京 🙂 done"
    ids = engine.tokenizer.encode(text)
    detokenizer = Detokenizer(engine.tokenizer, stops=[])
    pieces = [detokenizer.add(token)[0] for token in ids]
    assert "".join(pieces) == text == detokenizer.text and detokenizer.finish() == ("", False)
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3  # the emoji's bytes arrive as separate tokens and wait for each other


def test_waiting_prompts_are_prefilled_together_with_the_same_result(tiny_tokenizer):
    """Prompts of different lengths admitted at once share right-padded prefill passes, grouped under
    max_prefill_tokens, and every output equals the request's output when it runs alone."""
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=64)
    texts = ["River", "The castle was built in", "A short one", "The museum was opened in 1850 , by workers"]
    ids = [tiny_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    greedy = SamplingParams(max_new_tokens=15, temperature=0, eos_bias=float("-inf"))
    alone = GenerationEngine(GPTRunner(model, tiny_tokenizer, 1), max_batch_size=1)
    alone.start()
    expected = [[e.id for e in alone.generate(i, greedy)[0]] for i in ids]
    alone.stop()
    assert len({len(i) for i in ids}) == 4  # four prompt lengths: the batched passes need padding
    for budget, passes in [(4096, 1), (1, 4)]:  # one pass for all; a pass per prompt
        eng = GenerationEngine(GPTRunner(model, tiny_tokenizer, 8), max_batch_size=8, max_prefill_tokens=budget)
        got = [tokens for tokens, _, _ in run_together(eng, ids, greedy)]  # all four admitted in the same step
        assert got == expected
        assert eng.stats.prefill_passes == passes, budget


def test_model_generate_equals_the_engine_for_the_same_seed(engine):
    """`python -m training complete` (GPT.generate) and the server share one sampler: same tokens."""
    import torch

    ids = prompt(engine)
    for params in (
        SamplingParams(max_new_tokens=20, temperature=0.9, top_k=30, top_p=0.9, seed=5, eos_bias=-2.0),
        SamplingParams(max_new_tokens=20, temperature=1.3, repetition_penalty=1.3, seed=11),
        SamplingParams(max_new_tokens=20, temperature=0),
    ):
        served = [e.id for e in engine.generate(ids, params)[0] if e.id != engine.eos_id]
        alone = engine.runner.model.generate(torch.tensor([ids]), params)[0].tolist()
        assert alone == served, params
    assert (
        len(
            {
                tuple(engine.runner.model.generate(torch.tensor([ids]), SamplingParams(20, seed=s))[0].tolist())
                for s in range(4)
            }
        )
        > 1
    )  # fmt: skip  (the seed matters)


def test_events_carry_the_text_of_tokens_and_alternatives_and_are_immutable(engine):
    import dataclasses

    params = SamplingParams(max_new_tokens=6, temperature=0, logprobs=True, top_logprobs=3, eos_bias=float("-inf"))
    tokens, _ = engine.generate(prompt(engine), params)
    decode = engine.tokenizer.decode
    for t in tokens:
        assert t.token_text == decode([t.id]) and not t.special
        assert [a.text for a in t.top_logprobs] == [decode([a.id]) for a in t.top_logprobs]
        assert [a.special for a in t.top_logprobs] == [a.id == engine.eos_id for a in t.top_logprobs]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tokens[0].text = "changed"


def test_greedy_rows_take_their_tokens_from_the_step_not_the_batch_sampler(engine, monkeypatch):
    """The decode step chooses a greedy row's token (and its logprob) on the graph: the Python sampler
    runs once per request, for the first token after the prefill, and gives the same tokens."""
    import math

    import server.engine.core as engine_module
    from models.sampling import sample

    calls = []

    def counting(logits, rows, eos):
        calls.append(len(rows))
        return sample(logits, rows, eos)

    ids = prompt(engine)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, eos_bias=float("-inf"), logprobs=True)
    slow = SamplingParams(max_new_tokens=12, temperature=0, eos_bias=float("-inf"), logprobs=True, top_logprobs=1)
    sampler_tokens, _ = engine.generate(ids, slow)  # the batch sampler at every token (top logprobs asked)
    monkeypatch.setattr(engine_module, "sample", counting)
    tokens, finish = engine.generate(ids, greedy)
    assert calls == [1] and finish.generated_tokens == 12
    assert [t.id for t in tokens] == [t.id for t in sampler_tokens]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(tokens, sampler_tokens, strict=True))


def test_a_batch_larger_than_the_runners_slots_is_refused(tiny_trained_gpt, tiny_tokenizer):
    runner = GPTRunner(tiny_trained_gpt, tiny_tokenizer, 4)
    with pytest.raises(ValueError, match="max_batch_size 8 > the runner's 4 slots"):
        GenerationEngine(runner, max_batch_size=8)
    assert GenerationEngine(runner).max_batch_size == 4  # its slots, unless fewer are asked for
