"""The Cog package: cog's own HTTP server (coglet) running predict.py as a real process on tiny models,
spoken to as `cog run` and Replicate do, plus the committed schema being current."""

from __future__ import annotations

import base64
import inspect
import json
import shutil
import threading
import time

import httpx
import pytest

from model_store.ingest import add_checkpoint
from model_store.store import write_checkpoint
from models.tokenizer import eos_id
from scripts.cog_predict import SCHEMA_PATH, free_port, parse_inputs, predict_stream, start_server, wait_ready
from scripts.cog_schema import build
from tests.conftest import tiny_gpt
from tests.test_tools_api import TOOLS, WEATHER
from tests.tool_models import HERMES_TEMPLATE, save_tool_model


def test_committed_schema_is_what_the_inspector_gives():
    """`.cog/openapi_schema.json` must be regenerated whenever predict.py's inputs change."""
    committed = json.loads(SCHEMA_PATH.read_text())
    assert committed == build(), "run: python -m scripts.cog_schema"
    inputs = committed["components"]["schemas"]["Input"]
    assert inputs["required"] == ["prompt"]
    assert inputs["properties"]["top_p"]["maximum"] == 1.0
    assert committed["paths"]["/predictions"]["post"]["x-cog-streaming"] is True
    assert committed["components"]["schemas"]["Output"]["x-cog-array-display"] == "concatenate"


def test_cli_inputs_are_typed_by_the_schema():
    schema = json.loads(SCHEMA_PATH.read_text())
    assert parse_inputs(["prompt=a=b", "max_new_tokens=5", "top_p=0.5", "task=attention"], schema) == {
        "prompt": "a=b",
        "max_new_tokens": 5,
        "top_p": 0.5,
        "task": "attention",
    }
    with pytest.raises(SystemExit, match="max_new_tokens must be integer"):
        parse_inputs(["max_new_tokens=many"], schema)


def outputs(runner, **inputs) -> list[str]:
    """A run's streamed items, called in process as coglet calls it (an async generator on an event loop)."""
    import asyncio

    async def collect() -> list[str]:
        return [item async for item in runner.run(**inputs)]

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def cog_store(store, tmp_path_factory, tiny_tokenizer):
    """The tiny store's EsperBERTos plus a tiny GPT with room for long generations (to cancel one)."""
    root = tmp_path_factory.mktemp("cog-store")
    vocab, eos = tiny_tokenizer.get_vocab_size(), eos_id(tiny_tokenizer)
    model = tiny_gpt(vocab_size=vocab, eos_token_id=eos, context_length=512)
    write_checkpoint(root / "tiny-gpt", model, tiny_tokenizer, card="# tiny gpt\n", metrics={})
    for variant in ("softmax0", "softmax1"):
        shutil.copytree(store / f"tiny-mlm-{variant}", root / f"tiny-mlm-{variant}")
    source = tmp_path_factory.mktemp("cog-src") / "tiny-hermes"
    save_tool_model(source, HERMES_TEMPLATE, "<|im_end|>")  # a chat model that calls tools
    add_checkpoint(source, "tiny-hermes", root)
    return root


@pytest.fixture(scope="module")
def cog_server(cog_store):
    port = free_port()
    proc = start_server(port, {"TINYSERVE_STORE": str(cog_store)})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout_s=120)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_health_check_ready(cog_server):
    health = httpx.get(f"{cog_server}/health-check").json()
    assert health["status"] == "READY" and health["setup"]["status"] == "succeeded"


@pytest.mark.slow
def test_prediction_is_reproducible(cog_server):
    body = {"input": {"prompt": "The castle", "max_new_tokens": 8, "seed": 3, "eos_bias": -1e9}}
    first = httpx.post(f"{cog_server}/predictions", json=body, timeout=60).json()
    second = httpx.post(f"{cog_server}/predictions", json=body, timeout=60).json()
    assert first["status"] == "succeeded", first
    assert len(first["output"]) >= 1 and first["output"] == second["output"]


@pytest.mark.slow
def test_streaming_events(cog_server):
    inputs = {"prompt": "The castle", "max_new_tokens": 20, "seed": 5, "eos_bias": -1e9}
    events = list(predict_stream(cog_server, inputs))
    names = [e for e, _ in events]
    assert names[0] == "start" and names[-1] == "completed" and names.count("output") >= 2
    chunks = [d["chunk"] for e, d in events if e == "output"]
    assert events[-1][1]["status"] == "succeeded" and events[-1][1]["output"] == chunks


@pytest.mark.slow
def test_fill_mask_and_attention_tasks(cog_server):
    fill = httpx.post(
        f"{cog_server}/predictions", json={"input": {"prompt": "The <mask> was", "task": "fill-mask", "top_n": 3}}
    ).json()
    text = "".join(fill["output"])
    assert "tiny-mlm-softmax0 (softmax0)" in text and "tiny-mlm-softmax1 (softmax1)" in text
    att = httpx.post(
        f"{cog_server}/predictions",
        json={"input": {"prompt": "The castle", "task": "attention", "layer": 0, "head": 1}},
        timeout=60,
    ).json()
    uri = "".join(att["output"])
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_looking_inside_tasks_answer_the_json_of_the_inspect_routes(cog_server, cog_store):
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    def cog(**inputs):
        return httpx.post(f"{cog_server}/predictions", json={"input": inputs}, timeout=60).json()

    lens = cog(prompt="The castle was", task="logit_lens", top_n=3)
    ablate = cog(prompt="The castle was", task="ablate", heads="[[0, 1]]", top_n=3)
    patch = cog(prompt="The town was", task="patch", corrupt="The river was", answer=" the", foil=" of")
    with TestClient(create_app(Settings(store=cog_store))) as c:
        assert (
            json.loads("".join(lens["output"]))
            == c.post("/inspect/logit-lens", json={"text": "The castle was", "top_k": 3}).json()
        )
        assert (
            json.loads("".join(ablate["output"]))
            == c.post("/inspect/ablate", json={"text": "The castle was", "heads": [[0, 1]], "top_k": 3}).json()
        )
    grid = json.loads("".join(patch["output"]))["grid"]
    assert len(grid) == 2 and len(grid[0]) == len(json.loads("".join(patch["output"]))["tokens"])
    missing = cog(prompt="The town was", task="patch", answer=" the", foil=" of")
    assert missing["status"] == "failed" and "corrupt" in missing["error"]
    bad = cog(prompt="The town was", task="ablate", heads="[[9, 0]]")
    assert bad["status"] == "failed" and "heads[0]" in bad["error"]


@pytest.mark.slow
def test_constrained_completion_and_chat_inputs(cog_server):
    import re

    def cog(**inputs):
        return httpx.post(f"{cog_server}/predictions", json={"input": inputs}, timeout=60).json()

    matched = cog(prompt="The code is", regex="[a-c]{3}-[0-9]{2}", eos_bias=-1e9, seed=3)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", "".join(matched["output"])), matched
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    valid = cog(prompt="The answer", json_schema=json.dumps(schema), temperature=0)
    assert isinstance(json.loads("".join(valid["output"]))["ok"], bool)
    both = cog(prompt="x", regex="a", json_schema="{}")
    assert both["status"] == "failed" and "json_schema" in both["error"]
    no_template = cog(prompt="x", messages=json.dumps([{"role": "user", "content": "hi"}]))
    assert no_template["status"] == "failed" and "no chat template" in no_template["error"]
    bad_role = cog(prompt="x", messages=json.dumps([{"role": "wizard", "content": "hi"}]))
    assert bad_role["status"] == "failed" and "role" in bad_role["error"]


@pytest.mark.slow
def test_out_of_range_input_is_422(cog_server):
    r = httpx.post(f"{cog_server}/predictions", json={"input": {"prompt": "x", "top_p": 5}})
    assert r.status_code == 422 and "top_p" in r.text and "maximum" in r.text
    r = httpx.post(f"{cog_server}/predictions", json={"input": {"prompt": "x", "task": "translate"}})
    assert r.status_code == 422 and "task" in r.text


@pytest.mark.slow
def test_bad_prompt_fails_with_the_rule(cog_server):
    r = httpx.post(f"{cog_server}/predictions", json={"input": {"prompt": "no mask here", "task": "fill-mask"}})
    assert r.json()["status"] == "failed" and "no <mask> token" in r.json()["error"]


@pytest.mark.slow
def test_cancel_stops_a_long_prediction(cog_server):
    pid = "cancel-me"
    body = {"id": pid, "input": {"prompt": "The castle", "max_new_tokens": 256, "eos_bias": -1e9}}
    events: list = []

    def stream():
        headers = {"Accept": "text/event-stream"}
        with httpx.stream("PUT", f"{cog_server}/predictions/{pid}", json=body, headers=headers, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data:"))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:  # running and streaming (256 tokens take ~0.3 s)
        time.sleep(0.05)
    cancel = httpx.post(f"{cog_server}/predictions/{pid}/cancel")
    assert cancel.status_code == 200, (cancel.text, len(events), events[-1:])
    t.join(timeout=30)
    final = json.loads(events[-1][5:])
    assert final["status"] == "canceled" and len(final.get("output") or []) < 256
    # the single slot is free again
    r = httpx.post(f"{cog_server}/predictions", json={"input": {"prompt": "The", "max_new_tokens": 2}}, timeout=60)
    assert r.json()["status"] == "succeeded"


@pytest.mark.slow
def test_predictions_at_once_share_the_engine_and_each_gives_its_own_tokens(cog_server):
    """An async run: eight predictions sent together are all taken (a busy runner refuses one: "at capacity") and
    each gives the text it gives alone (greedy)."""
    import concurrent.futures

    prompts = ["The castle", "The river", "In 1920 the", "A small", "The king", "Music", "The old", "Her first"]

    def predict(prompt: str) -> dict:
        body = {"input": {"prompt": prompt, "max_new_tokens": 48, "temperature": 0, "eos_bias": -1e9}}
        return httpx.post(f"{cog_server}/predictions", json=body, timeout=120).json()

    alone = [predict(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(predict, prompts))
    assert [r["status"] for r in together] == ["succeeded"] * len(prompts), together
    assert ["".join(r["output"]) for r in together] == ["".join(r["output"]) for r in alone], (alone, together)


@pytest.mark.slow
def test_cog_and_http_give_the_same_text_for_the_same_request_and_seed(cog_server, cog_store):
    """One service layer: the predictor and POST /generate share parameters, model choice and sampler."""
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    inputs = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 7, "eos_bias": -3.0}
    cog = httpx.post(f"{cog_server}/predictions", json={"input": {"prompt": "The castle", **inputs}}, timeout=60)
    body = {"inputs": "The castle", "parameters": {"do_sample": True, **inputs}}
    with TestClient(create_app(Settings(store=cog_store))) as c:
        http_text = c.post("/generate", json=body).json()["generated_text"]
    assert "".join(cog.json()["output"]) == http_text and http_text


@pytest.mark.slow
def test_a_steered_prediction_gives_the_steered_http_text(cog_server, cog_store):
    """Cog's `steer` input is the API's field as JSON: the same steered text as POST /generate, not the plain one."""
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    steer = [{"layer": 1, "vector": [0.5 * (-1) ** i for i in range(32)], "scale": 6.0}]
    inputs = {"prompt": "The castle", "max_new_tokens": 12, "temperature": 0.0, "eos_bias": -1e9}
    cog = httpx.post(f"{cog_server}/predictions", json={"input": {**inputs, "steer": json.dumps(steer)}}, timeout=60)
    assert cog.json()["status"] == "succeeded", cog.json()
    parameters = {"max_new_tokens": 12, "eos_bias": -1e9, "model": "tiny-gpt"}
    with TestClient(create_app(Settings(store=cog_store, models=["tiny-gpt"]))) as c:
        steered = c.post("/generate", json={"inputs": "The castle", "parameters": {**parameters, "steer": steer}})
        plain = c.post("/generate", json={"inputs": "The castle", "parameters": parameters})
    assert "".join(cog.json()["output"]) == steered.json()["generated_text"] != plain.json()["generated_text"]
    bad = httpx.post(f"{cog_server}/predictions", json={"input": {**inputs, "steer": '[{"layer": 0, "name": "x"}]'}})
    assert bad.json()["status"] == "failed" and "steer" in bad.json()["error"]


@pytest.mark.parametrize("bias, ends_at_once", [(100.0, True), (-1e9, False)])
def test_the_servers_default_eos_bias_reaches_the_cog_predictor(cog_store, monkeypatch, bias, ends_at_once):
    """TINYSERVE_DEFAULT_EOS_BIAS changes a prediction that sets no eos_bias as it changes /generate."""

    from fastapi.testclient import TestClient

    from predict import Runner
    from server.api.app import create_app
    from server.config import Settings

    for name, value in (("STORE", cog_store), ("DEFAULT_EOS_BIAS", bias), ("COMPILE_MODELS", "false")):
        monkeypatch.setenv(f"TINYSERVE_{name}", str(value))
    inputs = {n: p.default.default for n, p in inspect.signature(Runner.run).parameters.items() if n != "self"}
    predictor = Runner()
    predictor.setup()
    try:
        text = "".join(outputs(predictor, **{**inputs, "prompt": "The castle", "max_new_tokens": 8, "temperature": 0}))
    finally:
        predictor.registry.stop()
    with TestClient(create_app(Settings())) as client:
        body = {"inputs": "The castle", "parameters": {"max_new_tokens": 8, "details": True}}
        generated = client.post("/generate", json=body).json()["details"]["generated_tokens"]
    assert (text == "") == ends_at_once and (generated == 0) == ends_at_once


def test_a_chat_with_tools_gives_the_assistant_message_with_its_calls(cog_store, monkeypatch):
    """The predictor in process (its model input lists the shipped models only): one item, the message as JSON."""

    import jsonschema

    from predict import Runner

    for name, value in (("STORE", cog_store), ("COMPILE_MODELS", "false")):
        monkeypatch.setenv(f"TINYSERVE_{name}", str(value))
    inputs = {n: p.default.default for n, p in inspect.signature(Runner.run).parameters.items() if n != "self"}
    messages = json.dumps([{"role": "user", "content": "Weather in Paris?"}])
    inputs |= dict(model="tiny-hermes", messages=messages, tools=json.dumps(TOOLS), temperature=1.0, seed=4)
    predictor = Runner()
    predictor.setup()
    try:
        [item] = outputs(predictor, **{**inputs, "tool_choice": "get_weather"})
        with pytest.raises(ValueError, match="tool_choice"):
            outputs(predictor, **{**inputs, "tool_choice": "missing"})
        with pytest.raises(ValueError, match="tools: only with messages"):
            outputs(predictor, **{**inputs, "messages": ""})
    finally:
        predictor.registry.stop()
    [call] = json.loads(item)["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


@pytest.mark.slow
def test_a_training_through_coglet_returns_weights_that_serve_and_know_the_text_better(tmp_path):
    """POST /trainings (coglet in train mode) fine-tunes the shipped GPT on a user's text; the weights it returns
    serve a prediction and score held-out text of the same kind at a lower perplexity than the shipped GPT."""
    import random

    from fastapi.testclient import TestClient

    from model_store import STORE_ROOT
    from predict import Runner, unpacked
    from server.api.app import create_app
    from server.config import Settings

    rng = random.Random(0)
    names, places, things = ["Ada", "Bo", "Cy", "Dee"], ["market", "river", "tower", "garden"], ["key", "map", "lamp"]

    def story() -> str:
        return (f"The robot {rng.choice(names)} walked to the {rng.choice(places)} and found a {rng.choice(things)}. "
                f"It gave the {rng.choice(things)} to {rng.choice(names)}.")  # fmt: skip

    text = "\n\n".join(story() for _ in range(2000))  # ~200 KB
    held_out = " ".join(story() for _ in range(20))
    uri = "data:text/plain;base64," + base64.b64encode(text.encode()).decode()
    port = free_port()
    proc = start_server(port, {"TINYSERVE_COMPILE_MODELS": "false"}, train=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout_s=120)
        body = {"input": {"text": uri, "max_steps": 2, "minutes": 2.0, "learning_rate": 1e-3}}
        trained = httpx.post(f"{base}/trainings", json=body, timeout=600).json()
        refused = httpx.post(f"{base}/trainings", json={"input": {"text": "data:text/plain;base64,AAEC"}}, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert trained.get("status") == "succeeded", trained
    assert refused.json()["status"] == "failed" and "binary" in refused.json()["error"]  # one line, no traceback
    weights = tmp_path / "weights.tar.gz"
    weights.write_bytes(base64.b64decode(trained["output"].split(",", 1)[1]))

    runner = Runner()
    runner.setup(weights=str(weights))
    try:
        inputs = {n: p.default.default for n, p in inspect.signature(Runner.run).parameters.items() if n != "self"}
        assert "".join(outputs(runner, **{**inputs, "prompt": "The robot", "max_new_tokens": 8, "temperature": 0}))
    finally:
        runner.registry.stop()

    def perplexity(store, model: str) -> float:
        with TestClient(create_app(Settings(store=store, dtype="float32"))) as client:
            return client.post("/score", json={"model": model, "text": held_out}).json()["perplexity"]

    assert perplexity(unpacked(str(weights)), "gpt-trained") < perplexity(STORE_ROOT, "gpt-wikitext2")
