"""Load test over loopback against a real server on the shipped models (bounded in count and time).

    .venv/bin/python bench/load_test.py [--clients 64] [--seconds 60] [--requests 10000]

1. mixed load: N clients for T seconds, each looping over generate / generate_stream / fill-mask /
   attention (whichever the store serves); only 200 and 429 may come back. Reports p50/p99 latency
   per route, requests/s and generated tokens/s.
2. memory: server RSS sampled while at least `--requests` requests are served; it must stay flat
   (last tenth vs first tenth of the samples).
3. overload: a burst far over the queue size gets 429s with Retry-After quickly while the accepted
   requests still finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import STORE_ROOT  # noqa: E402
from scripts.processes import http_server  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def requests_for(models: list[dict]) -> list[tuple[str, str, dict]]:
    gpt = next(m["id"] for m in models if m["kind"] == "causal")
    mix = [
        (
            "generate",
            "/generate",
            {"inputs": "The history of", "parameters": {"model": gpt, "max_new_tokens": 16, "details": True}},
        ),  # noqa: E501
        ("stream", "/generate_stream", {"inputs": "In 1990 ,", "parameters": {"model": gpt, "max_new_tokens": 16}}),
        ("attention", "/attention", {"model": gpt, "text": "The castle was built in the 14th century ."}),
    ]
    mlm = next((m["id"] for m in models if m["kind"] == "mlm"), None)
    if mlm is not None:
        mix.append(("fill-mask", "/fill-mask", {"inputs": "Mi <mask> vin.", "variant": "both"}))
        mix.append(("attention-mlm", "/attention", {"model": mlm, "text": "La suno brilas super la urbo."}))
    return mix


async def one(client: httpx.AsyncClient, route: str, path: str, body: dict) -> tuple[int, int]:
    """(status, tokens generated)."""
    if route == "stream":
        async with client.stream("POST", path, json=body) as r:
            tokens = 0
            async for line in r.aiter_lines():
                tokens += line.startswith("data:")
            return r.status_code, tokens
    r = await client.post(path, json=body)
    details = r.json().get("details") if route == "generate" and r.status_code == 200 else None
    return r.status_code, details["generated_tokens"] if details else 0


async def mixed_load(base: str, pid: int, clients: int, seconds: float, min_requests: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=clients)) as c:
        mix = requests_for((await c.get("/models")).json()["data"])
        latencies, statuses, tokens = defaultdict(list), Counter(), 0
        rss: list[float] = []
        start = time.monotonic()
        done = 0

        async def client_loop(i: int) -> None:
            nonlocal tokens, done
            rng = random.Random(i)
            while time.monotonic() - start < seconds or done < min_requests:
                route, path, body = rng.choice(mix)
                t = time.perf_counter()
                status, n = await one(c, route, path, body)
                latencies[route].append(time.perf_counter() - t)
                statuses[status] += 1
                tokens += n
                done += 1
                if status == 429:
                    await asyncio.sleep(0.05)

        async def sample_rss() -> None:
            while True:
                rss.append(rss_mb(pid))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*(client_loop(i) for i in range(clients)))
        sampler.cancel()
        wall = time.monotonic() - start
    tenth = max(1, len(rss) // 10)
    return {
        "clients": clients,
        "seconds": round(wall, 1),
        "requests": done,
        "statuses": dict(statuses),
        "requests_per_s": round(done / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "latency_ms": {
            route: {
                "n": len(v),
                "p50": round(1000 * statistics.median(v), 1),
                "p99": round(1000 * statistics.quantiles(v, n=100)[98], 1) if len(v) >= 2 else None,
            }
            for route, v in sorted(latencies.items())
        },
        "rss_mb": {
            "first_tenth": round(statistics.mean(rss[:tenth]), 1),
            "last_tenth": round(statistics.mean(rss[-tenth:]), 1),
            "max": round(max(rss), 1),
        },
    }


async def overload(base: str, burst: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=burst)) as c:
        gpt = next(m["id"] for m in (await c.get("/models")).json()["data"] if m["kind"] == "causal")
        body = {"inputs": "The", "parameters": {"model": gpt, "max_new_tokens": 64, "eos_bias": -1e9}}

        async def timed() -> tuple[int, float, str | None, int]:
            t = time.perf_counter()
            r = await c.post("/generate", json={**body, "parameters": {**body["parameters"], "details": True}})
            n = r.json()["details"]["generated_tokens"] if r.status_code == 200 else 0
            return r.status_code, time.perf_counter() - t, r.headers.get("retry-after"), n

        results = await asyncio.gather(*(timed() for _ in range(burst)))
    refused = [r for r in results if r[0] == 429]
    accepted = [r for r in results if r[0] == 200]
    return {
        "burst": burst,
        "statuses": dict(Counter(r[0] for r in results)),
        "429_p50_ms": round(1000 * statistics.median(r[1] for r in refused), 1) if refused else None,
        "429_with_retry_after": sum(r[2] is not None for r in refused),
        "accepted_finished_all_tokens": sum(r[3] == 64 for r in accepted),
        "accepted": len(accepted),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=STORE_ROOT)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--requests", type=int, default=10_000, help="keep going until this many requests were served")
    p.add_argument("--burst", type=int, default=200, help="simultaneous requests in the overload phase")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    with http_server(args.store, max_queue="64", max_batch_size="32") as (base, proc):
        report = {
            "mixed": asyncio.run(mixed_load(base, proc.pid, args.clients, args.seconds, args.requests)),
            "overload": asyncio.run(overload(base, args.burst)),
            "healthy_after": httpx.get(f"{base}/health", timeout=10).status_code == 200,
        }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    bad = set(report["mixed"]["statuses"]) - {200, 429}
    sys.exit(1 if bad or not report["healthy_after"] else 0)


if __name__ == "__main__":
    main()
