import json

import torch

from models.generation import continuations
from models.sampling import SamplingParams, SequenceState, adjust_logits, choose_tokens, sample
from server.engine.detokenizer import StopMatcher
from tests.conftest import FIXTURES, tiny_gpt


def process_logits(logits, params, seen, generated, eos_id):
    """One row through the batched adjustment."""
    return adjust_logits(logits.unsqueeze(0), [SequenceState(params, seen, generated)], eos_id)[0]


def choose_token(logits, params, generator):
    """One row through the batched choice."""
    return choose_tokens(logits.unsqueeze(0), [SequenceState(params, [], 0, generator)])[0]


def test_stop_matcher_holds_back_possible_prefixes_and_cuts_at_the_stop():
    m = StopMatcher(["\n\n", "END"])
    assert m.feed("Hello E") == ("Hello ", False)  # "E" may start "END"
    assert m.feed("ND of") == ("", True)
    assert m.text == "Hello "


def test_stop_matcher_releases_held_text_when_it_is_not_a_stop():
    m = StopMatcher(["END"])
    assert m.feed("The E") == ("The ", False)
    assert m.feed("nd") == ("End", False)
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN"


def test_stop_matcher_finds_stops_spanning_many_feeds():
    m = StopMatcher(["abc"])
    out = [m.feed(c) for c in "xxab"] + [m.feed("c")]
    assert "".join(o for o, _ in out) == "xx" and out[-1][1]


def test_eos_bias_relaxes_with_length():
    p = SamplingParams(eos_bias=-8.0, eos_bias_decay=0.5, eos_bias_start=2)
    assert [p.eos_bias_at(n) for n in range(5)] == [-8.0, -8.0, -8.0, -4.0, -2.0]
    never = SamplingParams(eos_bias=float("-inf"), eos_bias_decay=0.5)
    assert never.eos_bias_at(100) == float("-inf")


def test_process_logits_order_and_effects():
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0, logit_bias={3: 1.0}, eos_bias=-1.0, min_new_tokens=0)
    out = process_logits(logits, p, seen=[0, 2, 0], generated=0, eos_id=1)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, -2.0, 1.5]))
    blocked = process_logits(logits, SamplingParams(min_new_tokens=3), [], generated=2, eos_id=1)
    assert blocked[1] == float("-inf")


def test_choose_token_greedy_topk_topp():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert choose_token(logits, SamplingParams(temperature=0), None) == 1
    g = torch.Generator().manual_seed(0)
    assert {choose_token(logits, SamplingParams(top_k=1), g) for _ in range(20)} == {1}
    assert {choose_token(logits, SamplingParams(top_p=0.01), g) for _ in range(20)} == {1}
    assert {choose_token(logits, SamplingParams(top_k=2), g) for _ in range(200)} == {1, 2}


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(50)
    draws = {choose_token(logits, SamplingParams(), torch.Generator().manual_seed(7)) for _ in range(5)}
    assert len(draws) == 1


def test_token_logprobs():
    logits = torch.tensor([1.0, 2.0, 3.0])
    params = SamplingParams(temperature=0, logit_bias={0: 100.0}, logprobs=True, top_logprobs=2)
    draw = sample(logits.unsqueeze(0), [SequenceState(params, [], 0)], eos_id=1)[0]
    assert draw.token == 0  # chosen after the bias; its logprob is the model's, before it
    assert abs(draw.logprob - torch.log_softmax(logits, -1)[0].item()) < 1e-6
    assert [t for t, _ in draw.top] == [2, 1]


def test_seeded_generations_are_bit_for_bit_the_recorded_ones():
    """Tokens recorded with the per-row sampler this batched one replaced (same prompts, params, seeds)."""
    for case in json.loads((FIXTURES / "recorded_sampling.json").read_text()):
        model = tiny_gpt(seed=case["model_seed"], eos_token_id=2, context_length=64)
        params = dict(case["params"])
        params["logit_bias"] = {int(k): v for k, v in params.get("logit_bias", {}).items()}
        out = model.generate(torch.tensor([case["prompt"]]), SamplingParams(**params))[0].tolist()
        assert out == case["tokens"], case


def test_a_prompts_continuations_decoded_together_are_each_the_one_generate_gives():
    """models/generation.py: one batch, rows that end early (EOS) or go on to their own limits."""
    model = tiny_gpt(seed=3, eos_token_id=2, context_length=64)
    prompt = torch.tensor([[5, 9, 14, 3]])
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.9, top_k=8, seed=seed, eos_bias=bias)
        for seed, bias in [(0, 0.0), (1, 4.0), (2, 0.0), (3, 4.0)]
    ] + [SamplingParams(max_new_tokens=7, temperature=0), SamplingParams(max_new_tokens=0)]
    each = continuations(model, prompt, params)
    assert each == [model.generate(prompt, p)[0].tolist() for p in params]
    lengths = [len(out) for out in each]
    assert min(lengths[:4]) < 20 and max(lengths[:4]) == 20 and lengths[4:] == [7, 0]  # an EOS ended one row


def test_a_batch_samples_each_seeded_row_as_if_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    params = [
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=0, repetition_penalty=1.4),
        SamplingParams(temperature=1.3, top_p=0.7, seed=2, logit_bias={3: 2.0}),
        SamplingParams(temperature=1.0, min_new_tokens=4, eos_bias=3.0, seed=3, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.6, top_k=3, top_p=0.9, repetition_penalty=1.2, seed=4),
    ]

    def rows():
        return [SequenceState(p, [1, 2, 3, i], i, torch.Generator().manual_seed(p.seed) if p.seed else None)
                for i, p in enumerate(params)]  # fmt: skip

    batch = sample(logits, rows(), eos_id=0)
    alone = [sample(logits[i : i + 1], [r], eos_id=0)[0] for i, r in enumerate(rows())]
    assert batch == alone


def test_a_constrained_greedy_row_takes_the_best_allowed_token_with_its_logprob():
    """A greedy constrained row (the first token after a prefill; the decode step chooses the others on its
    graph) takes its best allowed token, with its logprob under the model, as a row with alternatives does."""
    import ctypes
    import math

    import numpy as np
    import torch

    from models.sampling import Draw, SamplingParams, SequenceState, sample

    class Mask:  # what the sampler reads of an llguidance matcher
        def __init__(self, allowed):
            self.allowed = allowed

        def unsafe_compute_mask_ptr(self, address, size):  # llguidance's bitmask: bit j of word i, token 32 i + j
            words = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint32)), (size // 4,))
            words[:] = 0
            for t in self.allowed:
                words[t // 32] |= 1 << (t % 32)

        def deep_copy(self):
            return self

    torch.manual_seed(0)
    logits = torch.randn(2, 12)
    allowed = {3, 5, 7}
    fast = SequenceState(SamplingParams(temperature=0, logprobs=True, constraint=Mask(allowed)), [], 0)
    slow = SequenceState(SamplingParams(temperature=0, logprobs=True, top_logprobs=1, constraint=Mask(allowed)), [], 0)
    got, want = sample(logits, [fast, slow], eos_id=0)
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert got.token == best and isinstance(got, Draw)
    assert math.isclose(got.logprob, float(torch.log_softmax(logits[0], -1)[best]), abs_tol=1e-5)
    assert want.token == max(allowed, key=lambda t: float(logits[1, t]))  # the batch sampler masks alike
