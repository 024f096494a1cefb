"""Regional compilation, CUDA's way (the weights graph inputs), run on the CPU: the blocks of a decode step are
one nested compile region (server/compiled.py: compile_blocks_once)."""

import pytest
import torch

from server.compiled import BackgroundCompiler
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
    compiler = BackgroundCompiler(step, step.compile_order(4), None, "test")
    torch.manual_seed(1)
    with torch.inference_mode():
        for t in step.cache.tensors():
            t.normal_()
    for rows in step.compile_order(4):
        step.compiled[rows] = compiler.build(rows)
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
