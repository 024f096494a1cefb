"""The compiled prompts' pass (prefill): one graph for every group size and prompt length, exact against eager."""

import pytest
import torch

from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner, prompt_group
from server.execution.decoder.verify_pass import VerifyPass
from server.execution.kernel_choice import inductor_settings
from server.execution.passes import Pass
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt
from tests.test_compiled_step import VARIANTS, started


def prefill_both(runner: GPTRunner, slots: list[int], prompts: list[list[int]], steered: list[int] | None = None):
    """The group's logits and written pool, eagerly and compiled (the same blocks, from the same zeroed pool): each
    prompt in blocks of its own, scattered (the slots name where they start); the `steered` rows with a random
    vector after every block."""
    width = -(-max(len(p) for p in prompts) // 16)
    tables = [[1 + (slot * width + i) * 3 % (runner.step.cache.blocks - 1) for i in range(width)] for slot in slots]
    ids, positions, last, table = prompt_group(prompts, [0] * len(prompts), tables, 0, runner.device)
    steers = torch.zeros_like(runner.step.steering.vectors)
    steers[1:].normal_(generator=torch.Generator().manual_seed(4))
    steer_rows = torch.tensor([1 + i if i in (steered or []) else 0 for i in range(len(prompts))])
    out = []
    for fn in (runner.prompts.uncompiled, runner.prompts.compiled[None]):
        pools = runner.step.cache.tensors()
        for t in pools:
            t.zero_()
        logits = fn(ids, positions, last, table, steer_rows, steers, *pools)
        out.append((logits.clone(), [t.clone() for t in pools]))
    return out


def with_prompt_pass(variant: str) -> GPTRunner:
    """A 128-context GPT's runner of 4 slots, its prompts' pass built as the server builds it: regionally, with no
    whole graph after a regional build that failed (plain linear layers' 3-D inputs once made every one fail)."""
    runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=128, **VARIANTS[variant]), None, 4)
    compiler = BackgroundCompiler([Pass(runner.prompts, None, True)], None, "test")
    built, compile = [], compiler.compile

    def recorded(*args, regional=False, **kwargs):
        built.append(regional)
        return compile(*args, regional, **kwargs)

    compiler.compile = recorded
    with torch.inference_mode():
        runner.prompts.compiled[None] = compiler.build(None, True)
    assert built == [True]
    return runner


@pytest.fixture(scope="module")
def rope_runner():
    """The rope variant's runner, built once for the group test and the engine test."""
    return with_prompt_pass("rope")


@pytest.mark.compile
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_compiled_prompt_pass_matches_eager_for_any_group(variant, request):
    """Groups of one and of three prompts (different lengths, right-padded, slots not at 0): the next-token
    logits and every key and value written match the eager pass within float32's rounding, steered rows too."""
    runner = request.getfixturevalue("rope_runner") if variant == "rope" else with_prompt_pass(variant)
    with torch.inference_mode():
        groups = [([0], [[5, 17, 3, 42, 8, 11, 2, 9]], None), ([1, 2, 3], [[4] * 30, [7, 1, 9], [2] * 17], None)]
        groups.append(([1, 2, 3], [[4] * 30, [7, 1, 9], [2] * 17], [0, 2]))  # steered and plain prompts in one
        for slots, prompts, steered in groups:
            (want, want_cache), (got, got_cache) = prefill_both(runner, slots, prompts, steered)
            assert got.shape == (len(prompts), 97)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            for g, w in zip(got_cache, want_cache, strict=True):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.compile
def test_the_prompts_pass_traces_its_blocks_region_once():
    """dynamo stamps out the first block's region for the others (a region whose outputs held the attention
    weights' None was traced anew for each of a real model's 30 blocks: twice the warm start)."""
    import logging

    from torch._dynamo.variables import invoke_subgraph

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    torch._logging.set_logs(hierarchical_compile=True)
    invoke_subgraph.hc_log.addHandler(handler)
    try:
        runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=128, n_layer=4, **VARIANTS["rope"]), None, 2)
        with torch.inference_mode():
            BackgroundCompiler([Pass(runner.prompts, None, True)], None, "test").build(None, True)
    finally:
        invoke_subgraph.hc_log.removeHandler(handler)
        torch._logging.set_logs()
    assert not [r for r in records if "not eligible" in r or "reuse failed" in r], records
    assert len([r for r in records if "reusing subgraph" in r]) == 3, records


@pytest.mark.compile
def test_the_engine_gives_the_eager_tokens_with_the_compiled_prompt_pass(rope_runner):
    """An engine of two rows over the rope runner, its prompts' pass built (the group test's)."""
    model = rope_runner.model
    greedy = SamplingParams(max_new_tokens=24, temperature=0, eos_bias=float("-inf"))
    prompts = [[5, 17, 3, 42, 8, 11, 2, 9], [1, 2], [60] * 40]
    eager, compiled = started(model), GenerationEngine(rope_runner, max_batch_size=2, max_queue=8)
    compiled.tokenizer = eager.tokenizer
    compiled.start()
    try:
        assert None in compiled.runner.prompts.compiled
        for prompt in prompts:
            want = [e.id for e in eager.generate(prompt, greedy)[0]]
            assert [e.id for e in compiled.generate(prompt, greedy)[0]] == want
    finally:
        eager.stop()
        compiled.stop()


def test_a_one_token_prompt_runs_eagerly():
    """The graph is traced for prompts of more than one token (a dynamic size of 1 would be specialised)."""
    runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 2)

    def refuse(*args):
        raise AssertionError("the compiled pass ran a one-token prompt")

    runner.prompts.compiled[None] = refuse
    with torch.inference_mode():
        assert runner.prefill([0], [[5]], [[1]], [0]).shape == (1, 97)
        with pytest.raises(AssertionError, match="one-token"):
            runner.prefill([0], [[5, 6]], [[1]], [0])


@pytest.mark.parametrize("features", [AVX2, AVX512_BF16], ids=["avx2", "avx512_bf16"])
def test_regional_steps_build_first_the_prompt_pass_second_and_frozen_steps_last_on_the_cpu(monkeypatch, features):
    """Every request runs a prefill: its graph is built right after the one-row decode step's regional one, before
    the other buckets'; then each bucket whose products run in the C++ GEMM template gets a whole frozen graph
    (faster than its regional one: every bucket without AVX-512, up to 4 rows with it), then the draft check its
    graph. On CUDA no prompt pass (its graph would run through dynamo, which recompiles
    for a lone prompt), nothing frozen and no draft check."""
    emulate_cpu(monkeypatch, features)
    runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 8)
    step, prompts = runner.step, runner.prompts
    regional = [Pass(step, 1, True), Pass(prompts, None, True), *(Pass(step, r, True) for r in (8, 2, 4))]
    drafts = Pass(runner.verifier, VerifyPass.BUCKET)
    frozen = (1, 8, 2, 4) if features is AVX2 else (1, 2, 4)
    assert runner.compile_passes(8) == regional + [Pass(step, r) for r in frozen] + [drafts]
    compiler = BackgroundCompiler(runner.compile_passes(8), None, "test")
    labels = [compiler.label(None), compiler.label(1, True), compiler.label(1)]
    assert labels == ["PromptPass", "DecodeStep_1_regional", "DecodeStep_1"]
    prompts.device = step.device = runner.verifier.device = torch.device("cuda")
    assert runner.compile_passes(8) == [Pass(step, r, True) for r in (1, 8, 2, 4)]


@pytest.mark.parametrize("features", [AVX2, AVX512_BF16], ids=["avx2", "avx512_bf16"])
def test_rows_that_vary_compile_prepacked_layers(monkeypatch, features):
    """A dynamic row count takes the prepacked linear layers on every CPU, never the C++ GEMM template (which
    has no choice for the attention's batched products), where a one-row step takes the template."""
    emulate_cpu(monkeypatch, features)
    assert inductor_settings(torch.device("cpu"), None, torch.float32) == {"freezing": True}
    assert "max_autotune" in inductor_settings(torch.device("cpu"), 1, torch.float32)
