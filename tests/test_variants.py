"""Every attention variant of the from-scratch GPT: causality, KV cache, padding, shapes, save/load."""

import threading
import time

import pytest
import torch

from model_store.store import load_gpt, write_checkpoint
from models.gpt import AdditiveScore
from models.positions import rope, rope_rotation
from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server.engine.core import GenerationEngine
from server.execution.decoder.runner import GPTRunner
from tests.conftest import tiny_gpt
from training.variants import VARIANTS

CAUSAL = {name: v for name, v in VARIANTS.items() if v.get("masking") != "zero_after"}


def at(t: int, rows: int) -> torch.Tensor:
    """(rows, 1) positions: one new token at position t in every row."""
    return torch.full((rows, 1), t)


def variant_gpt(name: str, **overrides):
    return tiny_gpt(**{**VARIANTS[name], **overrides})


@pytest.mark.parametrize("name", CAUSAL)
def test_changing_a_future_token_never_changes_earlier_logits(name):
    model = variant_gpt(name)
    x = torch.randint(1, 97, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(1, 97, (2, 8))
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_zero_after_masking_leaks_the_future():
    """The naive mask: earlier positions' outputs depend on later tokens (the leak the report explains)."""
    model = variant_gpt("zero-mask")
    x = torch.randint(1, 97, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(1, 97, (2, 8))
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
        cache = model.new_cache(2)
        stepwise = torch.cat([model(x[:, t : t + 1], input_pos=at(t, 2), cache=cache).logits for t in range(20)], 1)
    assert not torch.allclose(a[:, :12], b[:, :12])
    # decoding one token at a time has no future to leak: it disagrees with the full (leaky) pass
    assert not torch.allclose(stepwise[:, :-1], a[:, :-1], atol=1e-4)
    torch.testing.assert_close(stepwise[:, -1], a[:, -1], atol=1e-4, rtol=1e-4)  # the last row has no future


@pytest.mark.parametrize("name", CAUSAL)
def test_kv_cache_equals_full_recompute(name):
    model = variant_gpt(name)
    x = torch.randint(1, 97, (3, 30))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(3)
        steps = [model(x[:, :5], input_pos=torch.arange(5).expand(3, 5), cache=cache).logits]
        for t in range(5, 30):
            steps.append(model(x[:, t : t + 1], input_pos=at(t, 3), cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", CAUSAL)
def test_right_padding_gives_the_same_logits_for_real_tokens(name):
    """What the batching engine relies on: padded rows see only their own tokens, at their own positions,
    and a row's padding in the cache is never read: its decode steps overwrite it."""
    model = variant_gpt(name)
    x = torch.randint(1, 97, (1, 9))
    pad = 4
    padded = torch.cat([x[:, :5], torch.zeros(1, pad, dtype=torch.long)], dim=1)  # a 5-token prompt, padded to 9
    with torch.no_grad():
        ref = model(x).logits
        cache = model.new_cache(2)
        both = torch.cat([x, padded])  # two prompts, 9 and 5 tokens, in one pass
        out = model(both, input_pos=torch.arange(9).expand(2, 9), cache=cache).logits
        steps = [
            model(x[:, t : t + 1], input_pos=at(t, 1), cache=cache.view(1, 64, start=1)).logits for t in range(5, 9)
        ]
    torch.testing.assert_close(out[:1], ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1:, :5], ref[:, :5], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), ref[:, 5:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_shapes_and_attention_weights(name):
    model = variant_gpt(name)
    x = torch.randint(1, 97, (2, 11))
    with torch.no_grad():
        out = model(x, return_attention=True)
        plain = model(x).logits
    assert out.logits.shape == (2, 11, 97)
    torch.testing.assert_close(out.logits, plain, atol=1e-5, rtol=1e-4)  # the fused path agrees with the eager one
    for w in out.attentions:
        assert w.shape == (2, model.config.n_attention_heads, 11, 11)
        assert torch.all(w.triu(1) == 0)  # no weight on the future (zero-mask included: it zeroes them)


@pytest.mark.parametrize("name", VARIANTS)
def test_save_load_round_trip_keeps_the_variant(name, tmp_path, tiny_tokenizer):
    vocab = tiny_tokenizer.get_vocab_size()
    model = variant_gpt(name, vocab_size=vocab, eos_token_id=eos_id(tiny_tokenizer))
    write_checkpoint(tmp_path / name, model, tiny_tokenizer, card="# v\n", metrics={}, dtype=torch.float32)
    loaded, _ = load_gpt(tmp_path / name)
    assert loaded.config == model.config
    x = torch.randint(1, vocab, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("name", ["rope", "dual-relative", "dual-symbolic"])
def test_engine_batching_matches_running_alone(name, tiny_tokenizer):
    """Continuous batching (right-padded prefill into slots, slot moves) with the variants' extra cache tensors."""
    model = variant_gpt(name, vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer))
    engine = GenerationEngine(GPTRunner(model, tiny_tokenizer, 4), max_batch_size=4, max_queue=8)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, eos_bias=float("-inf"))
    prompts = ["The castle was built in", "A", "The museum was opened in 1850 , by workers"]
    ids = [tiny_tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    engine.start()
    try:
        alone = [[t.id for t in engine.generate(p, greedy)[0]] for p in ids]
        together: dict[int, list[int]] = {}

        def run(i: int) -> None:
            time.sleep(0.01 * i)  # join a batch that is already decoding
            together[i] = [t.id for t in engine.generate(ids[i], greedy)[0]]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.stop()
    assert [together[i] for i in range(len(ids))] == alone


def test_additive_score_matches_its_definition():
    torch.manual_seed(0)
    score = AdditiveScore(n_head=2, head_dim=3)
    q, k = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 5, 3)
    h, i, j = 1, 2, 3
    w1 = torch.cat([score.w1_q[h], score.w1_k[h]])  # (2D, D): W1 [q; k]
    expected = score.w2[h] @ torch.tanh(torch.cat([q[0, h, i], k[0, h, j]]) @ w1)
    torch.testing.assert_close(score(q, k)[0, h, i, j], expected)


def test_rope_dot_products_depend_only_on_the_offset():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def dot(pq: int, pk: int) -> torch.Tensor:
        at = lambda p: rope_rotation(torch.tensor([[p]]), 8, q.dtype)  # noqa: E731
        return (rope(q, at(pq)) * rope(k, at(pk))).sum()

    torch.testing.assert_close(dot(5, 2), dot(13, 10))
    assert not torch.allclose(dot(5, 2), dot(5, 4))
