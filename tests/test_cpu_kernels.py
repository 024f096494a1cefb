"""Which kernels a compiled CPU step runs: frozen weights in prepacked linear layers or inductor's C++ GEMM template,
by the CPU's features and the step's rows, built on one OpenMP thread for the compute thread's count."""

import re
import threading
from collections.abc import Callable

import pytest
import torch

from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner
from server.execution.kernel_choice import TEMPLATE_GEMM_MAX_ROWS, inductor_settings, template_takes
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt
from tests.test_compiled_step import started


def test_cpu_steps_freeze_weights_and_only_cuda_steps_replay_cuda_graphs(monkeypatch):
    emulate_cpu(monkeypatch, AVX512_BF16)  # the prepacked layers win from 8 rows there
    cpu, cuda, f32 = torch.device("cpu"), torch.device("cuda", 0), torch.float32
    assert inductor_settings(cuda, 1, f32) == {} and inductor_settings(cpu, 32, f32) == {"freezing": True}
    assert GPTRunner(tiny_gpt(vocab_size=97), None, 2).step.graphs is None  # CUDA graphs only on CUDA
    few_rows = inductor_settings(cpu, 1, f32)  # the C++ GEMM template, offered alone: nothing to benchmark
    assert few_rows["freezing"] and few_rows["max_autotune"] and few_rows["max_autotune_gemm_backends"] == "CPP"
    most = TEMPLATE_GEMM_MAX_ROWS
    assert inductor_settings(cpu, most, f32) == few_rows != inductor_settings(cpu, most + 1, f32)


def test_only_a_gpt_with_relational_heads_is_kept_from_the_template():
    assert template_takes(tiny_gpt()) and template_takes(None)  # a pass without a GPT: its rows decide
    assert not template_takes(tiny_gpt(n_head=2, n_relational_head=2, positions="rope"))


def test_without_avx512_every_cpu_step_runs_its_matmuls_in_the_cpp_gemm_template(monkeypatch):
    emulate_cpu(monkeypatch, AVX2)  # MKL's float32 GEMM is the slower there, and oneDNN has no bf16
    template = inductor_settings(torch.device("cpu"), 1, torch.float32)
    assert template["max_autotune_gemm_backends"] == "CPP"
    assert all(inductor_settings(torch.device("cpu"), rows, torch.float32) == template for rows in (8, 32, 256))


# A linear layer of the generated code that runs a prepacked kernel (MKL's in float32, oneDNN's in bf16) on a frozen
# constant: its weights were frozen and packed at build time, not read as graph inputs.
PREPACKED_LINEAR = re.compile(r"torch\.ops\.(?:mkl\._mkl_linear|mkldnn\._linear_pointwise)\.\w+\([^\n]*_frozen_param")


def packed_linears(code: str) -> int:
    return len(PREPACKED_LINEAR.findall(code))


def generated_code(engine: GenerationEngine, rows: int = 1, *args) -> tuple[Callable, str]:
    """The engine's step of `rows` rows built afresh (no cache), and the code inductor generated for it (build
    checked it against eager, within the tolerance)."""
    from torch._inductor.utils import run_and_get_code

    with torch._inductor.config.patch(force_disable_caches=True):
        step, code = run_and_get_code(
            BackgroundCompiler.of(engine.runner.step, [rows], None, "test", *args).build, rows
        )
    return step, "\n".join(code)


@pytest.fixture(scope="module")
def prepacked_code():
    """A one-row step's code where the prepacked layers serve its rows (a CPU with AVX-512 and a template limit of
    0 rows): the C++ GEMM template test and the freezing test read the same build."""
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr("server.execution.kernel_choice.TEMPLATE_GEMM_MAX_ROWS", 0)  # a bucket of oneDNN's rows
            emulate_cpu(monkeypatch, AVX512_BF16)  # where the prepacked layers serve many rows (float32: MKL's)
            return generated_code(engine)[1]
    finally:
        engine.stop()


@pytest.mark.compile
def test_few_row_cpu_steps_run_their_matmuls_in_the_cpp_gemm_template(prepacked_code):
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        template = generated_code(engine)[1]
    finally:
        engine.stop()
    prepacked = prepacked_code
    # prepacked: oneDNN's linear in bf16, MKL's in float32 (this test's dtype)
    assert "micro_gemm" in template and "micro_gemm" not in prepacked and "_linear" in prepacked


@pytest.mark.compile
def test_inductor_compiles_on_one_openmp_thread_for_code_that_runs_on_the_compute_threads_count(monkeypatch):
    """A second OpenMP team in the process made libgomp put the compute thread's worker to sleep between
    ops (server/execution/compiler.py): inductor's own torch ops run on one thread, the code it makes on the count
    the compiler was given, and dynamo's guards keep the caller's count (or the compute thread recompiles)."""
    import torch._inductor.compile_fx as compile_fx_module

    original, seen, builder = compile_fx_module.compile_fx, [], threading.current_thread()

    def recording(*args, **kwargs):
        if threading.current_thread() is builder:  # this build's (not another test's leftover compiler's)
            seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    threads = torch.get_num_threads()
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        step, code = generated_code(engine, 2, 3)
        assert seen and set(seen) == {1} and torch.get_num_threads() == threads  # inductor ran on one thread
        with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):  # as the compute thread
            step(*engine.runner.step.example(2))
    finally:
        engine.stop()
    assert "#pragma omp parallel num_threads(3)" in code


@pytest.mark.compile
def test_cpu_steps_really_freeze_their_weights_into_prepacked_linears(prepacked_code):
    """torch.compile(options={"freezing": True}) left the weights as graph inputs (plain addmm, no
    packing): the setting must reach inductor's config, which the build does. (A bucket of oneDNN's rows on a
    CPU with AVX-512: without it every bucket runs the template.)"""
    assert packed_linears(prepacked_code) >= 4 * 2  # the qkv, attention, MLP linears of both blocks (and the head)
