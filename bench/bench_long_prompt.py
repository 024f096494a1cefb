"""Issue 64's capacity check: with default settings, a 2,000-token prompt served while 7 short requests decode, then 32
short requests at once, all from one KV pool of the default budget.

    .venv/bin/python bench/bench_long_prompt.py --store DIR --model qwen3-0.6b [--long 2000] [--new-tokens 64]

Our server runs in its own process with the default settings, timed once every compiled step is built
(TINYSERVE_COMPILE_MODELS=false in front skips them). Prints each phase's status codes, wall time,
the pool (/info's kv_pool) and the KV bytes the model holds (kv_cache_bytes), against kv_cache_mb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_families import wait_ready  # noqa: E402


async def generate(client: httpx.AsyncClient, model: str, ids: list[int], new_tokens: int) -> int:
    body = {"model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "min_new_tokens": new_tokens}
    r = await client.post("/v1/completions", json=body, timeout=1800)
    return r.status_code


async def phase(url: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url) as client:
        t = time.perf_counter()
        codes = await asyncio.gather(*(generate(client, model, p, new_tokens) for p in prompts))
        seconds = time.perf_counter() - t
        info = (await client.get("/info")).json()
    return {
        "requests": len(prompts),
        "prompt_tokens": [len(p) for p in prompts][:8],
        "status": sorted(set(codes)),
        "seconds": round(seconds, 1),
        "kv_pool": info["kv_pool"].get(model),
        "kv_cache_mb": round(info["kv_cache_bytes"][model] / 2**20),
        "kv_budget_mb": info.get("kv_cache_mb"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--long", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    env = {**os.environ, "TINYSERVE_STORE": str(args.store), "TINYSERVE_MODELS": json.dumps([args.model])}
    server = subprocess.Popen([sys.executable, "-m", "server", "--port", "8941"], cwd=REPO, env=env)
    url = "http://127.0.0.1:8941"
    try:
        wait_ready(url, server, True)  # /health 200 and every compiled step built (none with compiling off)
        short = [[(97 * i + 31 * j) % 15000 + 3 for j in range(20)] for i in range(32)]
        long = [(13 * j) % 15000 + 3 for j in range(args.long)]
        print(json.dumps({"phase": "long beside 7", **asyncio.run(phase(url, args.model, [long, *short[:7]], 64))}))
        print(json.dumps({"phase": "32 at once", **asyncio.run(phase(url, args.model, short, args.new_tokens))}))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
