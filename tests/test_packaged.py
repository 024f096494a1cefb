"""A frozen CPU decode step kept as an AOTInductor package: built once, loaded at the next start, the eager tokens."""

import gc

import pytest
import torch

from models.sampling import SamplingParams
from server.execution import packaged
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner
from server.execution.decoder.verify_pass import VerifyPass
from server.execution.passes import Pass
from tests.conftest import tiny_gpt
from tests.test_compiled_step import GREEDY, started
from tests.test_prepacked import plain_weights, prepacked_dtype

pytestmark = [pytest.mark.compile, pytest.mark.slow]


def test_a_frozen_step_is_packaged_once_and_loaded_at_the_next_start(tmp_path, monkeypatch):
    model = tiny_gpt(vocab_size=97, context_length=128)
    prompt = [5, 17, 3, 42, 8, 11, 2, 9]
    eager, compiled = started(model), started(model)
    try:
        want = [e.id for e in eager.generate(prompt, GREEDY)[0]]
        step = compiled.runner.step
        with monkeypatch.context() as m:  # a package that fails its check is not kept, nor left half-way
            m.setattr("server.execution.step_check.disagreement", lambda *args, **kwargs: "the logits differ")
            rejected = BackgroundCompiler([Pass(step, 1)], tmp_path, "key", name="tiny")
            rejected.run()
        assert rejected.states()["DecodeStep_1"].startswith("not built: StepMismatchError: the logits differ")
        assert not any(tmp_path.rglob("*.pt2"))
        first = BackgroundCompiler([Pass(step, 1)], tmp_path, "key", name="tiny")
        first.run()
        assert first.states() == {"DecodeStep_1": "built"}
        assert first.artifact(1).name == "DecodeStep_1.pt2" and first.artifact(1).stat().st_size > 0
        assert [p.name for p in tmp_path.rglob("*.pt2")] == ["DecodeStep_1.pt2"]

        def no_export(*args, **kwargs):
            raise AssertionError("exported again: the package was not loaded")

        def no_check(*args, **kwargs):
            raise AssertionError("checked again: a kept package passed its check when it was built")

        monkeypatch.setattr(torch.export, "export", no_export)  # a restart: a new compiler over the same cache
        monkeypatch.setattr(BackgroundCompiler, "matching", no_check)
        again = BackgroundCompiler([Pass(step, 1, regional=True), Pass(step, 1)], tmp_path, "key", name="tiny")
        assert again.passes == [Pass(step, 1)]  # the package loads quicker than the regional graph would build
        step.compiled[1] = again.build(1)
        assert not isinstance(step.compiled[1], torch.nn.Module)  # the package's runner, not the model
        got = [e.id for e in compiled.generate(prompt, GREEDY)[0]]
    finally:
        eager.stop()
        compiled.stop()
    assert len(got) == 64 and got == want


def test_a_pass_that_does_not_package_is_compiled_in_process_and_not_kept(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("no export")

    monkeypatch.setattr(packaged.torch.export, "export", fails)
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        compiler = BackgroundCompiler([Pass(engine.runner.step, 1)], tmp_path, "key", name="tiny")
        compiler.run()
    finally:
        engine.stop()
    assert compiler.states() == {"DecodeStep_1": "built"}
    assert not compiler.artifact(1).exists()


def test_the_draft_check_is_packaged_too(tmp_path, monkeypatch):
    """Its graph is frozen (the C++ GEMM template's rows), so it is kept as a package, checked against eager on
    a real request's inputs like every pass; the template's sources are compiled once per package, not once per
    product."""
    import torch._inductor.kernel  # noqa: F401  # its modules compile their own templates once, at import
    from torch._inductor.codegen.common import KernelTemplate

    sources, compile_source = [], KernelTemplate._template_from_string
    monkeypatch.setattr(
        KernelTemplate, "_template_from_string", staticmethod(lambda s: sources.append(s) or compile_source(s))
    )
    runner = GPTRunner(tiny_gpt(vocab_size=97, context_length=128), None, 2)
    compiler = BackgroundCompiler([Pass(runner.verifier, VerifyPass.BUCKET)], tmp_path, "key", name="tiny")
    compiler.run()
    assert compiler.states() == {"VerifyPass_1x4": "built"}
    assert sources and len(sources) == len(set(sources)), f"{len(sources)} compiles of {len(set(sources))} sources"
    assert compiler.artifact(VerifyPass.BUCKET).suffix == ".pt2" and compiler.artifact(VerifyPass.BUCKET).exists()


def test_a_models_packages_bind_one_copy_of_their_constants(tmp_path, monkeypatch):
    """The C++ GEMM template packs a weight alike for each row count it serves: the second bucket's package and the
    draft check's bind the first's packed weights, and its norms and embedding are the model's own tensors. A GELU
    MLP's model: torch named two of its packed weights alike (packaged.py, distinct_constant_names). At a restart
    the first package maps its constants from the files kept beside the packages, and the others read none."""
    model = tiny_gpt(vocab_size=97, context_length=128)
    runner = GPTRunner(model, None, 2)
    own = packaged.SharedConstants()
    own.add([*model.parameters(), *model.buffers()])
    passes = [Pass(runner.step, 1), Pass(runner.verifier, VerifyPass.BUCKET), Pass(runner.step, 2)]
    compiler = BackgroundCompiler(passes, tmp_path, "key", name="tiny")
    kept = []  # distinct tensors the packages bind, after each
    for target, bucket, _ in passes:
        target.compiled[bucket] = compiler.build(bucket)
        kept.append(len(compiler.constants))
    assert kept[0] > len(own) and kept == [kept[0]] * 3, (len(own), kept)
    assert all(compiler.artifact(bucket).exists() for _, bucket, _ in passes)

    reads = []  # at a restart: whether each tensor read was mapped from the constants kept beside the packages
    read_tensors = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *args, **kwargs: reads.append(kwargs.get("mmap", False)) or read_tensors(*args, **kwargs)
    )
    restarted = BackgroundCompiler(passes, tmp_path, "key", name="tiny")
    read = []
    for target, bucket, _ in passes:
        before = len(reads)
        target.compiled[bucket] = restarted.build(bucket)
        read.append(len(reads) - before)
    assert read[0] > 0 and read[1:] == [0, 0] and all(reads), (read, reads)
    assert len(restarted.constants) == kept[0]


def test_once_the_packages_are_loaded_the_plain_weights_are_freed_and_the_tokens_stay(tmp_path, monkeypatch):
    """The packages bind their packed weights and the model's norms and embedding, none of the plain linear weights:
    those go once the compiler is done (the prepacked copy runs the rest), and the packaged step still gives its
    tokens. (Where the skinny kernel serves bf16 nothing is packaged and the kernel reads the plain weights: off
    here, as on a CPU without it.)"""
    monkeypatch.setattr("server.execution.skinny_gemm.usable", lambda: False)
    model = tiny_gpt(vocab_size=97, context_length=128).to(prepacked_dtype())
    prompt = [5, 17, 3, 42, 8, 11, 2, 9]
    engine = started(model)
    try:
        step = engine.runner.step
        compiler = BackgroundCompiler([Pass(step, 1)], tmp_path, "key", name="tiny")
        compiler.run()
        assert compiler.states() == {"DecodeStep_1": "built"}
        want = [e.id for e in engine.generate(prompt, GREEDY)[0]]
        plain = plain_weights(model)
        engine.runner.compiler_done()  # as the server calls it once every compiler is done
        gc.collect()
        assert plain and all(w() is None for w in plain), "a plain weight is still held"
        got = [e.id for e in engine.generate(prompt, GREEDY)[0]]
    finally:
        engine.stop()
    assert len(got) == 64 and got == want
