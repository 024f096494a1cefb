"""Faults against the real server process (`python -m server` on 127.0.0.1): broken checkpoints at
start-up, a client that leaves mid-stream, a request over its time limit, SIGTERM with work in flight."""

import json
import signal
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from model_store.store import write_checkpoint, write_manifest
from models.tokenizer import eos_id
from scripts.processes import http_server, server_output
from tests.conftest import tiny_gpt

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 1000, "eos_bias": -1e9}  # never stops early: ~1,000 decode steps


@pytest.fixture(scope="module")
def faulty_store(tmp_path_factory, tiny_tokenizer):
    """One good model with a long context, and one checkpoint per kind of fault."""
    root = tmp_path_factory.mktemp("faulty-store")
    vocab, eos = tiny_tokenizer.get_vocab_size(), eos_id(tiny_tokenizer)
    good = tiny_gpt(vocab_size=vocab, eos_token_id=eos, context_length=1024)
    for name in ["good", "bad-sha256", "truncated", "wrong-shapes", "no-tokenizer", "pickle"]:
        write_checkpoint(root / name, good, tiny_tokenizer, card=f"# {name}\n", metrics={})

    data = bytearray((root / "bad-sha256" / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF  # still a readable safetensors file: only the hash can tell
    (root / "bad-sha256" / "model.safetensors").write_bytes(bytes(data))
    path = root / "truncated" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    cfg = json.loads((root / "wrong-shapes" / "config.json").read_text())
    (root / "wrong-shapes" / "config.json").write_text(json.dumps({**cfg, "d_ff": cfg["d_ff"] * 2}))
    write_manifest(root / "wrong-shapes")  # a consistent manifest: the mismatch is in the content
    (root / "no-tokenizer" / "tokenizer.json").unlink()
    torch.save({"x": torch.zeros(1)}, root / "pickle" / "pytorch_model.bin")
    return root


EXPECTED_FAILURES = {
    "bad-sha256": "model.safetensors: sha256 does not match",
    "truncated": "model.safetensors: size",
    "wrong-shapes": "has shape",
    "no-tokenizer": "tokenizer.json: missing",
    "pickle": "pytorch_model.bin: pickle-format",
}


@pytest.fixture(scope="module")
def server(faulty_store):
    with http_server(faulty_store, max_new_tokens_cap="1000", request_timeout_s="30") as (base, proc):
        yield base, proc


def engine_metrics(base: str) -> dict[tuple[str, str], float]:
    """{(sample name, reason or ''): value} for the good model's engine figures."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("reason", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tinyserve_") and s.labels.get("model") == "good"
    }


def test_broken_checkpoints_are_refused_naming_the_file_and_the_rest_serve(server, faulty_store):
    base, _ = server
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["status"] == "ok" and health["models"] == ["good"]
    assert set(health["failed"]) == set(EXPECTED_FAILURES)
    for model_id, message in EXPECTED_FAILURES.items():
        assert message in health["failed"][model_id], (model_id, health["failed"][model_id])
        assert str(faulty_store) not in health["failed"][model_id]  # public: no machine paths
    listed = httpx.get(f"{base}/models", timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["good"] and set(listed["failed"]) == set(EXPECTED_FAILURES)
    for model_id in EXPECTED_FAILURES:  # refused models are unknown to every endpoint
        r = httpx.post(f"{base}/generate", json={"inputs": "The", "parameters": {"model": model_id}}, timeout=10)
        assert r.status_code == 404 and r.json()["field"] == "parameters.model"
    r = httpx.post(f"{base}/generate", json={"inputs": "The", "parameters": {"max_new_tokens": 3}}, timeout=30)
    assert r.status_code == 200


def test_client_leaving_mid_stream_stops_generation_and_frees_the_slot(server):
    base, _ = server
    before = engine_metrics(base)
    body = {"inputs": "The castle", "parameters": LONG}
    with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=30) as s:
        received = 0
        for line in s.iter_lines():
            received += line.startswith("data:")
            if received == 3:
                break  # leaving the block closes the connection
    cancelled = ("tinyserve_generations_total", "cancelled")
    freed = {cancelled: before.get(cancelled, 0) + 1, ("tinyserve_batch_size", ""): 0, ("tinyserve_queue_size", ""): 0}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = engine_metrics(base)
        if all(after.get(k) == v for k, v in freed.items()):
            break
        time.sleep(0.05)
    assert {k: after.get(k) for k in freed} == freed
    generated = after[("tinyserve_tokens_generated_total", "")] - before[("tinyserve_tokens_generated_total", "")]
    assert generated < 100, generated  # stopped soon after the disconnect, not after 1,000 tokens


def test_request_over_its_time_limit_fails_clearly_and_the_batch_goes_on(faulty_store):
    with http_server(faulty_store, max_new_tokens_cap="1000", request_timeout_s="0.3") as (base, _):
        results = {}

        def run(name, params):
            results[name] = httpx.post(f"{base}/generate", json={"inputs": "The", "parameters": params}, timeout=30)

        threads = [
            threading.Thread(target=run, args=("long", LONG)),
            threading.Thread(target=run, args=("short", {"max_new_tokens": 5, "eos_bias": -1e9, "details": True})),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        long, short = results["long"], results["short"]
        assert long.status_code == 408 and "time limit" in long.json()["error"], long.text
        assert short.status_code == 200 and short.json()["details"]["generated_tokens"] == 5


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(faulty_store):
    with http_server(faulty_store, max_new_tokens_cap="1000", request_timeout_s="60") as (base, proc):
        body = {"inputs": "The castle", "parameters": {**LONG, "details": True}}
        tokens, finish = 0, None
        with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                tokens += 1
                if tokens == 2:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                    time.sleep(0.3)
                    with pytest.raises(httpx.TransportError):  # the listening socket is closed
                        httpx.get(f"{base}/health", timeout=2)
                if event.get("details"):
                    finish = event["details"]["finish_reason"]
        assert (tokens, finish) == (1000, "length")  # the in-flight stream ran to its end
        proc.wait(timeout=90)
        output = server_output(proc)
    assert proc.returncode in (0, -15) and "Application shutdown complete" in output, output[-2000:]
