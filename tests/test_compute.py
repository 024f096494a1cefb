"""One compute thread per process: every served model's forward pass runs on it, and only on it."""

import threading

import pytest
import torch
from fastapi.testclient import TestClient

import server.serving.registry as registry_module
from server.api.app import create_app
from server.config import Settings
from server.execution.compute_thread import ComputeThread, WrongThreadError


def test_jobs_run_on_the_compute_thread_and_errors_reach_the_caller():
    compute = ComputeThread("test-compute")
    compute.start()
    try:
        assert compute.call(threading.get_ident) == compute.ident != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
        assert compute.call(lambda: 2 + 2) == 4  # the thread survived the failed job
    finally:
        compute.stop()


def test_a_guarded_model_refuses_other_threads():
    compute = ComputeThread("test-compute")
    compute.start()
    model = torch.nn.Linear(2, 2)
    compute.guard(model)
    try:
        with pytest.raises(WrongThreadError, match="test-compute"):
            model(torch.zeros(1, 2))
        assert compute.call(model, torch.zeros(1, 2)).shape == (1, 2)
    finally:
        compute.stop()


def test_every_route_computes_on_the_one_compute_thread(store, monkeypatch):
    """Load, warm-up, generation, score, attention and fill-mask: one thread ran every forward pass."""
    threads: set[int] = set()

    def watched(load):
        def load_and_watch(*args, **kwargs):
            loaded = load(*args, **kwargs)
            model = loaded[0] if isinstance(loaded, tuple) else loaded.model  # (model, tokenizer) or a runner
            model.register_forward_pre_hook(lambda module, inputs: threads.add(threading.get_ident()))
            threads.add(threading.get_ident())  # loading ran here
            return loaded

        return load_and_watch

    monkeypatch.setattr(registry_module, "load_runner", watched(registry_module.load_runner))
    monkeypatch.setattr(registry_module, "load_mlm", watched(registry_module.load_mlm))
    app = create_app(Settings(store=store, models=["tiny-gpt", "tiny-mlm-softmax0", "tiny-mlm-softmax1"]))
    registry = app.state.registry
    with TestClient(app) as client:
        text = "The castle was built"
        assert client.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 4}}).status_code == 200
        assert client.post("/score", json={"text": text}).status_code == 200
        assert client.post("/attention", json={"text": text, "model": "tiny-gpt"}).status_code == 200
        assert client.post("/attention", json={"text": text, "model": "tiny-mlm-softmax0"}).status_code == 200
        assert (
            client.post("/fill-mask", json={"inputs": "The castle <mask> built", "variant": "both"}).status_code == 200
        )
        assert threads == {registry.compute.ident}


def test_every_route_serves_in_bfloat16(store):
    """The dtype `auto` picks on CPUs with native bf16: every route still answers."""
    with TestClient(create_app(Settings(store=store, dtype="bfloat16"))) as client:
        text = "The castle was built"
        r = client.post(
            "/generate", json={"inputs": text, "parameters": {"max_new_tokens": 4, "eos_bias": -1e9, "details": True}}
        )
        assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 4
        assert client.post("/score", json={"text": text}).status_code == 200
        assert client.post("/attention", json={"text": text, "model": "tiny-mlm-softmax1"}).status_code == 200
        filled = client.post("/fill-mask", json={"inputs": "The castle <mask> built", "variant": "both"})
        assert filled.status_code == 200 and len(filled.json()["results"]) == 2
