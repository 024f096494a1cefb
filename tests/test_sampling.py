import torch

from models.sampling import SamplingParams, choose_token, process_logits, token_logprobs
from server.detokenizer import StopMatcher


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
    lp, top = token_logprobs(logits, 0, 2)
    assert abs(lp - torch.log_softmax(logits, -1)[0].item()) < 1e-6
    assert [t for t, _ in top] == [2, 1]
