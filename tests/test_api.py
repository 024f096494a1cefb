"""The HTTP API on tiny models built on the fly (FastAPI's TestClient is httpx underneath)."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from server.api import middleware
from server.api.app import create_app
from server.api.metrics import Metrics
from server.config import Settings
from tests.conftest import error_of


@pytest.fixture
def client(store_client):
    return store_client  # the app over the shared store (conftest.py), built once for the session


def test_health_models_info(client):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["models"] == ["tiny-gpt", "tiny-mlm-softmax0", "tiny-mlm-softmax1"]
    assert "broken-gpt" in h.json()["failed"] and "model.safetensors" in h.json()["failed"]["broken-gpt"]
    listed = client.get("/models").json()
    models = {m["id"]: m for m in listed["data"]}
    assert "broken-gpt" in listed["failed"] and "model.safetensors" in listed["failed"]["broken-gpt"]
    assert models["tiny-gpt"]["attention"] == "softmax0" and "generate" in models["tiny-gpt"]["tasks"]
    assert (
        models["tiny-mlm-softmax1"]["attention"] == "softmax1"
        and models["tiny-mlm-softmax1"]["tasks"][0] == "fill-mask"
    )
    card = client.get("/models/tiny-gpt").json()
    assert card["card"].startswith("# tiny gpt") and card["config"]["n_layer"] == 2
    info = client.get("/info").json()
    assert info["max_new_tokens_cap"] == 40 and info["placement"]["dtype"] == "float32"
    assert info["context"]["tiny-gpt"] == card["config"]["context_length"]
    assert 0 < info["kv_cache_bytes"]["tiny-gpt"] <= info["kv_cache_mb"] * 2**20


def test_generate_tgi_format(client):
    r = client.post(
        "/generate",
        json={"inputs": "The castle", "parameters": {"max_new_tokens": 8, "details": True, "top_n_tokens": 2}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    d = body["details"]
    assert d["finish_reason"] in ("length", "eos_token") and d["generated_tokens"] == len(
        [t for t in d["tokens"] if not t["special"]]
    )
    assert body["generated_text"] == "".join(t["text"] for t in d["tokens"])
    assert all(len(t) == 2 for t in d["top_tokens"])


def test_seed_reproducibility(client):
    req = {"inputs": "The river", "parameters": {"max_new_tokens": 12, "do_sample": True, "seed": 5, "eos_bias": -1e9}}
    a, b = client.post("/generate", json=req).json(), client.post("/generate", json=req).json()
    assert a == b


def test_generate_stream_events(client):
    req = {"inputs": "The castle", "parameters": {"max_new_tokens": 6, "eos_bias": -1e9}}
    with client.stream("POST", "/generate_stream", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 6
    assert all(e["token"]["text"] is not None for e in events)
    assert "generated_text" not in events[0] and events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)


def test_stop_sequence_over_http(client):
    base = {"inputs": "The castle", "parameters": {"max_new_tokens": 20, "eos_bias": -1e9}}
    text = client.post("/generate", json=base).json()["generated_text"]
    stop = text[3:6]
    r = client.post("/generate", json={**base, "parameters": {**base["parameters"], "stop": [stop], "details": True}})
    assert r.json()["generated_text"] == text[: text.index(stop)]
    assert r.json()["details"]["finish_reason"] == "stop_sequence"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": ""}, "inputs"),
        ({"inputs": "x", "parameters": {"temperature": 0}}, "parameters.temperature"),
        ({"inputs": "x", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
        ({"inputs": "x", "parameters": {"max_new_tokens": -3}}, "parameters.max_new_tokens"),
        ({"inputs": "x", "parameters": {"model": "../../etc/passwd"}}, "parameters.model"),
        ({"inputs": "x", "parameters": {"model": "nope"}}, "parameters.model"),
        ({"inputs": "x", "parameters": {"logit_bias": {"999999": 1.0}}}, "parameters.logit_bias"),
        ({"inputs": "x", "parameters": {"stop": [""]}}, "parameters.stop.0"),
        ({"inputs": "x", "parameters": {"bogus": 1}}, "parameters.bogus"),
        ({"inputs": "word " * 200}, "inputs"),
    ],
)
def test_bad_requests_name_the_field(client, body, field):
    r = client.post("/generate", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["field"] == field and field.split(".")[-1] in r.json()["error"]


def test_unknown_model_is_404(client):
    assert client.post("/generate", json={"inputs": "x", "parameters": {"model": "nope"}}).status_code == 404
    assert client.get("/models/nope").status_code == 404
    assert client.get("/models/..%2F..%2Fetc").status_code == 404


def test_over_long_prompt_is_refused_or_truncated(client):
    r = client.post("/generate", json={"inputs": "word " * 200})
    assert r.status_code == 422 and "refused" in r.json()["error"]
    ok = client.post("/generate", json={"inputs": "word " * 200, "parameters": {"truncate": 20, "max_new_tokens": 2}})
    assert ok.status_code == 200


def test_malformed_json_and_oversized_body(client, store):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "malformed JSON" in r.json()["error"]
    with TestClient(create_app(Settings(store=store, max_body_bytes=100))) as small:
        r = small.post("/generate", json={"inputs": "x" * 500})
        assert r.status_code == 413


def test_metrics(client):
    client.post("/generate", json={"inputs": "The", "parameters": {"max_new_tokens": 2}})
    client.post("/generate", json={"inputs": "The", "parameters": {"max_new_tokens": 0}})
    text = client.get("/metrics").text
    assert 'tinyserve_requests_total{path="/generate",status="200"}' in text
    assert 'tinyserve_requests_total{path="/generate",status="422"}' in text
    assert 'tinyserve_request_seconds_count{path="/generate"}' in text
    assert "tinyserve_tokens_generated_total" in text and "tinyserve_queue_size" in text


def test_refusals_by_outer_middleware_are_counted(store):
    with TestClient(create_app(Settings(store=store, api_token="s3cret", max_body_bytes=100))) as c:
        assert c.get("/models").status_code == 401
        assert c.post("/generate", content=b"x" * 500).status_code == 413
        text = c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
    assert 'status="401"' in text and 'status="413"' in text


def test_stream_latency_is_observed_at_its_last_event(monkeypatch):
    """A stream's latency ends with its last body chunk, not when its headers are sent."""
    clock = [0.0]
    monkeypatch.setattr(middleware.time, "perf_counter", lambda: clock[0])

    async def streaming_app(scope, receive, send):
        scope["route"] = SimpleNamespace(path="/s")  # what the router sets
        await send({"type": "http.response.start", "status": 200, "headers": []})
        clock[0] = 1.0
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        clock[0] = 3.0
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def failing_app(scope, receive, send):
        raise RuntimeError("boom")

    async def ignore(message):
        pass

    metrics = Metrics(dict)
    scope = {"type": "http", "path": "/s", "method": "GET", "headers": []}
    asyncio.run(middleware.RequestMetrics(streaming_app, metrics)(dict(scope), None, ignore))
    with pytest.raises(RuntimeError):
        asyncio.run(middleware.RequestMetrics(failing_app, metrics)(dict(scope), None, ignore))
    get = metrics.registry.get_sample_value
    assert get("tinyserve_request_seconds_sum", {"path": "/s"}) == 3.0
    assert get("tinyserve_requests_total", {"path": "/s", "status": "200"}) == 1
    assert get("tinyserve_requests_total", {"path": "unmatched", "status": "500"}) == 1


def test_bearer_auth(store):
    with TestClient(create_app(Settings(store=store, api_token="s3cret"))) as c:
        assert c.get("/health").status_code == 200  # exempt
        assert c.get("/models").status_code == 401
        assert c.get("/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_full_queue_answers_429_with_retry_after(store):
    """A batch of one running and a queue of one waiting: the next requests get 429, the two admitted finish. The
    compute thread is held between two steps while they arrive (six sent at once, the queue's one could be the
    first request itself, and a tiny model's 40 tokens can end before the others are sent)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    settings = Settings(store=store, max_batch_size=1, max_queue=1, max_new_tokens_cap=40)
    app = create_app(settings)
    with TestClient(app) as c:
        registry = app.state.registry
        engine, held = registry.get("tiny-gpt").engine, threading.Event()
        req = {"inputs": "The castle", "parameters": {"max_new_tokens": 40, "eos_bias": -1e9}}
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(c.post, "/generate", json=req)
            while engine.stats.running == 0 and not first.done():
                time.sleep(0.001)
            registry.compute.submit(held.wait)  # before its next step, or idle once it has ended
            rest = [pool.submit(c.post, "/generate", json=req) for _ in range(5)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in rest) < 4 and time.monotonic() < deadline:  # the refused answer at once
                time.sleep(0.01)
            held.set()
            responses = [first.result(), *(f.result() for f in rest)]
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and busy.json()["error_type"] == "overloaded"


def test_openai_client_completions(client):
    from openai import OpenAI

    oai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    c = oai.completions.create(
        model="tiny-gpt", prompt="The castle", max_tokens=6, temperature=0, logprobs=2, extra_body={"eos_bias": -1e9}
    )
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 6
    assert len(c.choices[0].logprobs.token_logprobs) == 6 and len(c.choices[0].logprobs.top_logprobs[0]) == 2
    chunks = list(
        oai.completions.create(
            model="tiny-gpt",
            prompt="The castle",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"eos_bias": -1e9},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == c.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_client_lists_and_retrieves_completion_models(client):
    from openai import NotFoundError, OpenAI

    oai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    listed = oai.models.list().data
    gpts = [m["id"] for m in client.get("/models").json()["data"] if m["kind"] == "causal"]
    assert [m.id for m in listed] == gpts and all(m.object == "model" and m.created > 0 for m in listed)
    assert oai.models.retrieve("tiny-gpt").id == "tiny-gpt"
    with pytest.raises(NotFoundError):
        oai.models.retrieve("tiny-mlm-softmax0")  # not a completion model


def test_openai_client_prompt_lists_and_n_samples(client):
    from openai import BadRequestError, OpenAI, UnprocessableEntityError

    oai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    args = dict(model="tiny-gpt", max_tokens=5, temperature=1.0, seed=3, extra_body={"eos_bias": -1e9})
    c = oai.completions.create(prompt=["The castle", "A river"], n=2, **args)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3] and c.usage.completion_tokens == 20
    alone = oai.completions.create(prompt="A river", n=1, **{**args, "seed": 4})  # prompt 1, sample 1: seed + 1
    assert c.choices[3].text == alone.choices[0].text
    streamed: dict[int, str] = {}
    for ch in oai.completions.create(prompt=["The castle", "A river"], n=2, stream=True, **args):
        streamed[ch.choices[0].index] = streamed.get(ch.choices[0].index, "") + ch.choices[0].text
    assert streamed == {ch.index: ch.text for ch in c.choices}
    echoed = oai.completions.create(prompt="The castle", echo=True, **args)
    assert echoed.choices[0].text.startswith("The castle")
    for bad in ({"best_of": 2}, {"n": 17}):
        with pytest.raises((BadRequestError, UnprocessableEntityError)) as e:
            oai.completions.create(prompt="x", **{**args, **bad})
        assert error_of(e.value.response)["field"] == next(iter(bad))  # the refusal names the field


def test_openai_validation(client):
    r = client.post("/v1/completions", json={"model": "tiny-gpt", "prompt": "x", "temperature": 3})
    assert r.status_code == 400 and error_of(r)["field"] == "temperature"  # OpenAI's status
    assert r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape under /v1
    r = client.post("/v1/completions", json={"model": "missing", "prompt": "x"})
    assert r.status_code == 404 and error_of(r)["field"] == "model"


def test_score(client):
    r = client.post("/score", json={"text": "The castle was built in 1350 .", "top_n_tokens": 2})
    body = r.json()
    assert r.status_code == 200 and body["scored_tokens"] == len(body["tokens"])
    lps = [t["logprob"] for t in body["tokens"]]
    assert all(lp <= 0 for lp in lps)
    assert abs(body["loss"] + sum(lps) / len(lps)) < 1e-4
    assert client.post("/score", json={"model": "tiny-mlm-softmax0", "text": "x"}).status_code == 404


def test_leaving_a_stream_cancels_generation(client):
    """The SSE layer's event iterator cancels its request when closed early (client disconnect)."""
    from models.sampling import SamplingParams
    from server.features.completion import CompletionJob, events

    app = client.app
    m = app.state.registry.get("tiny-gpt")
    before = m.engine.stats.finished["cancelled"]

    async def read_two_then_leave():
        job = CompletionJob(m, [5, 6, 7], SamplingParams(max_new_tokens=40, eos_bias=float("-inf")))
        stream = events(job, app.state.settings)
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()  # what Starlette does when the client goes away
        return got

    assert len(asyncio.run(read_two_then_leave())) == 2
    deadline = time.monotonic() + 5
    while m.engine.stats.finished["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.engine.stats.finished["cancelled"] == before + 1


def test_tgi_sampling_rule_and_the_seed_it_reports(client):
    """TGI samples when do_sample or a warper (temperature != 1, top_k, top_p) is set, and reports the
    seed it used: drawn when the request gave none, null when greedy."""

    def details(**parameters):
        body = {"inputs": "The river", "parameters": {"max_new_tokens": 12, "eos_bias": -1e9, "details": True}}
        body["parameters"] |= parameters
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["generated_text"], r.json()["details"].get("seed")  # null fields are left out

    greedy, seed = details()
    assert seed is None and details(temperature=1.0) == (greedy, None)  # temperature 1 is no warper
    assert details(temperature=0.7, seed=5) == details(do_sample=True, temperature=0.7, seed=5)
    assert details(top_k=3, seed=5)[1] == 5
    texts, seeds = zip(*(details(temperature=1.5) for _ in range(4)), strict=True)
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 4  # drawn per request
    assert len(set(texts)) > 1  # sampled, not greedy
    assert details(temperature=1.5, seed=seeds[0]) == (texts[0], seeds[0])  # the reported seed reproduces it
