"""The check a compiled pass passes before it serves (server/execution/step_check.py), on real
requests' inputs, and what /info then says of each pass."""

import copy

import pytest
import torch

from model_store import STORE_ROOT, load_gpt
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.prepacked import PrepackedLinear
from server.execution.decoder.runner import GPTRunner
from server.execution.decoder.step import CHECK_TEXT, check_lengths
from server.execution.passes import Pass
from server.execution.step_check import RANGE_FRACTION, Float32Reference, disagreement
from tests.conftest import tiny_gpt


def logits(rows: int = 4, vocab: int = 500, seed: int = 0) -> torch.Tensor:
    """Logits shaped as a real model's: a range of ~30, a few tokens well ahead."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=generator) * 3
    x[:, :5] += torch.tensor([12.0, 9.0, 8.0, 6.0, 5.0])
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rounding_within_the_dtype_passes_and_a_wrong_distribution_does_not(dtype):
    want = logits()
    span = float((want.amax(-1) - want.amin(-1)).min())
    noise = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    assert disagreement(want, want + noise * RANGE_FRACTION[dtype] * span / 8, dtype) is None
    shifted = want.clone()
    shifted[2, 1] += 6.0  # row 2 now prefers another token
    assert "row 2" in disagreement(want, shifted, dtype)
    assert "row 0" in disagreement(want, want * 1.2, dtype)  # a wrong scale: every log-probability moves
    nan = want.clone()
    nan[3, 400] = float("nan")
    assert "row 3" in disagreement(want, nan, dtype)


def test_a_near_tie_may_pick_either_token_but_a_clear_lead_may_not():
    want = logits(rows=1)
    want[0, 1] = want[0, 0] - 1e-3  # the first two tokens tie within bf16's rounding
    swapped = want.clone()
    swapped[0, 0], swapped[0, 1] = want[0, 1], want[0, 0]
    assert disagreement(want, swapped, torch.bfloat16) is None
    assert "row 0" in disagreement(want, swapped, torch.float32)  # float32's tolerance is far tighter
    far = want.clone()
    far[0, 4] = want[0, 0] + 1.0  # picks a token eager put 7 nats behind
    assert "row 0" in disagreement(want, far, torch.bfloat16)


def test_in_half_precision_got_may_stray_from_float32_as_far_as_eager_does():
    exact = logits()
    span = float((exact.amax(-1) - exact.amin(-1)).min())
    tolerance = RANGE_FRACTION[torch.bfloat16] * span
    noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(2))
    eager = exact + noise * 2 * tolerance  # eager's own rounding: more than a tolerance from float32
    got = exact - noise * 2 * tolerance  # as far from float32 the other way: twice as far from eager
    assert "row" in disagreement(eager, got, torch.bfloat16)
    assert disagreement(exact, got, torch.bfloat16, eager=eager) is None
    worse = exact - noise * 6 * tolerance
    assert "eager's own" in disagreement(exact, worse, torch.bfloat16, eager=eager)


def test_the_float32_reference_computes_in_float32_and_still_writes_the_half_precision_cache():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).bfloat16()
    exact = copy.deepcopy(layers).float()  # the same (bf16-rounded) weights in float32
    x = torch.randn(8, 64).bfloat16()
    cache = torch.zeros(16, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = exact(x.float())
        with Float32Reference():
            y = layers(x)
            cache.index_copy_(0, torch.arange(8), y)
        assert y.dtype == torch.float32 and torch.allclose(y, want, atol=1e-5)
        assert (layers(x).float() - want).abs().max() > 100 * (y - want).abs().max()  # bf16 rounds between ops
        assert torch.equal(cache[:8], y.bfloat16()) and cache[8:].abs().sum() == 0


@pytest.mark.parametrize("rows", [1, 40])  # the skinny kernel's rows and oneDNN's, where the kernel runs
def test_the_float32_reference_computes_our_linear_layers_in_float32(rows):
    linear = torch.nn.Linear(64, 48).bfloat16()
    layer = PrepackedLinear(linear)  # our op over the plain weight (where the kernel runs), or a prepacked one
    x = torch.randn(rows, 64).bfloat16()
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        with Float32Reference():
            y = layer(x)
    if layer.weight is not None:
        assert y.dtype == torch.float32 and torch.allclose(y, want, atol=1e-5)
    else:  # a prepacked weight alone: the op in the precision it takes
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), want, rtol=2**-7, atol=1e-2)


def test_the_check_runs_on_prompts_of_the_checks_text_prefilled_into_the_cache(tiny_tokenizer):
    """real_inputs: each row a prompt of CHECK_TEXT by the checkpoint's tokenizer, of its own length, written
    into a cache the eager prefill filled; the step's tokens are what the model picked after each."""
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), context_length=64)
    runner = GPTRunner(model, tiny_tokenizer, 4)
    step = runner.step
    assert step.check_ids == runner.tokenizer.encode(CHECK_TEXT)
    with torch.inference_mode():
        tokens, positions, eos_bias, allowed, table, steer_rows, steers, *cache = step.real_inputs(4)
        lengths = check_lengths(4, step.context)
        assert positions[:, 0].tolist() == lengths and len(set(lengths)) == 4
        read = table.shape[1] * 16  # the positions the step reads: its rows' blocks, whole
        assert read >= max(lengths) + 1
        keys = cache[0]  # layer 0's key pool (blocks * 16, heads, width): zeroed past each prompt as far as it reads
        for row, length in enumerate(lengths):
            at = (table[row].repeat_interleave(16) * 16 + torch.arange(16).repeat(table.shape[1]))[:read]
            assert keys[at[:length]].abs().sum() > 0 and keys[at[length:]].abs().sum() == 0
        want = step.uncompiled(tokens, positions, eos_bias, allowed, table, steer_rows, steers, *cache)
        assert disagreement(step.logits(want), step.logits(step.traced(*step.real_inputs(4))), step.dtype) is None


def test_each_pass_has_a_state_in_build_order(tiny_tokenizer, caplog):
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), context_length=64)
    step = GPTRunner(model, tiny_tokenizer, 2).step
    compiler = BackgroundCompiler([Pass(step, 1, True), Pass(step, 2, True)], None, "test", name="tiny")
    assert compiler.states() == {"DecodeStep_1_regional": "waiting", "DecodeStep_2_regional": "waiting"}

    def build(bucket, regional=False):  # the first built, the second refused by its check
        if bucket == 2:
            raise RuntimeError("its pick trails eager's")
        return step.uncompiled

    compiler.build = build
    with caplog.at_level("INFO", logger="tinyserve"):
        compiler.run()
    assert compiler.states() == {
        "DecodeStep_1_regional": "built",
        "DecodeStep_2_regional": "not built: RuntimeError: its pick trails eager's",
    }
    assert "tiny compiled 1 of 2 passes" in caplog.text


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shipped_gpts_compiled_steps_pass_the_check_on_its_real_weights(dtype):
    """A real trained checkpoint: every decode bucket's regional and frozen graph serves (a fixed bound on random
    inputs refused a real 30-layer model's, whose tokens were right)."""
    model, tokenizer = load_gpt(STORE_ROOT / "gpt-wikitext2", dtype=dtype)
    runner = GPTRunner(model, tokenizer, 2)
    passes = [p for p in runner.compile_passes(2) if p.target is runner.step]
    compiler = BackgroundCompiler(passes, None, "test", name="gpt-wikitext2")
    compiler.run()
    assert set(compiler.states().values()) == {"built"}, compiler.states()
