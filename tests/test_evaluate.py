import math

import torch
import torch.nn.functional as F

from tests.conftest import TINY_WIKI, tiny_gpt
from training.data import read_split
from training.evaluate import corpus_perplexity, sentence_scores, stream_nll


def naive_nll(model, stream: torch.Tensor) -> float:
    """Score each token with the full preceding context (up to context_length), one window per token."""
    L = model.config.context_length
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(stream)):
            ctx = stream[max(0, t - L) : t].unsqueeze(0)
            total += F.cross_entropy(model(ctx).logits[0, -1:], stream[t : t + 1], reduction="sum").item()
    return total


def test_stream_shorter_than_context_matches_naive_scoring():
    model = tiny_gpt()
    stream = torch.randint(1, 97, (20,))
    nll, n = stream_nll(model, stream)
    assert n == 19
    assert math.isclose(nll, naive_nll(model, stream), rel_tol=1e-4)


def test_sliding_windows_score_every_token_once():
    model = tiny_gpt(context_length=16)
    stream = torch.randint(1, 97, (101,))
    for stride in [16, 8, 5]:
        nll, n = stream_nll(model, stream, stride=stride, batch_size=3)
        assert n == 100
    # with stride 1 every token sees its full context window: the naive per-token computation
    short = stream[:40]
    nll, _ = stream_nll(model, short, stride=1)
    assert math.isclose(nll, naive_nll(model, short), rel_tol=1e-4)


def test_word_level_perplexity_uses_whitespace_words(tiny_trained_gpt, tiny_tokenizer):
    text = read_split(str(TINY_WIKI), "test")
    p = corpus_perplexity(tiny_trained_gpt, tiny_tokenizer, text)
    assert p.words == len(text.split())
    assert math.isclose(p.word_ppl, math.exp(p.nll / p.words))
    assert math.isclose(p.token_ppl, math.exp(p.nll / p.tokens))


def test_sentence_scores(tiny_trained_gpt, tiny_tokenizer):
    rows = sentence_scores(tiny_trained_gpt, tiny_tokenizer, ["The castle was built in 1350 .", "The river ."])
    assert [r["sentence"] for r in rows] == ["The castle was built in 1350 .", "The river ."]
    for r in rows:
        assert math.isclose(r["ppl"], math.exp(r["loss"]), rel_tol=1e-2)
