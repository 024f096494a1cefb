"""Uncompiled work (decode steps, prefills) runs prepacked linear layers in bf16 on the CPU, same numbers."""

import pytest
import torch
import torch.nn as nn

from server.decode_step import DecodeStep
from server.prepacked import PrepackedLinear, prepacked_copy
from tests.conftest import tiny_gpt
from tests.test_compiled_step import VARIANTS


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_steps_run_prepacked_layers_on_a_copy_that_shares_the_other_weights(variant):
    model = tiny_gpt(vocab_size=97, context_length=64, **VARIANTS[variant]).to(torch.bfloat16).eval()
    packed = prepacked_copy(model)
    linears = [m for m in packed.modules() if isinstance(m, (nn.Linear, PrepackedLinear))]
    assert linears and all(isinstance(m, PrepackedLinear) for m in linears)
    assert all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, (nn.Linear, PrepackedLinear)))
    shared = {id(p) for p in model.parameters()}
    assert {id(p) for n, p in packed.named_parameters()} <= shared  # the packed weights are the only new tensors

    step = DecodeStep(model, 4)
    with torch.inference_mode():
        for rows in (1, 4):
            want, got = step.eager(*step.example(rows)), step.uncompiled(*step.example(rows))
            assert torch.equal(got[0], want[0])  # the greedy tokens
            assert (got[2].float() - want[2].float()).abs().max() / (1 + want[2].float().abs().max()) < 2e-2


def test_float32_steps_run_the_model_itself():
    model = tiny_gpt(vocab_size=97, context_length=64).eval()
    assert prepacked_copy(model) is model


def test_bf16_prefills_run_the_prepacked_copy_with_the_models_numbers():
    from server.runners.gpt import GPTRunner

    model = tiny_gpt(vocab_size=97, context_length=64).to(torch.bfloat16).eval()
    runner = GPTRunner(model, None, 4)
    calls = []
    packed = next(m for m in runner.step.eager_model.modules() if isinstance(m, PrepackedLinear))
    packed.register_forward_hook(lambda *args: calls.append(1))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with torch.inference_mode():
        got = runner.prefill([0, 1], prompts)
        for row, prompt in enumerate(prompts):
            want = model(torch.tensor([prompt])).logits[0, -1].float()
            assert got[row].argmax() == want.argmax()
            assert (got[row] - want).abs().max() / (1 + want.abs().max()) < 2e-2
    assert calls, "the prefill ran the plain model's linear layers"
