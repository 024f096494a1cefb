"""tinyserve as a Ray Serve application, on a real local Ray instance (loopback, 2 replicas of half a CPU)."""

import asyncio
import time

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray", reason="the [ray] extra is part of the test install (make test)")
from ray import serve  # noqa: E402

from scripts.processes import free_port  # noqa: E402
from server.config import Settings  # noqa: E402
from server.ray_serve import REPLICA_HEADER, RayServeOptions, app_builder, build_app, torch_threads  # noqa: E402
from tests.conftest import REPO  # noqa: E402

pytestmark = pytest.mark.slow

REPLICA = REPLICA_HEADER.decode()


@pytest.fixture(scope="module")
def ray_base(store):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tinyserve-test")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # one request decoding and one queued per replica; Serve holds 2 more, then answers 429
    settings = Settings(store=store, max_new_tokens_cap=64, max_batch_size=1, max_queue=1, shutdown_grace_s=5)
    options = RayServeOptions(min_replicas=2, max_replicas=2, num_cpus=0.5, max_queued_requests=2)
    serve.run(build_app(options, settings), name="tinyserve", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def generate(base: str, tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{base}/generate", json={"inputs": "The", "parameters": {"max_new_tokens": tokens}}, timeout=60)


def test_routes_and_both_wire_formats_work_through_serve(ray_base):
    r = httpx.post(
        f"{ray_base}/generate", json={"inputs": "The castle", "parameters": {"max_new_tokens": 4}}, timeout=60
    )
    assert r.status_code == 200 and isinstance(r.json()["generated_text"], str) and r.headers[REPLICA]
    with httpx.stream(
        "POST", f"{ray_base}/generate_stream", json={"inputs": "The", "parameters": {"max_new_tokens": 4}}, timeout=60
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    assert len(events) >= 2 and '"generated_text"' in events[-1]
    r = httpx.post(
        f"{ray_base}/v1/completions", json={"model": "tiny-gpt", "prompt": "The", "max_tokens": 3}, timeout=60
    )
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(
        f"{ray_base}/v1/completions", json={"model": "tiny-gpt", "prompt": "x", "temperature": 3}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"  # errors pass through unchanged
    assert httpx.get(f"{ray_base}/health", timeout=30).json()["status"] == "ok"


def test_requests_spread_over_replicas(ray_base):
    async def one(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/generate", json={"inputs": "The", "parameters": {"max_new_tokens": 2}})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=ray_base, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))

    seen: set[str] = set()
    for _ in range(5):  # Serve's router picks the less loaded of two replicas: a few bursts reach both
        seen |= {r.headers[REPLICA] for r in asyncio.run(burst()) if r.status_code == 200}
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen


def test_overload_gets_429_with_retry_after(ray_base):
    async def flood() -> list[httpx.Response]:
        body = {"inputs": "The", "parameters": {"max_new_tokens": 64, "eos_bias": -1e9}}
        async with httpx.AsyncClient(base_url=ray_base, timeout=120) as client:
            return await asyncio.gather(*(client.post("/generate", json=body) for _ in range(16)))

    codes = [r.status_code for r in asyncio.run(flood())]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    busy = next(r for r in asyncio.run(flood()) if r.status_code == 429)
    assert busy.headers["retry-after"] == "1"


def test_a_killed_replica_is_replaced_and_new_requests_succeed(ray_base):
    body = {"inputs": "The", "parameters": {"max_new_tokens": 64, "eos_bias": -1e9}}
    with httpx.stream("POST", f"{ray_base}/generate_stream", json=body, timeout=60) as s:
        victim = s.headers[REPLICA]  # the replica's actor name
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # the stream is under way
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        try:
            rest = [line for line in lines if line.startswith("data:")]
            outcome = "finished" if rest and '"generated_text": "' in rest[-1] else f"cut after {len(rest)} events"
        except httpx.HTTPError as e:
            outcome = type(e).__name__
    print(f"in-flight stream when its replica died: {outcome}")
    # the in-flight stream dies with its replica: no final event (docs/SCALING.md says so)
    assert outcome != "finished", outcome
    deadline, seen = time.monotonic() + 120, set()
    while time.monotonic() < deadline and len(seen - {victim}) < 2:  # Serve starts a new replica
        r = generate(ray_base)
        if r.status_code == 200:
            seen.add(r.headers[REPLICA])
        time.sleep(0.5)
    assert len(seen - {victim}) == 2 and victim not in seen, seen
    assert all(generate(ray_base).status_code == 200 for _ in range(4))


def test_replicas_compute_on_their_cpu_share():
    assert [torch_threads(c) for c in (0.25, 1, 1.5, 2, 4)] == [1, 1, 1, 2, 4]


def test_serve_config_file_builds_the_application():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "deploy" / "ray" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema(**config)
    (app,) = schema.applications
    assert app.import_path == "server.ray_serve:app_builder"
    deployment = app_builder(app.args)._bound_deployment
    assert deployment.ray_actor_options["num_cpus"] == app.args["num_cpus"]
    assert deployment._deployment_config.graceful_shutdown_timeout_s == app.args["settings"]["shutdown_grace_s"]
