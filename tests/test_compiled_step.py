"""The compiled decode step: exact against eager for every GPT variant, cached per checkpoint, never fatal."""

import contextlib
import logging
from typing import NamedTuple

import pytest
import torch

from model_store.store import write_checkpoint
from models.gpt import GPT
from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution.compile_cache import cache_key
from server.execution.compiler import (
    BackgroundCompiler,
    GraphCapture,
    skipping_guards,
)
from server.execution.decoder.runner import GPTRunner
from tests.conftest import tiny_gpt

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
    """A compiled step whose guards fail on the live inputs would recompile on the compute thread, i.e. on the
    request path: inside, any recompile raises (torch.compiler's stance applies to every thread, the engine's
    too), so the step fails instead of answering."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def started(model, **kwargs) -> GenerationEngine:
    engine = GenerationEngine(GPTRunner(model, None, 2), max_batch_size=2, max_queue=8, **kwargs)
    engine.tokenizer = _NoText()
    engine.start()
    return engine


class _NoText:
    """Token ids are all these tests read: the detokenizer gets empty strings."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


class RopeBuilt(NamedTuple):
    model: GPT
    engine: GenerationEngine
    compiler: BackgroundCompiler
    finished: bool  # the compiler's done event within its wait


@pytest.fixture(scope="module")
def rope_built():
    """A 128-context rope GPT's engine whose one- and two-row steps a BackgroundCompiler built on its own thread, as
    the server builds them: compiled once for the tests that only call its steps or read its outputs."""
    model = tiny_gpt(vocab_size=97, context_length=128, positions="rope")
    engine = started(model)
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))  # allocates the static cache
        compiler = BackgroundCompiler.of(engine.runner.step, engine.runner.step.compile_order(2), None, "test")
        compiler.start()
        yield RopeBuilt(model, engine, compiler, compiler.done.wait(600))
    finally:
        engine.stop()


@pytest.mark.compile
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_step_gives_the_eager_tokens(variant, request, caplog):
    prompt = [5, 17, 3, 42, 8, 11, 2, 9]
    if variant == "rope":  # the shared engine's one-row step is this graph (its two-row one serves no single row)
        built = request.getfixturevalue("rope_built")
        assert built.finished and not built.compiler.failed and 1 in built.engine.runner.step.compiled
        model, compiled, owned = built.model, built.engine, None
    else:
        model = tiny_gpt(vocab_size=97, context_length=128, **VARIANTS[variant])
        compiled = owned = started(model)
    eager = started(model)
    try:
        want = [e.id for e in eager.generate(prompt, GREEDY)[0]]
        if owned is not None:
            compiled.generate(prompt, SamplingParams(max_new_tokens=1))  # allocates the static cache
            compiler = BackgroundCompiler.of(compiled.runner.step, compiled.runner.step.compile_order(1), None, "test")
            with caplog.at_level(logging.WARNING, logger="tinyserve"):
                for bucket in compiler.buckets:  # one row: build() checks logits within 1e-4
                    compiled.runner.step.compiled[bucket] = compiler.build(bucket)
            if VARIANTS[variant].get("n_relational_head"):  # built once: straight to the prepacked layers
                assert "template failed" not in caplog.text
        with no_recompiles():  # the live inputs pass the guards of the graphs built on scratch ones
            got = [e.id for e in compiled.generate(prompt, GREEDY)[0]]
    finally:
        eager.stop()
        if owned is not None:
            owned.stop()
    assert len(got) == 64 and got == want


@pytest.mark.gpu
@pytest.mark.compile
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
    assert not step.graphs.failed and {(1, columns) for columns in (32, 48, 64, 80)} <= set(step.graphs.graphs)


def test_a_step_reads_its_longest_rows_columns_rounded_up():
    step = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 8).step
    assert step.bucket(1, 1) == (1, 32) and step.bucket(3, 17) == (4, 32) and step.bucket(8, 64) == (8, 64)
    assert step.compile_order(8) == [1, 8, 2, 4]  # one graph per row count: one row, full load, the rest


@pytest.mark.compile
def test_one_compiled_graph_serves_every_column_count_up_to_the_context(rope_built):
    """Positions up to the last one: at 128 of 128 columns the table view spans a whole row of the tables,
    strided as the shorter views."""
    model, compiled = rope_built.model, rope_built.engine
    assert rope_built.finished and 1 in compiled.runner.step.compiled
    prompt, params = [5, 17, 3, 42], SamplingParams(max_new_tokens=124, temperature=0, eos_bias=float("-inf"))
    eager = started(model)
    try:
        want = [e.id for e in eager.generate(prompt, params)[0]]
        with no_recompiles():
            got = [e.id for e in compiled.generate(prompt, params)[0]]
    finally:
        eager.stop()
    assert len(got) == 124 and got == want


@pytest.mark.compile
def test_batched_equals_solo_with_compiled_steps(rope_built):
    engine, compiler = rope_built.engine, rope_built.compiler  # built by compiler.start(), on its own thread
    assert rope_built.finished and not compiler.failed
    assert set(engine.runner.step.compiled) == {1, 2}  # one graph per row count, for every column count
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
    solo = [[e.id for e in engine.generate(p, GREEDY)[0]] for p in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with no_recompiles(), ThreadPoolExecutor(2) as pool:
        batched = list(pool.map(lambda p: [e.id for e in engine.generate(p, GREEDY)[0]], prompts))
    assert batched == solo


@pytest.mark.compile
def test_a_built_step_runs_its_graph_without_dynamo(rope_built):
    """The engine calls the graph itself (GraphCapture): with dynamo's caches emptied and recompiling
    forbidden, a step still runs, over a column count other than the scratch inputs'. (The shared engine's
    one-row graph, called on the inputs of a step of its own, over the same model.)"""
    assert rope_built.finished
    step = GPTRunner(rope_built.model, None, 1).step
    compiled = rope_built.engine.runner.step.compiled[1]
    tok, pos, bias, allowed, *cache = step.inputs(1, 48)
    pos[0, 0] = 40
    with torch.inference_mode():
        want = step.traced(tok, pos, bias, allowed, *cache)
        torch._dynamo.reset()
        with torch.compiler.set_stance("fail_on_recompile"):
            got = compiled(tok, pos, bias, allowed, *cache)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


@pytest.mark.compile
def test_a_compiled_step_chooses_among_the_allowed_tokens(rope_built):
    """Structured output on the graph: a row's mask (a constraint's allowed tokens) keeps the greedy choice
    from the model's own best token, in the compiled step as in the eager one; a free row is untouched.
    (The shared engine's two-row graph, on the inputs of a step of its own: the engine's mask stays as it is.)"""
    assert rope_built.finished
    step = GPTRunner(rope_built.model, None, 2).step
    compiled = rope_built.engine.runner.step.compiled[2]
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


@pytest.mark.compile
def test_a_compiled_step_steers_its_steered_rows_as_the_eager_step(rope_built):
    """Steering on the graph: a row reading a row of the steering table gets the eager step's steered logits, a plain
    row beside it (row 0 of the table) the plain ones, in the one compiled two-row graph."""
    assert rope_built.finished
    step = GPTRunner(rope_built.model, None, 2).step
    compiled = rope_built.engine.runner.step.compiled[2]
    tok, pos, bias, allowed, table, steer_rows, steers, *pools = step.inputs(2, 32)
    pos[:, 0] = torch.tensor([9, 12])
    table.copy_(torch.tensor([[1, 2], [3, 4]]))  # each row its own blocks: a steered row's keys are its own
    with torch.inference_mode():
        plain = compiled(tok, pos, bias, allowed, table, steer_rows, steers, *pools)[2].clone()
        steers[1].normal_(generator=torch.Generator().manual_seed(0))
        steer_rows[0] = 1
        want = step.traced(tok, pos, bias, allowed, table, steer_rows, steers, *pools)
        got = compiled(tok, pos, bias, allowed, table, steer_rows, steers, *pools)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)
    assert (got[2][0] - plain[0]).abs().max() > 0.1
    torch.testing.assert_close(got[2][1], plain[1], rtol=1e-4, atol=1e-4)


SCALE = torch.tensor(3.0)


@pytest.mark.compile
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


@pytest.mark.compile
def test_compiled_artifacts_are_cached_per_checkpoint(tmp_path, tiny_tokenizer, monkeypatch):
    # a frozen CPU graph holds prepacked oneDNN weights, which inductor cannot pickle: the cache serves the
    # unfrozen graphs (CUDA's), so this test compiles without freezing
    monkeypatch.setattr("server.execution.compiler.inductor_settings", lambda device, rows, dtype, weights_bytes: {})
    a = tmp_path / "a"
    write_checkpoint(a, tiny_gpt(seed=0), tiny_tokenizer, card="# a\n", metrics={})
    cpu = torch.device("cpu")

    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        key = cache_key(a, torch.float32, cpu)
        compiler = BackgroundCompiler.of(engine.runner.step, [1], tmp_path / "cache", key)
        compiler.build(1)
        assert compiler.artifact(1).stat().st_size > 0

        def no_check(*args, **kwargs):
            raise AssertionError("checked again: kept artifacts passed the check when they were built")

        monkeypatch.setattr(BackgroundCompiler, "matching", no_check)  # a restart loads them unchecked
        again = BackgroundCompiler.of(engine.runner.step, [1], tmp_path / "cache", key)
        assert again.build(1) is not None
    finally:
        engine.stop()
    assert compiler.artifact(1).parent.name == cache_key(a, torch.float32, cpu)


def test_the_cache_key_names_the_kv_caches_shape(tmp_path, tiny_tokenizer):
    """A package's strides are those of the cache it was built for: another KV budget or batch size is another key."""
    write_checkpoint(tmp_path, tiny_gpt(seed=0), tiny_tokenizer, card="# a\n", metrics={})
    cpu = torch.device("cpu")
    keys = {cache_key(tmp_path, torch.float32, cpu, "native", shape) for shape in [(8, 512), (8, 1024), (4, 512)]}
    assert len(keys) == 3 and cache_key(tmp_path, torch.float32, cpu) not in keys


@pytest.mark.compile
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


@pytest.mark.compile
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
        compile_workers=1,  # the default: a worker process builds every other pass
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
        if gpt.runner.device.type == "cpu":  # a worker built every other pass, then ended; the server loaded them
            (worker,) = gpt.compiler.workers
            assert worker.labels == {"PromptPass_regional", "VerifyPass_1x4"} == set(worker.seconds)
            assert worker.process.returncode == 0
        built = client.get("/info").json()["compile_seconds"]  # each build's time, as the log says it
        # then the frozen one, and the draft check
        cpu = ["PromptPass_regional", "DecodeStep_1", "VerifyPass_1x4"] if gpt.runner.device.type == "cpu" else []
        assert list(built["tiny-gpt"]) == ["DecodeStep_1_regional", *cpu]
        assert all(isinstance(s, float) and s >= 0 for s in built["tiny-gpt"].values())  # a time for each build
        states = client.get("/info").json()["compile_states"]  # and each pass's state, in build order
        assert states["tiny-gpt"] == dict.fromkeys(built["tiny-gpt"], "built")
        assert client.post("/generate", json=body).status_code == 200
        filled = client.post("/fill-mask", json={"inputs": "The castle <mask> built", "variant": "softmax1"})
        assert filled.status_code == 200
    assert not any(tmp_path.rglob("DecodeStep_1.bin"))  # CPU: frozen oneDNN constants, unpicklable; CUDA: none


@pytest.mark.compile
def test_an_unwritable_cache_dir_costs_the_cache_not_the_step(tmp_path, monkeypatch, caplog):
    # unfrozen, as in test_compiled_artifacts_are_cached_per_checkpoint (the same graph, from inductor's cache):
    # a frozen CPU graph leaves no artifacts, so it would never try to write one
    monkeypatch.setattr("server.execution.compiler.inductor_settings", lambda device, rows, dtype, weights_bytes: {})
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the cache folder would have to be created under a file
    engine = started(tiny_gpt(vocab_size=97, context_length=64))
    try:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        compiler = BackgroundCompiler.of(engine.runner.step, [1], blocker, "key")
        with caplog.at_level(logging.WARNING, logger="tinyserve"):
            compiler.run()
    finally:
        engine.stop()
    assert not compiler.failed and 1 in engine.runner.step.compiled
    assert "could not cache" in caplog.text
