"""A frozen CPU decode step kept as an AOTInductor package: built once, loaded at the next start, the eager tokens."""

import gc
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution import packaged
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.verify_pass import VerifyPass
from server.execution.passes import Pass
from tests.conftest import tiny_gpt
from tests.test_compiled_step import GREEDY, started
from tests.test_prepacked import plain_weights, prepacked_dtype

pytestmark = [pytest.mark.compile, pytest.mark.slow]


class Packaged(NamedTuple):
    engine: GenerationEngine  # over the model whose passes were packaged
    passes: list[Pass]  # its one-row step, its draft check, its two-row step, packaged in this order
    compiler: BackgroundCompiler  # the one that packaged them, into its own cache folder
    constants: list[int]  # distinct tensors the packages bind, after each build
    sources: list[str]  # the C++ GEMM template's sources compiled while the draft check was packaged


@pytest.fixture(scope="module")
def packaged_gpt(tmp_path_factory):
    """One model's frozen passes packaged once, as a server's compiler packages them (each is minutes of g++ on 2
    cores), for the tests that read how they were built or load them as a restart does."""
    import torch._inductor.kernel  # noqa: F401  # its modules compile their own templates once, at import
    from torch._inductor.codegen.common import KernelTemplate

    engine = started(tiny_gpt(vocab_size=97, context_length=128))
    runner, sources, constants = engine.runner, [], []
    passes = [Pass(runner.step, 1), Pass(runner.verifier, VerifyPass.BUCKET), Pass(runner.step, 2)]
    compiler = BackgroundCompiler(passes, tmp_path_factory.mktemp("packages"), "key", name="tiny")
    compile_source = KernelTemplate._template_from_string
    try:
        for index, (target, _, _) in enumerate(passes):
            recording = target is runner.verifier
            with pytest.MonkeyPatch.context() as m:
                m.setattr(
                    KernelTemplate,
                    "_template_from_string",
                    staticmethod(lambda s, r=recording: (r and sources.append(s)) or compile_source(s)),
                )
                compiler.build_pass(index, None)  # as run() builds each, its state recorded
            constants.append(len(compiler.constants))
        yield Packaged(engine, passes, compiler, constants, sources)
    finally:
        engine.stop()


def a_copy(cache: Path, into: Path, *names: str) -> Path:
    """The packages `names` (all without names) and the constants kept beside them, copied to a cache folder of a
    test's own."""
    into.mkdir(parents=True)
    for path in cache.iterdir():
        if path.suffix != ".pt2" or not names or path.stem in names:
            shutil.copytree(path, into / path.name) if path.is_dir() else shutil.copy(path, into / path.name)
    return into


def test_a_frozen_step_is_packaged_once_and_loaded_at_the_next_start(packaged_gpt, tmp_path, monkeypatch):
    compiled, first = packaged_gpt.engine, packaged_gpt.compiler
    model, step = compiled.runner.model, compiled.runner.step
    prompt = [5, 17, 3, 42, 8, 11, 2, 9]
    eager = started(model)
    try:
        want = [e.id for e in eager.generate(prompt, GREEDY)[0]]
        with monkeypatch.context() as m:  # a package that fails its check is not kept, nor left half-way
            built = first.artifact(1)
            m.setattr(  # packaged as before (the same pass: its package's bytes), then checked
                "server.execution.compiler.package", lambda target, bucket, path, settings: shutil.copy(built, path)
            )
            m.setattr("server.execution.step_check.disagreement", lambda *args, **kwargs: "the logits differ")
            rejected = BackgroundCompiler([Pass(step, 1)], tmp_path / "rejected", "key", name="tiny")
            rejected.run()
        assert rejected.states()["DecodeStep_1"].startswith("not built: StepMismatchError: the logits differ")
        assert not any((tmp_path / "rejected").rglob("*.pt2"))
        assert first.artifact(1).name == "DecodeStep_1.pt2" and first.artifact(1).stat().st_size > 0
        cache = a_copy(first.cache_dir, tmp_path / "key", "DecodeStep_1")
        assert first.states()["DecodeStep_1"] == "built"
        assert [p.name for p in cache.rglob("*.pt2")] == ["DecodeStep_1.pt2"]

        def no_export(*args, **kwargs):
            raise AssertionError("exported again: the package was not loaded")

        def no_check(*args, **kwargs):
            raise AssertionError("checked again: a kept package passed its check when it was built")

        monkeypatch.setattr(torch.export, "export", no_export)  # a restart: a new compiler over the same cache
        monkeypatch.setattr(BackgroundCompiler, "matching", no_check)
        again = BackgroundCompiler([Pass(step, 1, regional=True), Pass(step, 1)], tmp_path, "key", name="tiny")
        assert again.cache_dir == cache
        assert again.passes == [Pass(step, 1)]  # the package loads quicker than the regional graph would build
        step.compiled[1] = again.build(1)
        assert not isinstance(step.compiled[1], torch.nn.Module)  # the package's runner, not the model
        got = [e.id for e in compiled.generate(prompt, GREEDY)[0]]
    finally:
        eager.stop()
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


def test_the_draft_check_is_packaged_too(packaged_gpt):
    """Its graph is frozen (the C++ GEMM template's rows), so it is kept as a package, checked against eager on
    a real request's inputs like every pass; the template's sources are compiled once per package, not once per
    product."""
    compiler, sources = packaged_gpt.compiler, packaged_gpt.sources
    assert compiler.states()["VerifyPass_1x4"] == "built"
    assert sources and len(sources) == len(set(sources)), f"{len(sources)} compiles of {len(set(sources))} sources"
    assert compiler.artifact(VerifyPass.BUCKET).suffix == ".pt2" and compiler.artifact(VerifyPass.BUCKET).exists()


def test_a_models_packages_bind_one_copy_of_their_constants(packaged_gpt, tmp_path, monkeypatch):
    """The C++ GEMM template packs a weight alike for each row count it serves: the second bucket's package and the
    draft check's bind the first's packed weights, and its norms and embedding are the model's own tensors. A GELU
    MLP's model: torch named two of its packed weights alike (packaged.py, distinct_constant_names). At a restart
    the first package maps its constants from the files kept beside the packages, and the others read none."""
    model, passes, compiler, kept = packaged_gpt.engine.runner.model, packaged_gpt.passes, *packaged_gpt[2:4]
    own = packaged.SharedConstants()
    own.add([*model.parameters(), *model.buffers()])
    assert set(compiler.states().values()) == {"built"}
    assert kept[0] > len(own) and kept == [kept[0]] * 3, (len(own), kept)
    assert all(compiler.artifact(bucket).exists() for _, bucket, _ in passes)
    a_copy(compiler.cache_dir, tmp_path / "key")

    reads = []  # at a restart: whether each tensor read was mapped from the constants kept beside the packages
    read_tensors = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *args, **kwargs: reads.append(kwargs.get("mmap", False)) or read_tensors(*args, **kwargs)
    )
    restarted = BackgroundCompiler(passes, tmp_path, "key", name="tiny")  # the copy
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
