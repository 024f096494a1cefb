"""GGUF files as people download them: every quantized type llama.cpp's quantizer writes for our families, read into
the store in its own bits (codes, scales and zeros: exactly the file's values), served with the logits of the file's
dequantized weights in float32; Gemma 3 from GGUF; bad files refused in one line, the store untouched.

The fixtures (tests/fixtures/gguf/) were made by llama.cpp's converter and `llama-quantize` from tiny random models
(scripts/make_gguf_fixtures.py); the reference is transformers' own GGUF reader of the same file."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from model_store.gguf_blocks import dense, unpack
from model_store.ingest import add_checkpoint
from model_store.store import CheckpointError, load_gpt
from models.quantize import (
    GroupQuantEmbedding,
    GroupQuantLinear,
    pack_codes,
    quantize_int4,
    unpack_codes,
    widen_groups,
)
from server.execution import group_gemm

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
# what llama-quantize wrote into each file (its 2-D tensors): the mixes give some tensors another type, and rows not
# a multiple of 256 wide (the 64-wide Gemma) fall back from K-quants to Q5_0 and Q8_0
HOLDS = {
    "llama-q8_0": {"Q8_0": 9},
    "llama-q4_0": {"Q4_0": 8, "Q6_K": 1},
    "llama-q4_1": {"Q4_1": 8, "Q6_K": 1},
    "llama-q5_0": {"Q5_0": 8, "Q6_K": 1},
    "llama-q5_1": {"Q5_1": 8, "Q6_K": 1},
    "llama-q2_k": {"Q2_K": 5, "Q3_K": 3, "Q6_K": 1},
    "llama-q3_k_m": {"Q3_K": 5, "Q4_K": 2, "Q5_K": 1, "Q6_K": 1},
    "llama-q4_k_m": {"Q4_K": 6, "Q6_K": 3},
    "llama-q5_k_m": {"Q5_K": 6, "Q6_K": 3},
    "llama-q6_k": {"Q6_K": 9},
    "llama-iq4_nl": {"IQ4_NL": 8, "Q6_K": 1},
    "gemma3-q4_k_m": {"Q5_0": 38, "Q8_0": 5},
    "gemma3-f32": {"F32": 43},
}
IDS = [5, 77, 301, 12, 9, 250, 33, 140, 61, 2, 388, 17, 45, 99, 120, 7, 64, 200, 31, 8] * 2  # 40 > Gemma's window 8


def reader(name: str):
    import gguf

    return gguf.GGUFReader(str(FIXTURES / f"{name}.gguf"))


def theirs(name: str):
    """transformers' model of the file: its own GGUF reader, dequantized to float32 (llama.cpp's attention scale
    for Gemma 3, 1/sqrt(head_dim): the file keeps no query_pre_attn_scalar, and transformers' default is 256's)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES, gguf_file=f"{name}.gguf", dtype=torch.float32)
    if name.startswith("gemma3"):
        for layer in model.model.layers:
            layer.self_attn.scaling = layer.self_attn.head_dim**-0.5
    return model.eval()


@pytest.mark.parametrize("name", list(HOLDS))
def test_each_file_holds_the_types_its_name_says(name):
    assert dict(Counter(t.tensor_type.name for t in reader(name).tensors if len(t.shape) == 2)) == HOLDS[name]


@pytest.mark.parametrize("name", [n for n in HOLDS if not n.endswith("f32")])
def test_blocks_become_codes_scales_and_zeros_that_hold_the_files_values_exactly(name):
    import gguf

    for t in reader(name).tensors:
        if len(t.shape) != 2:
            continue
        shape = tuple(int(n) for n in reversed(t.shape))
        groups = unpack(t.data, t.tensor_type.name, shape)
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        assert np.array_equal(dense(groups), want), t.name
        assert groups.codes.min() >= -128 and groups.codes.max() < 2 ** max(groups.bits, 1) or groups.bits == 8


@pytest.mark.parametrize("name", list(HOLDS))
def test_a_file_enters_the_store_in_its_own_bits_with_the_logits_of_its_dequantized_weights(tmp_path, name):
    folder = add_checkpoint(FIXTURES / f"{name}.gguf", "m", tmp_path / "store")
    ours, _ = load_gpt(folder)
    quantized = [m for m in ours.modules() if isinstance(m, GroupQuantLinear)]
    assert bool(quantized) == (not name.endswith("f32"))  # kept as codes, not a float copy
    kept = (folder / "model.safetensors").stat().st_size
    assert kept < 3 * (FIXTURES / f"{name}.gguf").stat().st_size  # a float32 copy: 7-9x
    ids = torch.tensor([IDS])
    with torch.no_grad():
        want = theirs(name)(ids).logits
        got = ours(ids).logits
    assert want.abs().max() > 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_gemma3_from_gguf_generates_transformers_greedy_tokens(tmp_path):
    folder = add_checkpoint(FIXTURES / "gemma3-f32.gguf", "g", tmp_path / "store")
    ours, _ = load_gpt(folder)
    assert ours.config.layer_types == ["sliding"] * 5 + ["full"] and ours.config.sliding_window == 8
    prompt = torch.tensor([IDS[:12]])
    want = theirs("gemma3-f32").generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 12:]
    from models.sampling import SamplingParams

    got = ours.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0, eos_bias=float("-inf")))[0]
    assert got.tolist() == want.tolist()


def quantized_model(name: str, tmp_path):
    folder = tmp_path / "store" / "m"
    if not folder.exists():
        add_checkpoint(FIXTURES / f"{name}.gguf", "m", tmp_path / "store")
    return load_gpt(folder, dtype=torch.bfloat16)[0]


def kernel_reference(x: torch.Tensor, layer: GroupQuantLinear) -> torch.Tensor:
    """What group_gemm.cpp computes, in float64: x rounded to int8 per group of 32 as the kernel rounds it (in
    float32: q = rint(x * (127 / max |x|)), dx = max |x| / 127), times code * scale; plus each group's zero times the
    sum of x over it."""
    m, k = x.shape
    xs = x.float().view(m, k // 32, 32)
    top = xs.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127) / top, 0)  # a division, as the kernel (127 / t multiplies)
    xq = (torch.round(xs * inv).double() * (top / 127).double()).view(m, k)
    zeros = layer.zeros
    layer.zeros = None
    scaled = layer.dequantized(torch.float64)  # code * scale
    layer.zeros = zeros
    y = xq @ scaled.T
    if zeros is not None:
        sums = x.double().view(m, -1, layer.group).sum(-1)  # (M, G)
        y = y + sums @ zeros.double().T
    return y


@pytest.mark.skipif(not group_gemm.usable(), reason="needs AVX-512 VNNI and BF16 (the kernel's CPU)")
@pytest.mark.parametrize(
    "name",
    [
        "llama-q4_k_m",
        "llama-q5_k_m",
        "llama-q5_0",
        "llama-q6_k",
        "llama-q8_0",
        "llama-q2_k",
        "llama-iq4_nl",
        "gemma3-q4_k_m",
    ],
)
def test_our_kernel_computes_the_quantized_product_as_llama_cpp_rounds_activations(tmp_path, name):
    """The kernel rounds x to int8 per group of 32 (as llama.cpp does): each product as that rounding gives it, to
    bf16's precision; the model's top tokens mostly those of its float32 dequantized weights (a random tiny model
    has near ties; bench/bench_quant_quality.py measures trained ones)."""
    ours = quantized_model(name, tmp_path)
    reference = quantized_model(name, tmp_path)
    widen_groups(reference, torch.float32)
    reference.float()
    assert group_gemm.use_kernel(ours) > 0
    for layer in (m for m in ours.modules() if isinstance(m, GroupQuantLinear)):
        for rows in (1, 5, group_gemm.KERNEL_MAX_ROWS, group_gemm.KERNEL_MAX_ROWS + 3):
            x = torch.randn(rows, layer.in_features).bfloat16()
            got = layer(x).double() - (layer.bias.double() if layer.bias is not None else 0)
            if rows <= group_gemm.KERNEL_MAX_ROWS:  # the kernel: int8 activations, then bf16 out, f16 scales
                want = kernel_reference(x, layer)
                assert ((got - want).abs() <= 2**-8 * want.abs() + 5e-4 * want.abs().max()).all()
            else:  # a prompt's rows: the weight dequantized into bf16 (from float16 scales) for oneDNN
                want = x.double() @ layer.dequantized(torch.bfloat16).double().T
                assert ((got - want).abs() <= 2**-8 * want.abs() + 5e-4 * want.abs().max()).all()
    ids = torch.tensor([IDS])
    with torch.no_grad():
        got, want = ours(ids).logits.float(), reference(ids).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_without_the_kernel_quantized_layers_are_widened_to_the_dtype(tmp_path, monkeypatch):
    """The other branch (a CPU without AVX-512 VNNI and BF16, or float32): one dense copy, the exact values."""
    from server.execution.loader import held_as

    monkeypatch.setattr(group_gemm, "usable", lambda: False)
    model = quantized_model("llama-q4_k_m", tmp_path)
    codes = {n: m.dequantized(torch.float32) for n, m in model.named_modules() if isinstance(m, GroupQuantLinear)}
    assert "widened to bfloat16" in held_as(model, torch.bfloat16, "native")
    assert not any(isinstance(m, (GroupQuantLinear, GroupQuantEmbedding)) for m in model.modules())
    for name, w in codes.items():
        assert torch.equal(model.get_submodule(name.removesuffix(".table")).weight, w.bfloat16())


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_codes_are_packed_in_their_width_and_back(bits):
    low = -128 if bits == 8 else 0
    codes = torch.randint(low, low + 2**bits, (3, 128), generator=torch.Generator().manual_seed(bits))
    codes = codes.to(torch.int8 if bits == 8 else torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 128 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_int4_quantizes_a_float_model_to_groups_of_32_within_a_fifteenth_of_each_groups_range(tmp_path):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 8)
    layer = quantize_int4(torch.nn.Sequential(linear))[0]
    assert isinstance(layer, GroupQuantLinear) and layer.bits == 4 and layer.group == 32
    w = linear.weight.detach().view(8, 4, 32)
    span = (w.amax(-1) - w.amin(-1)).unsqueeze(-1)
    assert ((layer.dequantized(torch.float32).view(8, 4, 32) - w).abs() <= span / 30 + 1e-6).all()


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("truncated", "not a readable GGUF file"),
        ("scales", "cannot be read"),
    ],
)
def test_a_damaged_gguf_is_refused_in_one_line_and_nothing_reaches_the_store(tmp_path, damage, named):
    data = bytearray((FIXTURES / "llama-q4_k_m.gguf").read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # every block's float16 scales NaN: the last quantized tensor's bytes
        t = [t for t in reader("llama-q4_k_m").tensors if t.tensor_type.name == "Q4_K"][-1]
        start = t.data_offset
        data[start : start + t.n_bytes] = b"\xff" * t.n_bytes
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=named) as refused:
        add_checkpoint(bad, "x", tmp_path / "store")
    assert "\n" not in str(refused.value) and "bad.gguf" in str(refused.value)
    assert not (tmp_path / "store" / "x").exists()


def test_a_truncated_safetensors_file_is_refused_in_one_line(tmp_path):
    folder = add_checkpoint(FIXTURES / "llama-q8_0.gguf", "m", tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    for f in folder.iterdir():
        if f.name != "manifest.json":
            (src / f.name).write_bytes(f.read_bytes())
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors") as refused:
        add_checkpoint(src, "y", tmp_path / "store")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "store" / "y").exists()


def test_the_runner_says_what_holds_the_weights(tmp_path):
    from server.execution.loader import load_runner

    folder = add_checkpoint(FIXTURES / "llama-q4_k_m.gguf", "m", tmp_path / "store")
    runner = load_runner("decoder", folder, torch.device("cpu"), torch.bfloat16, 2, "native", None, 64)
    kernel = group_gemm.usable()
    assert ("in their own bits" if kernel else "widened to bfloat16") in runner.facts.weights
    with torch.inference_mode():  # as the engine calls it
        logits = runner.prefill([0], [[5, 77, 301, 12]], [[1]], [0])  # block 1 of the pool (0 is the null block)
    assert logits.shape[-1] == runner.facts.vocab_size and torch.isfinite(logits).all()
