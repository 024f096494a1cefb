"""The compiled decode step: exact against eager for every GPT variant, cached per checkpoint, never fatal."""

import contextlib
import logging

import pytest
import torch

from model_store.store import write_checkpoint
from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution.compiler import (
    TEMPLATE_GEMM_MAX_ROWS,
    BackgroundCompiler,
    GraphCapture,
    cache_key,
    inductor_settings,
    skipping_guards,
)
from server.execution.decoder.runner import GPTRunner
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt

VARIANTS = {
    "sinusoidal": {},
    "rope": {"positions": "rope"},
    "learned-softmax1": {"positions": "learned", "softmax": "softmax1"},
    "additive": {"score": "additive"},
    "dual-relational": {"n_head": 2, "n_relational_head": 2, "positions": "rope"},
    # the options of the transformers families (model_store/families.py)
    "llama-shaped": {"positions": "rope", "n_kv_head": 2, "norm": "rmsnorm", "mlp": "swiglu", "rope_pairs": "half",
                     "qk_norm": True, "scale_embeddings": False, "bias": False, "qkv_bias": True},
    "neox-shaped": {"positions": "rope", "rotary_dim": 4, "rope_pairs": "half", "parallel_residual": True,
                    "mlp": "gelu_tanh", "rope_theta": 500.0},
}  # fmt: skip
GREEDY = SamplingParams(max_new_tokens=64, temperature=0, eos_bias=float("-inf"))


@contextlib.contextmanager
def no_recompiles():
    """No graph is compiled inside: a compiled step whose guards fail on the live inputs would recompile
    on the compute thread, i.e. on the request path."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    yield
    assert counters["stats"]["unique_graphs"] == before, "a compiled step recompiled on the live inputs"


def started(model, **kwargs) -> GenerationEngine:
    engine = GenerationEngine(GPTRunner(model, None, 2), max_batch_size=2, max_queue=8, **kwargs)
    engine.tokenizer = _NoText()
    engine.start()
    return engine


class _NoText:
    """Token ids are all these tests read: the detokenizer gets empty strings."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_step_gives_the_eager_tokens(variant):
    model = tiny_gpt(vocab_size=97, context_length=128, **VARIANTS[variant])
    prompt = [5, 17, 3, 42, 8, 11, 2, 9]
    eager, compiled = started(model), started(model)
    try:
        want = [e.id for e in eager.generate(prompt, GREEDY)[0]]
        compiled.generate(prompt, SamplingParams(max_new_tokens=1))  # allocates the static cache
        compiler = BackgroundCompiler.of(compiled.runner.step, compiled.runner.step.compile_order(1), None, "test")
        for bucket in compiler.buckets:  # one row: build() checks logits within 1e-4
            compiled.runner.step.compiled[bucket] = compiler.build(bucket)
        with no_recompiles():  # the live inputs pass the guards of the graphs built on scratch ones
            got = [e.id for e in compiled.generate(prompt, GREEDY)[0]]
    finally:
        eager.stop()
        compiled.stop()
    assert len(got) == 64 and got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_compiled_on_the_compilers_thread_replay_as_graphs_on_the_engines():
    """As the server runs them: built by a BackgroundCompiler's thread, run on the engine's, where each
    (rows, columns) shape is captured once and replayed; the tokens are eager's."""
    model = tiny_gpt(vocab_size=97, context_length=128, positions="rope").cuda()
    prompt = [5, 17, 3, 42, 8, 11, 2, 9]
    eager, compiled = started(model), started(model)
    try:
        want = [e.id for e in eager.generate(prompt, GREEDY)[0]]
        compiled.generate(prompt, SamplingParams(max_new_tokens=1))  # allocates the static cache
        step = compiled.runner.step
        compiler = BackgroundCompiler.of(step, step.compile_order(2), None, "test")
        compiler.start()
        assert compiler.done.wait(600) and not compiler.failed and sorted(step.compiled) == [1, 2]
        got = [e.id for e in compiled.generate(prompt, GREEDY)[0]]
        again = [e.id for e in compiled.generate(prompt, GREEDY)[0]]  # replays the graphs captured above
    finally:
        eager.stop()
        compiled.stop()
    assert got == want and again == want
    assert not step.graphs.failed and {(1, columns) for columns in (16, 32, 48, 64, 80)} <= set(step.graphs.graphs)


def test_a_step_reads_its_longest_rows_columns_rounded_up():
    step = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 8).step
    assert step.bucket(1, 1) == (1, 16) and step.bucket(3, 17) == (4, 32) and step.bucket(8, 64) == (8, 64)
    assert step.compile_order(8) == [1, 8, 2, 4]  # one graph per row count: one row, full load, the rest


def test_one_compiled_graph_serves_every_column_count_up_to_the_context():
    """Positions up to the last one: at 64 of 64 columns the view spans a whole row of the cache,
    strided as the shorter ones only because the cache keeps a spare column."""
    model = tiny_gpt(vocab_size=97, context_length=64, positions="rope")
    prompt, params = [5, 17, 3, 42], SamplingParams(max_new_tokens=60, temperature=0, eos_bias=float("-inf"))
    eager, compiled = started(model), started(model)
    try:
        want = [e.id for e in eager.generate(prompt, params)[0]]
        compiled.generate(prompt, SamplingParams(max_new_tokens=1))
        step = compiled.runner.step
        step.compiled[1] = BackgroundCompiler.of(step, [1], None, "test").build(1)
        with no_recompiles():
            got = [e.id for e in compiled.generate(prompt, params)[0]]
    finally:
        eager.stop()
        compiled.stop()
    assert len(got) == 60 and got == want


def test_batched_equals_solo_with_compiled_steps():
    model = tiny_gpt(vocab_size=97, context_length=128, positions="rope")
    engine = started(model)
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        compiler = BackgroundCompiler.of(engine.runner.step, engine.runner.step.compile_order(2), None, "test")
        compiler.start()
        assert compiler.done.wait(600) and not compiler.failed
        assert set(engine.runner.step.compiled) == {1, 2}  # one graph per row count, for every column count
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
        solo = [[e.id for e in engine.generate(p, GREEDY)[0]] for p in prompts]
        from concurrent.futures import ThreadPoolExecutor

        with no_recompiles(), ThreadPoolExecutor(2) as pool:
            batched = list(pool.map(lambda p: [e.id for e in engine.generate(p, GREEDY)[0]], prompts))
    finally:
        engine.stop()
    assert batched == solo


def test_a_built_step_runs_its_graph_without_dynamo():
    """The engine calls the graph itself (GraphCapture): with dynamo's caches emptied and recompiling
    forbidden, a step still runs, over a column count other than the scratch inputs'."""
    model = tiny_gpt(vocab_size=97, context_length=64, positions="rope")
    step = GPTRunner(model, None, 1).step
    compiled = BackgroundCompiler.of(step, [1], None, "test").build(1)
    tok, pos, bias, allowed, *cache = step.inputs(1, 48)
    pos[0, 0] = 40
    with torch.inference_mode():
        want = step.traced(tok, pos, bias, allowed, *cache)
        torch._dynamo.reset()
        with torch.compiler.set_stance("fail_on_recompile"):
            got = compiled(tok, pos, bias, allowed, *cache)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


def test_a_compiled_step_chooses_among_the_allowed_tokens():
    """Structured output on the graph: a row's mask (a constraint's allowed tokens) keeps the greedy choice
    from the model's own best token, in the compiled step as in the eager one; a free row is untouched."""
    model = tiny_gpt(vocab_size=97, context_length=64, positions="rope")
    step = GPTRunner(model, None, 2).step
    compiled = BackgroundCompiler.of(step, [2], None, "test").build(2)
    tok, pos, bias, allowed, *cache = step.inputs(2, 32)
    pos[:, 0] = torch.tensor([9, 12])
    with torch.inference_mode():
        free = step.traced(tok, pos, bias, allowed, *cache)[0].tolist()
        allowed[0, free[0]] = False  # row 0 may not take its best token, nor any of the first 40
        allowed[0, :40] = False
        want = step.traced(tok, pos, bias, allowed, *cache)
        got = compiled(tok, pos, bias, allowed, *cache)
    assert got[0].tolist() == want[0].tolist()
    assert got[0][0] != free[0] and got[0][0] >= 40 and got[0][1] == free[1]
    logits = want[2][0].float()
    assert got[0][0] == logits.masked_fill(~allowed[0], float("-inf")).argmax()


SCALE = torch.tensor(3.0)


def test_a_graph_that_reads_a_global_is_called_through_dynamo():
    """A graph input that is not the function's argument (a global tensor here) has no direct call: the
    bucket keeps dynamo's, which reads the global as it is at each call."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * SCALE

    capture = GraphCapture(lambda graph, example_inputs: graph.forward)
    compiled = torch.compile(scaled, fullgraph=True, backend=capture)
    assert compiled(torch.ones(2)).tolist() == [3.0, 3.0]
    assert capture.direct(scaled, returns_tensor=True) is None
    assert skipping_guards(compiled)(torch.ones(2)).tolist() == [3.0, 3.0]


def test_a_failed_compile_leaves_the_bucket_eager(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        compiler = BackgroundCompiler.of(engine.runner.step, engine.runner.step.compile_order(1), None, "test")
        with caplog.at_level(logging.WARNING, logger="tinyserve"):
            compiler.start()
            assert compiler.done.wait(60)
        assert compiler.failed == {"DecodeStep_1": "RuntimeError: no compiler here"}
        assert "stays eager" in caplog.text and not engine.runner.step.compiled
        tokens, finish = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5, eos_bias=float("-inf")))
        assert finish.reason == "length" and len(tokens) == 5
    finally:
        engine.stop()


def test_compiled_artifacts_are_cached_per_checkpoint(tmp_path, tiny_tokenizer, monkeypatch):
    # a frozen CPU graph holds prepacked oneDNN weights, which inductor cannot pickle: the cache serves the
    # unfrozen graphs (CUDA's), so this test compiles without freezing
    monkeypatch.setattr("server.execution.compiler.inductor_settings", lambda device, rows: {})
    a = tmp_path / "a"
    write_checkpoint(a, tiny_gpt(seed=0), tiny_tokenizer, card="# a\n", metrics={})
    cpu = torch.device("cpu")

    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        key = cache_key(a, torch.float32, cpu)
        compiler = BackgroundCompiler.of(engine.runner.step, [1], tmp_path / "cache", key)
        compiler.build(1)
    finally:
        engine.stop()
    assert compiler.artifact(1).stat().st_size > 0
    assert compiler.artifact(1).parent.name == cache_key(a, torch.float32, cpu)


@pytest.mark.parametrize("variant", ["softmax0", "softmax1"])
def test_compiled_encoder_fills_masks_as_eager(store, variant):
    from model_store import load_mlm
    from models.esperberto.fill_mask import fill_mask
    from models.esperberto.model import max_tokens
    from server.execution.encoder_step import EncoderStep

    model, tok = load_mlm(store / f"tiny-mlm-{variant}")
    if variant == "softmax0":
        model.set_attn_implementation("eager")  # as the registry serves it
    step = EncoderStep(model, max_tokens(model.config))
    step.compiled[32] = BackgroundCompiler.of(step, [32], None, "test").build(32)  # checked within 1e-4 of eager
    ids = tok("The castle was <mask> in 1350 .", return_tensors="pt")["input_ids"][0]
    assert 16 < len(ids) < 32  # padded to its bucket
    want, got = fill_mask(model, tok, ids, 5), fill_mask(model, tok, ids, 5, encode=step)
    assert [c["token"] for c in got[0]] == [c["token"] for c in want[0]]
    assert all(abs(a["score"] - b["score"]) < 1e-5 for a, b in zip(got[0], want[0], strict=True))


def test_cpu_steps_freeze_weights_and_only_cuda_steps_replay_cuda_graphs(monkeypatch):
    emulate_cpu(monkeypatch, AVX512_BF16)  # the prepacked layers win from 8 rows there
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert inductor_settings(cuda, 1) == {} and inductor_settings(cpu, 32) == {"freezing": True}
    assert GPTRunner(tiny_gpt(vocab_size=97), None, 2).step.graphs is None  # CUDA graphs only on CUDA
    few_rows = inductor_settings(cpu, 1)  # the C++ GEMM template, offered alone: nothing to benchmark
    assert few_rows["freezing"] and few_rows["max_autotune"] and few_rows["max_autotune_gemm_backends"] == "CPP"
    most = TEMPLATE_GEMM_MAX_ROWS
    assert inductor_settings(cpu, most) == few_rows != inductor_settings(cpu, most + 1)


def test_without_avx512_every_cpu_step_runs_its_matmuls_in_the_cpp_gemm_template(monkeypatch):
    emulate_cpu(monkeypatch, AVX2)  # MKL's float32 GEMM is the slower there, and oneDNN has no bf16
    template = inductor_settings(torch.device("cpu"), 1)
    assert template["max_autotune_gemm_backends"] == "CPP"
    assert all(inductor_settings(torch.device("cpu"), rows) == template for rows in (8, 32, 256))


def test_few_row_cpu_steps_run_their_matmuls_in_the_cpp_gemm_template(monkeypatch):
    from torch._inductor.utils import run_and_get_code

    def generated_code() -> str:
        with torch._inductor.config.patch(force_disable_caches=True):
            _, code = run_and_get_code(BackgroundCompiler.of(engine.runner.step, [1], None, "test").build, 1)
        return "\n".join(code)  # build checked it against eager, within the tolerance

    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        template = generated_code()
        monkeypatch.setattr("server.execution.compiler.TEMPLATE_GEMM_MAX_ROWS", 0)
        emulate_cpu(monkeypatch, AVX512_BF16)  # where the prepacked layers serve many rows (float32: MKL's)
        prepacked = generated_code()
    finally:
        engine.stop()
    # prepacked: oneDNN's linear in bf16, MKL's in float32 (this test's dtype)
    assert "micro_gemm" in template and "micro_gemm" not in prepacked and "_linear" in prepacked


def test_inductor_compiles_on_one_openmp_thread_for_code_that_runs_on_the_compute_threads_count(monkeypatch):
    """A second OpenMP team in the process made libgomp put the compute thread's worker to sleep between
    ops (server/execution/compiler.py): inductor's own torch ops run on one thread, the code it makes on the count
    the compiler was given, and dynamo's guards keep the caller's count (or the compute thread recompiles)."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor.utils import run_and_get_code

    original, seen = compile_fx_module.compile_fx, []

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    threads = torch.get_num_threads()
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        with torch._inductor.config.patch(force_disable_caches=True):
            step, code = run_and_get_code(BackgroundCompiler.of(engine.runner.step, [2], None, "test", 3).build, 2)
        assert seen == [1] and torch.get_num_threads() == threads
        with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):  # as the compute thread
            step(*engine.runner.step.example(2))
    finally:
        engine.stop()
    assert "#pragma omp parallel num_threads(3)" in "\n".join(code)


def test_cpu_steps_really_freeze_their_weights_into_prepacked_linears(monkeypatch):
    """torch.compile(options={"freezing": True}) left the weights as graph inputs (plain addmm, no
    packing): the setting must reach inductor's config, which the build does."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("server.execution.compiler.TEMPLATE_GEMM_MAX_ROWS", 0)  # a bucket of oneDNN's rows
    emulate_cpu(monkeypatch, AVX512_BF16)  # (without AVX-512 every bucket runs the template)

    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        counters.clear()
        with torch._inductor.config.patch(force_disable_caches=True):
            BackgroundCompiler.of(engine.runner.step, [1], None, "test").build(1)
    finally:
        engine.stop()
    packed = {k: v for k, v in counters["inductor"].items() if "linear_weight_pack" in k and k.endswith("_count")}
    assert packed and sum(packed.values()) >= 4 * 2  # the qkv, attention, MLP linears of both blocks (and the head)


def test_the_server_compiles_in_the_background_and_serves_meanwhile(store, tmp_path):
    import time

    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    settings = Settings(
        store=store,
        models=["tiny-gpt", "tiny-mlm-softmax1"],
        compile_models=True,
        compile_max_batch=1,
        compile_cache_dir=tmp_path,
    )
    app = create_app(settings)
    with TestClient(app) as client:
        body = {"inputs": "The castle", "parameters": {"max_new_tokens": 4, "eos_bias": -1e9}}
        assert client.post("/generate", json=body).status_code == 200  # eager, or compiled if already built
        deadline = time.monotonic() + 300
        while client.get("/health").json()["compiling"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.get("/health").json()["compiling"] == []
        registry = app.state.registry
        gpt, mlm = registry.get("tiny-gpt"), registry.get("tiny-mlm-softmax1")
        assert set(gpt.runner.step.compiled) == {1} and not gpt.compiler.failed
        assert mlm.encoder_step.compiled and not mlm.compiler.failed
        built = client.get("/info").json()["compile_seconds"]  # each build's time, as the log says it
        # then the frozen one, and the draft check
        cpu = ["PromptPass", "DecodeStep_1", "VerifyPass_1x4"] if gpt.runner.device.type == "cpu" else []
        assert list(built["tiny-gpt"]) == ["DecodeStep_1_regional", *cpu] and min(built["tiny-gpt"].values()) > 0
        assert client.post("/generate", json=body).status_code == 200
        filled = client.post("/fill-mask", json={"inputs": "The castle <mask> built", "variant": "softmax1"})
        assert filled.status_code == 200
    assert not any(tmp_path.rglob("DecodeStep_1.bin"))  # CPU: frozen oneDNN constants, unpicklable; CUDA: none


def test_an_unwritable_cache_dir_costs_the_cache_not_the_step(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the cache folder would have to be created under a file
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        compiler = BackgroundCompiler.of(engine.runner.step, [1], blocker, "key")
        compiler.run()
    finally:
        engine.stop()
    assert not compiler.failed and 1 in engine.runner.step.compiled
