"""Uncompiled work (decode steps, prefills) runs prepacked linear layers in bf16 on the CPU, same numbers."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from models import cpu
from server.execution.decoder.prepacked import PrepackedLinear, prepacked_copy, prepacks
from server.execution.decoder.step import DecodeStep
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, needs_onednn_bf16, tiny_gpt
from tests.test_compiled_step import VARIANTS


@needs_onednn_bf16
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
            want, got = step.traced(*step.example(rows)), step.uncompiled(*step.example(rows))
            assert torch.equal(got[0], want[0])  # the greedy tokens
            assert (got[2].float() - want[2].float()).abs().max() / (1 + want[2].float().abs().max()) < 2e-2


def test_float32_steps_run_the_model_itself(monkeypatch):
    emulate_cpu(monkeypatch, AVX512_BF16)  # MKL's float32 GEMM as it is
    model = tiny_gpt(vocab_size=97, context_length=64).eval()
    assert prepacked_copy(model) is model


def test_without_avx512_float32_steps_run_prepacked_layers_with_the_models_numbers(monkeypatch):
    emulate_cpu(monkeypatch, AVX2)  # aten's float32 products would go to MKL's generic path there
    model = tiny_gpt(vocab_size=97, context_length=64).eval()
    packed = prepacked_copy(model)
    assert any(isinstance(m, PrepackedLinear) for m in packed.modules())
    step = DecodeStep(model, 4)
    with torch.inference_mode():
        for rows in (1, 4):
            want, got = step.traced(*step.example(rows)), step.uncompiled(*step.example(rows))
            assert torch.equal(got[0], want[0])
            assert (got[2] - want[2]).abs().max() / (1 + want[2].abs().max()) < 1e-4


@needs_onednn_bf16
def test_bf16_prefills_run_the_prepacked_copy_with_the_models_numbers():
    from server.execution.decoder.runner import GPTRunner

    model = tiny_gpt(vocab_size=97, context_length=64).to(torch.bfloat16).eval()
    runner = GPTRunner(model, None, 4)
    calls = []
    packed = next(m for m in runner.step.eager_model.modules() if isinstance(m, PrepackedLinear))
    packed.register_forward_hook(lambda *args: calls.append(1))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with torch.inference_mode():
        got = runner.prefill([0, 1], prompts, [[1, 2], [3, 4]], [0, 0])
        for row, prompt in enumerate(prompts):
            want = model(torch.tensor([prompt])).logits[0, -1].float()
            assert got[row].argmax() == want.argmax()
            assert (got[row] - want).abs().max() / (1 + want.abs().max()) < 2e-2
    assert calls, "the prefill ran the plain model's linear layers"


@needs_onednn_bf16
def test_int8_models_keep_the_int8_kernel_for_few_rows_and_prepack_the_rest():
    from models.quantize import INT8_KERNEL_MAX_ROWS, quantize_int8
    from server.execution.decoder.prepacked import PrepackedInt8Linear

    model = quantize_int8(tiny_gpt(vocab_size=97, context_length=64).to(torch.bfloat16).eval())
    packed = prepacked_copy(model)
    layers = [m for m in packed.modules() if isinstance(m, PrepackedInt8Linear)]
    assert len(layers) == 2 * 4 + 1  # qkv, attention projection, MLP in and out of both blocks, the head
    layer = layers[0]
    assert layer.int8.weight.data_ptr() == model.blocks[0].attn.qkv.weight.data_ptr()  # shared, not copied
    used = []
    layer.int8.register_forward_hook(lambda *args: used.append("int8"))
    layer.prepacked.register_forward_hook(lambda *args: used.append("prepacked"))
    with torch.inference_mode():
        for rows in (1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1):
            x = torch.randn(rows, 1, layer.int8.in_features, dtype=torch.bfloat16)
            want = torch.cat([layer.int8(x[i : i + 1]) for i in range(rows)]).float()  # aten's int8 kernel
            used.clear()
            got = layer(x).float()
            assert used == ["int8" if rows <= INT8_KERNEL_MAX_ROWS else "prepacked"]
            assert (got - want).abs().max() <= 2e-2 * (1 + want.abs().max())


def test_bf16_prepacks_only_where_onednn_computes_bf16(monkeypatch):
    model = tiny_gpt(vocab_size=97, context_length=64).to(torch.bfloat16).eval()
    emulate_cpu(monkeypatch, AVX512_BF16)
    assert prepacks(model)
    emulate_cpu(monkeypatch, AVX2)  # oneDNN's bf16 reorder raises there: bf16 runs aten's own kernels
    assert not prepacks(model) and prepacked_copy(model) is model
    step = DecodeStep(model, 4)
    with torch.inference_mode():
        want, got = step.traced(*step.example(1)), step.uncompiled(*step.example(1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def prepacked_dtype() -> torch.dtype:
    """The dtype this CPU prepacks linear layers in: bf16 with oneDNN's bf16 kernels, float32 without AVX-512."""
    features = cpu.cpu_features()
    if features.onednn_bf16:
        return torch.bfloat16
    if not features.avx512:
        return torch.float32
    pytest.skip("this CPU prepacks neither bf16 nor float32")


def plain_weights(model: nn.Module) -> list[weakref.ref]:
    """The linear layers' own weights (a head tied to the embedding is the embedding's)."""
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    return [weakref.ref(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in others]


@pytest.mark.parametrize("features", [AVX512_BF16, AVX2], ids=["avx512_bf16", "avx2"])
def test_once_the_compiler_is_done_the_plain_weights_are_freed_and_the_model_runs_prepacked(features, monkeypatch):
    from server.execution.decoder.runner import GPTRunner

    if features.onednn_bf16 and not cpu.cpu_features().onednn_bf16:
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    emulate_cpu(monkeypatch, features)
    dtype = torch.bfloat16 if features.onednn_bf16 else torch.float32
    model = tiny_gpt(vocab_size=97, context_length=64).to(dtype).eval()
    runner = GPTRunner(model, None, 4)
    parameters, plain = runner.facts.parameters, plain_weights(model)
    prompt = [5, 6, 7, 8, 9]
    with torch.inference_mode():
        before = runner.prefill([0], [prompt], [[1, 2]], [0]), runner.logits(prompt)
        runner.compiler_done()
        gc.collect()
        assert plain and all(w() is None for w in plain), "a plain weight is still held"
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        after = runner.prefill([0], [prompt], [[1, 2]], [0]), runner.logits(prompt)
    assert torch.equal(before[0], after[0])  # the prefill ran the prepacked layers already
    assert torch.equal(before[1].argmax(-1), after[1].argmax(-1))  # scoring reads the same model
    fresh = tiny_gpt(vocab_size=97, context_length=64)
    assert runner.facts.parameters == parameters == sum(p.numel() for p in fresh.parameters())
