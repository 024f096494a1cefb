"""Building decode steps: the blocks of a step as one nested compile region (server/execution/decoder/regional.py),
and a bucket not built yet running padded on a larger built one."""

import threading

import pytest
import torch

from models.cpu import cpu_features
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner
from server.execution.decoder.step import DecodeStep
from server.execution.passes import Pass
from server.execution.runner import DecodeRows
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt
from tests.test_compiled_step import VARIANTS, no_recompiles


def tracing(monkeypatch) -> list[torch.fx.GraphModule]:
    """The graphs dynamo hands the compiler's backend on this thread (a build called here, not another test's
    compiler still running)."""
    import server.execution.compiler

    traced: list[torch.fx.GraphModule] = []
    builder, capture = threading.current_thread(), server.execution.compiler.GraphCapture.__call__

    def recorded(c, graph, inputs):
        if threading.current_thread() is builder:
            traced.append(graph)
        return capture(c, graph, inputs)

    monkeypatch.setattr(server.execution.compiler.GraphCapture, "__call__", recorded)
    return traced


@pytest.mark.compile
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_regional_step_compiles_one_region_for_all_blocks_and_gives_the_eager_step(monkeypatch, variant):
    """The weights graph inputs: every block is the same nested compile region, and each bucket's step gives
    the eager step's tokens and logits, without recompiling on the live inputs."""
    # more than 8 blocks (see below) where the families' options meet; two elsewhere: the region is traced once a
    # block, and the variants' own code is in every block alike
    layers = 9 if variant == "llama-shaped" else 2
    model = tiny_gpt(vocab_size=97, context_length=64, n_layer=layers, **VARIANTS[variant])
    step = DecodeStep(model, 4)
    blocks = step.regional_model.blocks
    region = vars(blocks[0])["forward"].__func__  # the blocks' own forward: one region for all
    assert region is not type(blocks[0]).forward
    assert all(vars(block)["forward"].__func__ is region for block in blocks)
    assert all("forward" not in vars(block) for block in step.model.blocks)  # the model itself is left as it is
    compiler = BackgroundCompiler.of(step, step.compile_order(4), None, "test")
    torch.manual_seed(1)
    with torch.inference_mode():
        for t in step.cache.tensors():
            t.normal_()
    traced = tracing(monkeypatch)
    for rows in step.compile_order(4):
        step.compiled[rows] = compiler.build(rows, regional=True)
        calls = [n for n in traced[-1].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        # every block calls the one region, built once (torch 2.11 traced a region per block: 30 for 30 layers; cache
        # views passed in, each with a column count of its own, made a region per block, and past 8 the build failed)
        assert len(calls) == len(blocks) and len({n.args[0].target for n in calls}) == 1
        _, columns = step.bucket(rows, 40)
        with torch.inference_mode():  # as the engine makes them
            tok, pos, bias, allowed, *cache = step.inputs(rows, columns)  # cache: the tables' view, the pools
            tok[:, 0] = torch.arange(rows) * 11 % 97
            pos[:, 0] = torch.arange(rows) * 3 + 20
            n = cache[0].shape[1]
            cache[0].copy_(torch.arange(rows * n).view(rows, n) * 5 % (step.cache.blocks - 1) + 1)  # scattered
            want = step.traced(tok, pos, bias, allowed, *cache)
            with no_recompiles():
                got = step.compiled[rows](tok, pos, bias, allowed, *cache)
        assert got[0].tolist() == want[0].tolist()
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


@pytest.mark.compile
def test_the_buckets_of_several_rows_share_one_regional_graph_kept_once(tmp_path, monkeypatch):
    """Over prepacked layers one regional graph, its rows dynamic, serves every bucket of 2 or more rows: traced
    and built once, checked on each bucket's inputs, kept once (and a mark for each bucket it serves), and
    at a restart loaded once, nothing traced or checked, each bucket giving the eager step's tokens."""
    emulate_cpu(monkeypatch, AVX2)  # float32 prepacked, as bf16 is where oneDNN computes it

    def outputs(step: DecodeStep, rows: int):
        with torch.inference_mode():
            inputs = step.inputs(rows, 16)
            for t in inputs[7:]:  # the pools
                t.normal_(generator=torch.Generator().manual_seed(rows))
            inputs[0][:, 0] = torch.arange(rows) * 11 % 97
            inputs[1][:, 0] = torch.arange(rows) * 3 % 14 + 1
            return step.regional(*inputs), step.compiled[rows](*inputs)

    passes = [(1, True), (8, True), (2, True), (4, True)]
    first = DecodeStep(tiny_gpt(vocab_size=97, context_length=64, n_layer=2), 8)
    traced = tracing(monkeypatch)
    built = BackgroundCompiler([Pass(first, *p) for p in passes], tmp_path, "key", name="tiny")
    for rows, _ in passes:
        first.compiled[rows] = built.build(rows, regional=True)
    assert len(traced) == 2  # one row's graph, then the shared one
    assert first.compiled[2] is first.compiled[4] is first.compiled[8] is not first.compiled[1]
    assert [b for b in (1, 2, 4, 8) if built.artifact(b, True).exists()] == [1, 8]
    assert sorted(p.name for p in tmp_path.rglob("*.shared")) == [
        "DecodeStep_2_regional.shared",
        "DecodeStep_4_regional.shared",
        "DecodeStep_8_regional.shared",
    ]
    for rows in (2, 4, 8):
        want, got = outputs(first, rows)
        assert got[0].tolist() == want[0].tolist()
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)

    def never(*args, **kwargs):
        raise AssertionError("traced or checked at the restart")

    monkeypatch.setattr(torch, "compile", never)
    monkeypatch.setattr(BackgroundCompiler, "matching", never)
    step = DecodeStep(tiny_gpt(vocab_size=97, context_length=64, n_layer=2), 8)  # the same weights, new tensors
    restarted = BackgroundCompiler([Pass(step, *p) for p in passes], tmp_path, "key", name="tiny")
    restarted.run()
    assert set(restarted.states().values()) == {"built"} and step.compiled[2] is step.compiled[8]
    want, got = outputs(step, 4)
    assert got[0].tolist() == want[0].tolist()


def test_a_bucket_not_built_runs_padded_on_the_smallest_larger_built_one_within_the_limit():
    """Until a bucket is built, its rows run on the smallest larger built bucket, padded at most
    `padding_limit` times (the CPU's 4; CUDA's any), with the tokens and logprobs of their own."""
    runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 8)
    step = runner.step
    assert step.padding_limit == 4
    ran: list[int] = []

    def built(*inputs: torch.Tensor):  # a built bucket's step: the eager one, recording its rows
        ran.append(inputs[0].shape[0])
        return step.uncompiled(*inputs)

    tables = [[1], [2], [3]]  # a block a sequence
    three = DecodeRows([4, 6, 8], [3, 2, 4], [0.0] * 3, [None] * 3, tables)  # bucket 4
    one = DecodeRows([4], [3], [0.0], [None], tables[:1])  # bucket 1
    with torch.inference_mode():
        runner.prefill([0, 1, 2], [[5, 17, 3], [1, 2], [9, 9, 9, 9]], tables, [0, 0, 0])
        want = step(three)  # nothing built: eager on 4 rows
        step.compiled[8] = built
        got = step(three)  # 8 <= 3 x 4
        step(one)  # 8 > 1 x 4: eager
        step.padding_limit = float("inf")  # CUDA's
        step(one)
        step.compiled[4] = built
        step(three)
    assert ran == [8, 8, 4]
    assert got.greedy == want.greedy and got.logits.shape == (3, 97)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["float32-avx2", "bfloat16"])
def test_a_regional_step_takes_the_prepacked_layers_as_inputs_and_is_called_without_dynamo(monkeypatch, dtype):
    """On the CPU the regional graph runs the eager model's prepacked layers (oneDNN's, an opaque op to inductor),
    their packed weights graph inputs bound at build time, not frozen copies; the engine calls the graph itself."""
    if dtype == "bfloat16":
        if not cpu_features().onednn_bf16:
            pytest.skip("this CPU's oneDNN has no bf16")
        model = tiny_gpt(vocab_size=97, context_length=64, n_layer=2).to(torch.bfloat16)
    else:
        emulate_cpu(monkeypatch, AVX2)  # float32 prepacked without AVX-512 (kernels run as this CPU can)
        model = tiny_gpt(vocab_size=97, context_length=64, n_layer=2)
    step = DecodeStep(model.eval(), 2)
    traced = tracing(monkeypatch)
    compiled = BackgroundCompiler.of(step, [2], None, "test").build(2, regional=True)
    region = next(m for name, m in traced[0].named_modules() if "subgraph" in name)
    ops = {torch.ops.tinyserve.prepacked_linear.default}
    if hasattr(torch.ops.tinyserve, "skinny_linear"):  # where the few-row kernel is built, the layers call its op
        ops.add(torch.ops.tinyserve.skinny_linear.default)
    assert any(n.target in ops for n in region.graph.nodes)
    with torch.inference_mode():
        inputs = step.inputs(2, 32)
        for t in inputs[7:]:  # the pools (inputs[4] is the tables' view of the blocks read, 5-6 the steering)
            t.normal_()
        inputs[4].copy_(torch.tensor([[3, 1], [2, 4]]))
        inputs[0][:, 0] = torch.tensor([5, 9])
        inputs[1][:, 0] = torch.tensor([3, 7])
        want = step.regional(*inputs)
        with torch.profiler.profile() as profile:
            got = compiled(*inputs)
    assert not any(e.name.startswith(("TorchDynamo", "Torch-Compiled Region")) for e in profile.events())
    assert got[0].tolist() == want[0].tolist()
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-4
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=tolerance, atol=tolerance)


@pytest.mark.compile
def test_a_kept_regional_graph_is_bound_by_name_at_a_restart_without_tracing_or_checking(tmp_path, monkeypatch):
    """A regional graph passed its check and was kept; a restart (a new step over weights loaded again, prepacked
    anew) binds it to its arguments and to those weights by name: nothing is traced, nothing checked again, and
    it gives the eager step's tokens and logits."""
    emulate_cpu(monkeypatch, AVX2)  # float32 prepacked layers: their packed weights are graph inputs too
    first = DecodeStep(tiny_gpt(vocab_size=97, context_length=64, n_layer=2), 2)
    built = BackgroundCompiler([Pass(first, 2, regional=True)], tmp_path, "key", name="tiny")
    built.run()
    assert built.states() == {"DecodeStep_2_regional": "built"}
    assert built.artifact(2, True).exists() and built.artifact(2, True).with_suffix(".json").exists()

    def never(*args, **kwargs):
        raise AssertionError("traced or checked at the restart")

    monkeypatch.setattr(torch, "compile", never)
    monkeypatch.setattr(BackgroundCompiler, "matching", never)
    step = DecodeStep(tiny_gpt(vocab_size=97, context_length=64, n_layer=2), 2)  # the same weights, new tensors
    restarted = BackgroundCompiler([Pass(step, 2, regional=True)], tmp_path, "key", name="tiny")
    restarted.run()
    assert restarted.states() == {"DecodeStep_2_regional": "built"}
    with torch.inference_mode():
        inputs = step.inputs(2, 16)
        for t in inputs[7:]:  # the pools
            t.normal_()
        inputs[0][:, 0] = torch.tensor([5, 9])
        inputs[1][:, 0] = torch.tensor([3, 7])
        want = step.regional(*inputs)
        got = step.compiled[2](*inputs)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


@pytest.mark.compile
def test_a_regional_build_that_fails_is_built_whole_and_a_failed_frozen_build_keeps_the_regional_graph(
    monkeypatch, caplog
):
    """torch specialises some regional graphs' dynamic sizes: such a pass builds one whole graph instead. A frozen
    build that fails leaves the bucket on its regional graph."""
    import logging

    step = DecodeStep(tiny_gpt(vocab_size=97, context_length=64), 2)
    compiler = BackgroundCompiler([(step, 1, True), (step, 2, True), (step, 2)], None, "test")
    compile = BackgroundCompiler.compile
    made: list[tuple] = []

    def some_fail(self, bucket, settings, regional=False):
        made.append((bucket, regional))
        if (bucket, regional) in {(1, True), (2, False)}:
            raise RuntimeError("specialised")
        return compile(self, bucket, settings, regional)

    monkeypatch.setattr(BackgroundCompiler, "compile", some_fail)
    with caplog.at_level(logging.WARNING, logger="tinyserve"):
        compiler.run()
    assert made[:3] == [(1, True), (1, False), (2, True)]  # bucket 1: regional, then whole
    assert set(step.compiled) == {1, 2}
    assert "DecodeStep_1_regional: regional build failed" in caplog.text
    assert "DecodeStep_2 not built, the bucket keeps its regional graph" in caplog.text
    assert list(compiler.failed) == ["DecodeStep_2"]
    assert list(compiler.seconds) == ["DecodeStep_1_regional", "DecodeStep_2_regional"]


@pytest.mark.compile
@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
def test_a_built_step_keeps_none_of_its_scratch_inputs(monkeypatch, regional):
    """A bucket's scratch inputs are a whole cache of its rows: a graph that held them would keep that memory for
    the life of the server (a 2,048-context 110M model: ~75 MB a row, every bucket, both forms)."""
    import gc
    import weakref

    step = DecodeStep(tiny_gpt(vocab_size=97, context_length=64), 2)
    made: list[weakref.ref] = []
    example = DecodeStep.example

    def recorded(self, rows):
        inputs = example(self, rows)
        made.extend(weakref.ref(t) for t in inputs)
        return inputs

    monkeypatch.setattr(DecodeStep, "example", recorded)
    step.compiled[2] = BackgroundCompiler.of(step, [2], None, "test").build(2, regional=regional)
    gc.collect()
    assert made and not [ref for ref in made if ref() is not None]


def test_a_bucket_is_frozen_only_where_the_cpp_gemm_template_runs_its_products(monkeypatch):
    """Above TEMPLATE_GEMM_MAX_ROWS rows on an AVX-512 CPU both graphs run the prepacked layers: no frozen copy of
    the weights; without AVX-512 the template serves every row count, so every bucket is frozen."""
    runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 32)
    emulate_cpu(monkeypatch, AVX512_BF16)
    frozen = [p.bucket for p in runner.compile_passes(32) if p.target is runner.step and not p.regional]
    assert frozen == [1, 2, 4]  # the compile order (1, 32, 2, 4, 8, 16) less the prepacked ones
    emulate_cpu(monkeypatch, AVX2)
    frozen = [p.bucket for p in runner.compile_passes(32) if p.target is runner.step and not p.regional]
    assert frozen == [1, 32, 2, 4, 8, 16]
