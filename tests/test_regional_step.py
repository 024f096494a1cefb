"""Building decode steps: the blocks of a step as one nested compile region (CUDA's way, run on the CPU:
server/compiled.py, compile_blocks_once), and a bucket not built yet running padded on a larger built one."""

import pytest
import torch

from server.compiled import BackgroundCompiler
from server.runners.decoder.runner import GPTRunner
from server.runners.decoder.step import DecodeStep
from tests.conftest import tiny_gpt
from tests.test_compiled_step import VARIANTS, no_recompiles


@pytest.mark.parametrize("variant", ["llama-shaped", "dual-relational"])
def test_a_regional_step_compiles_one_region_for_all_blocks_and_gives_the_eager_step(monkeypatch, variant):
    """CUDA's compilation (the weights graph inputs, as there), run on the CPU: every block is the same
    nested compile region, and each bucket's step gives the eager step's tokens and logits, without
    recompiling on the live inputs."""
    import server.compiled

    monkeypatch.setattr(server.compiled, "inductor_settings", lambda device, rows: {})
    model = tiny_gpt(vocab_size=97, context_length=64, n_layer=3, **VARIANTS[variant])
    step = DecodeStep(model, 4, regional=True)
    region = vars(step.model.blocks[0])["forward"].__func__  # the blocks' own forward: one region for all
    assert region is not type(step.model.blocks[0]).forward
    assert all(vars(block)["forward"].__func__ is region for block in step.model.blocks)
    compiler = BackgroundCompiler.of(step, step.compile_order(4), None, "test")
    torch.manual_seed(1)
    with torch.inference_mode():
        for t in step.cache.tensors():
            t.normal_()
    traced: list[torch.fx.GraphModule] = []  # the graphs dynamo hands the backend
    capture = server.compiled.GraphCapture.__call__
    monkeypatch.setattr(server.compiled.GraphCapture, "__call__", lambda c, g, i: traced.append(g) or capture(c, g, i))
    for rows in step.compile_order(4):
        step.compiled[rows] = compiler.build(rows)
        calls = [n for n in traced[-1].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        # every block calls the one region (torch 2.11 traced a region per block: 30 for a 30-layer model)
        assert len(calls) == 3 and len({n.args[0].target for n in calls}) == 1
        _, columns = step.bucket(rows, 40)
        with torch.inference_mode():  # as the engine makes them
            tok, pos, bias, allowed, *cache = step.inputs(rows, columns)
            tok[:, 0] = torch.arange(rows) * 11 % 97
            pos[:, 0] = torch.arange(rows) * 3 + 20
            want = step.traced(tok, pos, bias, allowed, *cache)
            with no_recompiles():
                got = step.compiled[rows](tok, pos, bias, allowed, *cache)
        assert got[0].tolist() == want[0].tolist()
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


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

    three = ([4, 6, 8], [3, 2, 4], [0.0] * 3, [None] * 3)  # bucket 4
    one = ([4], [3], [0.0], [None])  # bucket 1
    with torch.inference_mode():
        runner.prefill([0, 1, 2], [[5, 17, 3], [1, 2], [9, 9, 9, 9]])
        want = step(*three)  # nothing built: eager on 4 rows
        step.compiled[8] = built
        got = step(*three)  # 8 <= 3 x 4
        step(*one)  # 8 > 1 x 4: eager
        step.padding_limit = float("inf")  # CUDA's
        step(*one)
        step.compiled[4] = built
        step(*three)
    assert ran == [8, 8, 4]
    assert got.greedy == want.greedy and got.logits.shape == (3, 97)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
