"""Ray Serve's cost on one machine: the plain server vs the same app behind Serve, then 1 vs 2 replicas.

    .venv/bin/python bench/bench_scaling.py [--clients 16] [--requests 96] [--rounds 3]

Each server runs in its own process (Serve: its own local Ray instance), serving only the shipped
GPT, and is measured once its compiled decode steps are built (every replica's); a closed loop of
`clients` sends /generate requests (`tokens` greedy tokens each, EOS off) until `requests` are done.
The plain server and Serve alternate within each round, so the machine's drift hits both; the table
gives medians over rounds. On 2 cores, replicas cannot add compute: the figure that matters is the
proxy's overhead (docs/SCALING.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.processes import free_port, http_server, wait_compiled  # noqa: E402

MODEL = "gpt-wikitext2"


@contextmanager
def ray_server(replicas: int, num_cpus: float) -> Iterator[str]:
    """`tinyserve serve-ray` with a fixed replica count on a free port; yields its base URL when healthy."""
    port = free_port()
    settings = json.dumps({"models": [MODEL]})
    cmd = [sys.executable, "-m", "server.ray_serve", "--port", str(port), "--min-replicas", str(replicas),
           "--max-replicas", str(replicas), "--num-cpus", str(num_cpus), "--settings", settings]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"serve-ray exited: {log.read().decode()[-2000:]}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200 and replicas_seen(base) >= replicas:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError("serve-ray did not become healthy in 180 s")
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)


def replicas_seen(base: str, probes: int = 16) -> int:
    return len({httpx.get(f"{base}/health", timeout=5).headers.get("x-tinyserve-replica") for _ in range(probes)})


async def closed_loop(base: str, clients: int, requests: int, tokens: int) -> dict:
    """`clients` loops send /generate until `requests` are answered: tokens/s and latency percentiles."""
    body = {"inputs": "The history of the city", "parameters": {"max_new_tokens": tokens, "eos_bias": -1e9}}
    left, latencies, codes = requests, [], []

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            r = await client.post(f"{base}/generate", json=body)
            latencies.append(time.perf_counter() - t)
            codes.append(r.status_code)

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as client:
        await client.post(f"{base}/generate", json=body)  # warm the connection and the model
        t = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(clients)))
        wall = time.perf_counter() - t
    latencies.sort()
    ok = codes.count(200)
    return {
        "tokens_per_s": ok * tokens / wall,
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "errors": len(codes) - ok,
        "error_codes": {code: codes.count(code) for code in set(codes) - {200}},
    }


def measure(name: str, server, args: argparse.Namespace) -> dict:
    with server as base:
        base = base[0] if isinstance(base, tuple) else base
        compiled_s = wait_compiled(base, probes=16)  # 16 answers reach every replica behind Serve
        result = asyncio.run(closed_loop(base, args.clients, args.requests, args.tokens))
        result["compiled_after_s"] = compiled_s
    print(name, json.dumps({k: v if isinstance(v, dict) else round(v, 3) for k, v in result.items()}), file=sys.stderr)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    store = REPO / "model_store"
    cpus = os.cpu_count() or 2
    setups = {
        "plain server (python -m server)": lambda: http_server(store, models=f'["{MODEL}"]'),
        f"Ray Serve, 1 replica x {cpus} CPUs": lambda: ray_server(1, cpus),
        f"Ray Serve, 2 replicas x {cpus / 2:g} CPU": lambda: ray_server(2, cpus / 2),
    }
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, server in setups.items():
            runs[name].append(measure(name, server(), args))
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain server (python -m server)"])
    print(f"\n{args.clients} clients, closed loop, {args.requests} requests x {args.tokens} tokens, "
          f"median of {args.rounds} rounds\n")  # fmt: skip
    print("| setup | tokens/s | vs plain | p50 latency | p99 latency | errors |\n|---|---|---|---|---|---|")
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        p50 = statistics.median(r["p50_s"] for r in rs)
        p99 = statistics.median(r["p99_s"] for r in rs)
        errors = sum(r["errors"] for r in rs)
        print(f"| {name} | {tps:.0f} | {tps / plain:.2f}x | {p50:.2f} s | {p99:.2f} s | {errors} |")


if __name__ == "__main__":
    main()
