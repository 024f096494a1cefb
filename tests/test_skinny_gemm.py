"""The few-row bf16 kernel (server/execution/skinny_gemm.py): its products, where it serves, and what it spares
(no frozen graph of a bf16 step where it runs)."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from server.execution import kernel_choice, skinny_gemm
from server.execution.decoder import prepacked
from server.execution.decoder.prepacked import PrepackedLinear, prepacked_copy
from server.execution.decoder.runner import GPTRunner
from server.execution.decoder.verify_pass import VerifyPass
from server.execution.kernel_choice import template_serves
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt

runs_here = pytest.mark.skipif(not skinny_gemm.usable(), reason="needs a CPU with AVX-512 BF16 and a C++ compiler")


@runs_here
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 16, 31, 32])  # 9 and more: four rows of w a block
@pytest.mark.parametrize(("n", "k"), [(64, 576), (7, 40), (130, 1000), (70, 2100)])  # off the blocks; long rows
def test_the_kernel_gives_float32_sums_of_bf16_products(rows, n, k):
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    assert skinny_gemm.serves(x)
    expected = x.float() @ weight.float().T + bias.float()
    got = skinny_gemm.product(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums, rounded once to bf16: within half a bf16 step of the exact value (plus summation order)
    assert torch.allclose(got.float(), expected, rtol=2**-8, atol=1e-3 * k**0.5)


@runs_here
@pytest.mark.parametrize("amx", [False, True])
def test_a_bf16_layer_runs_a_decode_steps_rows_in_the_kernel_and_more_in_onednn(monkeypatch, amx):
    """One copy of the weight, read by both; with AMX oneDNN takes more than 8 rows."""
    emulate_cpu(monkeypatch, dataclasses.replace(AVX512_BF16, amx=amx))
    linear = nn.Linear(96, 80, bias=True).to(torch.bfloat16)
    layer = PrepackedLinear(linear)
    assert layer.weight is not None and layer.weight.data_ptr() == linear.weight.data_ptr()  # no copy
    assert layer.packed is None
    kernel_rows = []
    for rows in (1, 4, 8, 9, 16, 32, 33, 64):
        x = torch.randn(1, rows, 96).to(torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            got = layer(x)  # the op's kernel, or oneDNN through the dispatcher (which the profiler sees)
        assert torch.allclose(got.float(), expected, rtol=2**-7, atol=0.05)
        onednn = {"mkldnn::_linear_pointwise", "aten::linear"} & {event.name for event in profile.events()}
        if not onednn:
            kernel_rows.append(rows)
    assert kernel_rows == ([1, 4, 8] if amx else [1, 4, 8, 9, 16, 32])  # up to max_rows(); oneDNN above


@runs_here
def test_a_small_models_layers_keep_a_prepacked_copy_for_the_rows_the_kernel_is_slower_at(monkeypatch):
    """Below BOTH_COPIES_MAX_BYTES of linear weights the kernel serves up to its fastest rows and oneDNN's prepacked
    linear more; above, one copy, the kernel every decode bucket."""
    emulate_cpu(monkeypatch, AVX512_BF16)
    model = tiny_gpt(vocab_size=97).to(torch.bfloat16)
    layer = prepacked_copy(model).blocks[0].mlp.fc
    plain = model.blocks[0].mlp.fc
    assert layer.weight.data_ptr() == plain.weight.data_ptr() and layer.packed is not None
    assert layer.kernel_rows == skinny_gemm.FASTEST_ROWS
    kernel_rows = []
    for rows in (1, 8, 9, 16, 32):
        x = torch.randn(1, rows, plain.in_features).to(torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            got = layer(x)
        assert torch.allclose(got.float(), expected, rtol=2**-7, atol=0.05)
        if "mkldnn::_linear_pointwise" not in {event.name for event in profile.events()}:
            kernel_rows.append(rows)
    assert kernel_rows == [1, 8]
    monkeypatch.setattr(prepacked, "BOTH_COPIES_MAX_BYTES", 0)
    one = prepacked_copy(model).blocks[0].mlp.fc
    assert one.packed is None and one.kernel_rows == skinny_gemm.max_rows()


def test_where_the_kernel_serves_a_bf16_step_is_frozen_only_if_its_weights_fit_the_cpus_cache(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "usable", lambda: True)
    emulate_cpu(monkeypatch, dataclasses.replace(AVX512_BF16, onednn_bf16=False))  # no bf16 reorder on any CPU
    monkeypatch.setattr(kernel_choice, "last_level_cache_bytes", lambda: 32 * 2**20)
    assert not any(template_serves(rows, torch.bfloat16) for rows in (1, 2, 4, 8))  # weights not said: never
    assert not any(template_serves(rows, torch.bfloat16, 33 * 2**20) for rows in (1, 2, 4, 8))
    assert [rows for rows in (1, 2, 4, 8) if template_serves(rows, torch.bfloat16, 27 * 2**20)] == [1, 2, 4]
    assert template_serves(1, torch.float32)  # float32 keeps the C++ GEMM template for its few rows
    runner = GPTRunner(tiny_gpt(vocab_size=97).to(torch.bfloat16), None, 8)
    frozen = [p.bucket for p in runner.compile_passes(8) if not p.regional]
    assert frozen == [1, 2, 4, VerifyPass.BUCKET]  # the tiny model's weights fit: the few-row buckets frozen too
    monkeypatch.setattr(kernel_choice, "last_level_cache_bytes", lambda: 0)
    assert all(p.regional for p in runner.compile_passes(8))  # the decode buckets and the draft check


def test_without_avx512_bf16_the_kernel_stays_out(monkeypatch):
    emulate_cpu(monkeypatch, AVX2)
    assert not skinny_gemm.available() and not skinny_gemm.usable()
    assert PrepackedLinear(nn.Linear(64, 32)).weight is None  # float32 on AVX2: the prepacked layer alone
    assert template_serves(1, torch.bfloat16) and template_serves(64, torch.float32)


def test_a_kernel_that_cannot_be_built_leaves_the_prepacked_layers(monkeypatch, tmp_path, caplog):
    """No compiler, or nowhere to write the kernel: a log line, and the layers run oneDNN as before."""
    monkeypatch.setattr(skinny_gemm, "available", lambda: True)
    skinny_gemm.library.cache_clear()
    try:
        monkeypatch.setenv("CXX", "no-such-compiler")
        assert not skinny_gemm.usable() and "no C++ compiler" in caplog.text
        skinny_gemm.library.cache_clear()
        monkeypatch.delenv("CXX")
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker))  # the kernel's folder would be under a file
        assert not skinny_gemm.usable()
    finally:
        skinny_gemm.library.cache_clear()
