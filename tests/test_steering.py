"""Activation steering: the decoder's `steer` input against forward hooks (ours and transformers'), steered and
plain rows in one batch, the prefix cache keyed by the steer, and the steering table's rows."""

from __future__ import annotations

import queue

import pytest
import torch

from model_store.store import load_gpt
from models.sampling import SamplingParams
from models.steering import Steer, steering_hooks
from server.engine.core import GenerationEngine
from server.engine.events import Retired
from server.execution.decoder.runner import GPTRunner
from server.execution.steering import SteeringTable
from tests.conftest import tiny_gpt
from tests.test_families import byte_tokenizer, families

FAMILY_BLOCKS = {
    "llama": lambda m: m.model.layers,
    "gpt2": lambda m: m.transformer.h,
    "gpt-neox": lambda m: m.gpt_neox.layers,
}


def three_block_family(folder, name: str):
    """The family's tiny transformers model with three blocks (so that a middle block is steered), saved."""
    from transformers import PreTrainedTokenizerFast

    config_class, model_class, kwargs = families()[name]
    kwargs = dict(kwargs, **({"n_layer": 3} if name == "gpt2" else {"num_hidden_layers": 3}))
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():  # spread the logits, as tests/test_families.py does
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(False), bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    return model


def steer_for(layers: int, width: int, seed: int = 3) -> Steer:
    g = torch.Generator().manual_seed(seed)
    return Steer.added(
        layers, width, [(1, torch.randn(width, generator=g), 2.0), (2, torch.randn(width, generator=g), -1.5)]
    )


def generated(engine: GenerationEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Every prompt submitted before the engine starts (one batch from its first step); each one's tokens."""
    outs = []
    for ids, p in zip(prompts, params, strict=True):
        q: queue.Queue = queue.Queue()
        engine.submit(ids, p, q.put)
        outs.append(q)
    engine.start()
    try:
        made = []
        for q in outs:
            tokens = []
            while not isinstance(event := q.get(timeout=60), Retired):
                tokens.append(event.id)
            made.append(tokens)
        return made
    finally:
        engine.stop()


GREEDY = SamplingParams(max_new_tokens=12, temperature=0, eos_bias=float("-inf"))


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt-neox"])
def test_a_steered_request_equals_transformers_with_a_hook_adding_the_vector(tmp_path, name):
    from model_store.ingest import add_checkpoint

    theirs = three_block_family(tmp_path / "src", name)
    ours, tokenizer = load_gpt(add_checkpoint(tmp_path / "src", name, tmp_path / "store"))
    C = ours.config.d_model
    steer = steer_for(3, C)
    prompt = [5, 9, 17, 33, 40, 41, 7, 8, 99]
    with torch.no_grad(), steering_hooks(FAMILY_BLOCKS[name](theirs), steer.vectors):
        want_logits = theirs(torch.tensor([prompt])).logits[0, -1]
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        plain_logits = theirs(torch.tensor([prompt])).logits[0, -1]
    assert (want_logits - plain_logits).abs().max() > 0.5  # the vector moves the logits

    runner = GPTRunner(ours, tokenizer, 2)
    with torch.inference_mode():
        row = runner.steer(steer.vectors)
        got_logits = runner.prefill([0], [prompt], [[1]], [0], [row])[0]
        runner.unsteer(row)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-4)
    engine = GenerationEngine(GPTRunner(ours, tokenizer, 2), max_batch_size=2)
    steered = SamplingParams(**{**GREEDY.__dict__, "steer": steer})
    assert generated(engine, [prompt], [steered]) == [want[0, len(prompt) :].tolist()]


def test_our_gpts_steer_input_equals_hooks_on_its_blocks():
    model = tiny_gpt(n_layer=3)
    steer = steer_for(3, model.config.d_model)
    ids = torch.randint(97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids, steer=steer.vectors.expand(2, -1, -1)).logits
        with steering_hooks(model.blocks, steer.vectors):
            want = model(ids).logits
        plain = model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - plain).abs().max() > 0.1


def test_steered_and_plain_rows_in_one_batch_each_equal_their_solo_runs():
    model = tiny_gpt(n_layer=3, context_length=64)
    steer = steer_for(3, model.config.d_model)
    steered = SamplingParams(**{**GREEDY.__dict__, "steer": steer})
    prompts = [[5, 9, 17, 33], [40, 41, 7, 8, 12], [3, 4, 5]]
    kinds = [steered, GREEDY, steered]
    solo = [
        generated(GenerationEngine(GPTRunner(model, None, 4)), [p], [k])[0] for p, k in zip(prompts, kinds, strict=True)
    ]
    engine = GenerationEngine(GPTRunner(model, None, 4))
    together = generated(engine, prompts, kinds)
    assert together == solo
    assert solo[0] != generated(GenerationEngine(GPTRunner(model, None, 4)), [prompts[0]], [GREEDY])[0]
    assert engine.runner.step.steering.free == [4, 3, 2, 1]  # every row given back


def test_a_steered_prompt_keeps_its_own_cached_prefix():
    """The prefix cache keys a steered prompt's blocks with its vectors: a plain request's blocks are not read."""
    model = tiny_gpt(n_layer=3, context_length=96)
    steered = SamplingParams(**{**GREEDY.__dict__, "steer": steer_for(3, model.config.d_model)})
    prompt = list(range(3, 43))  # two full blocks and a tail
    engine = GenerationEngine(GPTRunner(model, None, 2), max_batch_size=1)
    plain_then_steered = generated(engine, [prompt, prompt], [GREEDY, steered])
    assert engine.kv.pool.stats.cached_tokens == 0  # the steered prompt found no block of the plain one's
    again = GenerationEngine(GPTRunner(model, None, 2), max_batch_size=1)
    twice = generated(again, [prompt, prompt], [steered, steered])
    assert again.kv.pool.stats.cached_tokens == 32  # its own blocks, found
    assert twice == [plain_then_steered[1]] * 2


def test_the_steering_table_hands_out_a_row_a_sequence_and_row_0_stays_zero():
    table = SteeringTable(3, 8, 2, torch.device("cpu"))
    a, b = table.take(torch.ones(3, 8)), table.take(2 * torch.ones(3, 8))
    assert {a, b} == {1, 2} and table.vectors[0].abs().sum() == 0
    with pytest.raises(IndexError):
        table.take(torch.ones(3, 8))
    table.drop(a)
    assert table.take(3 * torch.ones(3, 8)) == a and table.vectors[a, 0, 0] == 3
    with pytest.raises(ValueError, match="shape"):
        table.take(torch.ones(2, 8))


def test_a_prompt_longer_than_one_pass_is_steered_alike(tmp_path):
    """The prompts' pass steers every position: a steered prompt's next-token logits equal the model's forward with
    the same steer over the whole prompt, for rows of a group with unequal lengths."""
    model = tiny_gpt(n_layer=3, context_length=64)
    steer = steer_for(3, model.config.d_model)
    runner = GPTRunner(model, None, 2)
    prompts = [list(range(5, 30)), list(range(40, 50))]
    with torch.inference_mode():
        row = runner.steer(steer.vectors)
        got = runner.prefill([0, 1], prompts, [[1, 2], [3, 4]], [0, 0], [row, 0])
        want = [
            model(torch.tensor([prompts[0]]), steer=steer.vectors[None]).logits[0, -1],
            model(torch.tensor([prompts[1]])).logits[0, -1],
        ]
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)
