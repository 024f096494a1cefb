"""Ready within seconds: /health's 200 waits for the default completion model only, the rest load behind it."""

import shutil
import threading
import time

import pytest
from fastapi.testclient import TestClient

import server.serving.registry as registry_module
from server.api.app import create_app
from server.config import Settings
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.verify_pass import VerifyPass
from server.serving.registry import ModelLoadingError, ModelRegistry

# a server stopped while its loader thread still loads ends that thread quietly (no exception escapes it)
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture
def held(monkeypatch):
    """Holds the loading behind ready until released: what a request sees while the store loads."""
    release = threading.Event()
    start_behind = registry_module.behind_requests

    def held_behind(work, compute, name="background"):
        def held():
            assert release.wait(60)
            work()

        return start_behind(held, compute, name)

    monkeypatch.setattr(registry_module, "behind_requests", held_behind)
    return release


def test_ready_after_the_default_model_and_the_rest_answer_503_until_loaded(store, held):
    settings = Settings(store=store, ready_after="default")
    with TestClient(create_app(settings)) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["models"] == ["tiny-gpt"]
        assert health.json()["loading"] == ["broken-gpt", "tiny-mlm-softmax0", "tiny-mlm-softmax1"]
        body = {"inputs": "The castle", "parameters": {"max_new_tokens": 4}}
        assert client.post("/generate", json=body).status_code == 200  # the default model serves at once

        by_id = client.post("/fill-mask", json={"inputs": "La <mask> estas", "model": "tiny-mlm-softmax1"})
        by_variant = client.post("/fill-mask", json={"inputs": "La <mask> estas", "variant": "softmax0"})
        for response, field in ((by_id, "model"), (by_variant, "variant")):
            assert response.status_code == 503 and response.headers["Retry-After"]
            assert response.json()["field"] == field and "loading" in response.json()["error"]

        held.set()
        assert client.app.state.registry.loaded.wait(60)
        health = client.get("/health").json()
        assert health["loading"] == [] and health["models"] == ["tiny-gpt", "tiny-mlm-softmax0", "tiny-mlm-softmax1"]
        assert "broken-gpt" in health["failed"]  # refused when its turn came, as at start-up
        assert client.post("/fill-mask", json={"inputs": "La <mask> estas", "variant": "softmax0"}).status_code == 200


def test_the_default_of_a_kind_still_loading_is_not_replaced_by_a_later_one(store, tmp_path, held):
    """Requests without a model id get the first model of their kind in store order, loaded or not."""
    ordered = tmp_path / "store"
    for src, dst in [("tiny-mlm-softmax1", "a-mlm"), ("tiny-gpt", "b-gpt"), ("tiny-gpt", "c-gpt")]:
        shutil.copytree(store / src, ordered / dst)
    registry = ModelRegistry(Settings(store=ordered, ready_after="default"))
    registry.load_all()
    try:
        registry.start()
        assert list(registry.models) == ["b-gpt"] and registry.default("causal").id == "b-gpt"
        with pytest.raises(ModelLoadingError):
            registry.default("mlm")
        with pytest.raises(ModelLoadingError):
            registry.get("c-gpt")
        held.set()
        assert registry.loaded.wait(60)
        assert list(registry.models) == ["a-mlm", "b-gpt", "c-gpt"]  # store order, whatever the load order
        assert registry.default("mlm").id == "a-mlm" and registry.default("causal").id == "b-gpt"
    finally:
        held.set()
        registry.stop()


def test_ready_after_all_loads_every_model_before_ready(store):
    registry = ModelRegistry(Settings(store=store, ready_after="all"))
    registry.load_all()
    try:
        assert registry.loading == {} and registry.loaded.is_set()
        assert set(registry.models) == {"tiny-gpt", "tiny-mlm-softmax0", "tiny-mlm-softmax1"}
    finally:
        registry.stop()


def test_ready_after_compiled_waits_for_every_compiled_step(store, monkeypatch):
    """A replica behind a load balancer is not ready while its requests would run uncompiled."""
    release, built = threading.Event(), []

    def build(self, bucket, regional=False):  # stands for the minutes a real compile takes on the CPU
        assert release.wait(60)
        built.append((bucket, regional))
        return self.targets[bucket].traced

    monkeypatch.setattr(BackgroundCompiler, "build", build)
    settings = Settings(store=store, models=["tiny-gpt"], ready_after="compiled", compile_models=True)
    settings.compile_max_batch = 2
    app, health, entered = create_app(settings), [], threading.Event()

    def serve() -> None:
        with TestClient(app) as client:  # entering runs the start-up
            entered.set()
            health.append(client.get("/health"))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert not entered.wait(1.0) and not app.state.ready
        deadline = time.monotonic() + 30  # the model loads, then its compiler starts (slower on a busy machine)
        while app.state.registry.compiling() != ["tiny-gpt"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.registry.compiling() == ["tiny-gpt"] and not entered.is_set() and not app.state.ready
    finally:
        release.set()
        thread.join(60)
    # the one-row step (regional), the prompts' pass (bucket None), the two-row step (regional); then frozen steps,
    # then the draft check (the CPU's plan; CUDA builds the regional steps alone)
    if app.state.registry.get("tiny-gpt").runner.step.device.type == "cpu":
        assert built == [(1, True), (None, True), (2, True), (1, False), (2, False), (VerifyPass.BUCKET, False)]
    else:
        assert built == [(1, True), (2, True)]
    assert health[0].status_code == 200 and health[0].json()["compiling"] == []
