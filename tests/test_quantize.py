"""Weight-only int8 linear layers: close to the layer they replace, compiled like it, served by a setting."""

import pytest
import torch

from model_store.store import write_checkpoint
from models.quantize import INT8_KERNEL_MAX_ROWS, WeightOnlyInt8Linear, quantize_int8
from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner
from server.execution.loader import load_runner
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt
from tests.test_cpu_kernels import packed_linears


def test_int8_linear_is_within_its_rounding_of_the_float_layer():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        linear = torch.nn.Linear(64, 48).to(dtype)
        q = WeightOnlyInt8Linear(linear)
        x = torch.randn(5, 3, 64, dtype=dtype)
        want, got = linear(x).float(), q(x).float()
        assert q.weight.dtype == torch.int8 and got.shape == want.shape
        # per-channel rounding error: half a step of max|w|/127 per weight
        bound = (linear.weight.float().abs().amax(1) / 254 * x.float().abs().sum(-1, keepdim=True)).max()
        assert (got - want).abs().max() <= bound + 0.05 * want.abs().max() * (dtype == torch.bfloat16)


@pytest.mark.compile
def test_an_int8_gpt_compiles_and_decodes_as_its_eager_self():
    model = quantize_int8(tiny_gpt(vocab_size=97, context_length=64, positions="rope"))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    engine = GenerationEngine(GPTRunner(model, None, 1), max_batch_size=1)
    engine.tokenizer = type("NoText", (), {"decode": lambda self, ids, **kw: ""})()
    engine.start()
    greedy = SamplingParams(max_new_tokens=40, temperature=0, eos_bias=float("-inf"))
    try:
        eager = [e.id for e in engine.generate([5, 17, 3, 42], greedy)[0]]
        step = engine.runner.step
        step.compiled[1] = BackgroundCompiler.of(step, [1], None, "test").build(1)  # checked vs eager
        compiled = [e.id for e in engine.generate([5, 17, 3, 42], greedy)[0]]
    finally:
        engine.stop()
    assert len(eager) == 40 and compiled == eager


def test_the_weights_setting_loads_int8_linears(tmp_path, tiny_tokenizer):
    write_checkpoint(
        tmp_path / "m", tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size()), tiny_tokenizer, card="# m\n", metrics={}
    )
    cpu = torch.device("cpu")
    native = load_runner("decoder", tmp_path / "m", cpu, torch.float32, 2)
    int8 = load_runner("decoder", tmp_path / "m", cpu, torch.float32, 2, weights="int8")
    assert any(isinstance(m, torch.nn.Linear) for m in native.model.modules())
    linears = [m for m in int8.model.modules() if isinstance(m, WeightOnlyInt8Linear)]
    assert linears and not any(isinstance(m, torch.nn.Linear) for m in int8.model.modules())
    ids = [1, 2, 3, 4, 5]
    a, b = native.logits(ids), int8.logits(ids)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_an_int8_layer_dequantizes_for_products_of_many_rows_with_the_kernels_numbers():
    torch.manual_seed(0)
    q = WeightOnlyInt8Linear(torch.nn.Linear(64, 48).to(torch.bfloat16))
    x = torch.randn(INT8_KERNEL_MAX_ROWS + 3, 64, dtype=torch.bfloat16)
    many = q(x).float()  # one product of more rows than the int8 kernel serves: the dequantized weight
    few = torch.cat([q(x[i : i + 1]) for i in range(len(x))]).float()  # row by row: aten's int8 kernel
    assert (many - few).abs().max() <= 2e-2 * (1 + few.abs().max())


@pytest.mark.compile
def test_many_row_int8_steps_freeze_a_dequantized_weight_into_prepacked_linears():
    """Inductor keeps an int8 -> bf16 conversion in the graph (for its int8 kernels): a bucket of
    more rows would dequantize every weight at every step, then run an unpacked product."""
    from torch._inductor.utils import run_and_get_code

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN's bf16 linear needs a CPU with bf16 support")
    model = quantize_int8(tiny_gpt(vocab_size=97, context_length=64).to(torch.bfloat16).eval())
    step = GPTRunner(model, None, 8).step
    rows = INT8_KERNEL_MAX_ROWS * 2
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(BackgroundCompiler.of(step, [rows], None, "test").build, rows)  # checked vs eager
    # the qkv, attention, MLP linears of both blocks (and the head) on packed frozen weights
    assert packed_linears("\n".join(code)) >= 4 * 2


def test_without_avx512_a_float32_models_int8_kernel_gets_bf16_activations(monkeypatch):
    """aten's int8 kernel is scalar for float32 activations there (8x slower than a float32 product)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    emulate_cpu(monkeypatch, AVX512_BF16)
    assert WeightOnlyInt8Linear(linear).kernel_dtype == torch.float32
    assert WeightOnlyInt8Linear(linear.to(torch.bfloat16)).kernel_dtype == torch.bfloat16
    emulate_cpu(monkeypatch, AVX2)
    q = WeightOnlyInt8Linear(linear.float())
    assert q.kernel_dtype == torch.bfloat16 and q.kernel_scales.dtype == torch.bfloat16
    assert q.scales.dtype == torch.float32  # what the dequantized products of many rows use
    x = torch.randn(2, 64)
    got, want = q(x), linear(x)
    assert got.dtype == torch.float32 and (got - want).abs().max() <= 2e-2 * (1 + want.abs().max())
