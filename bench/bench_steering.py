"""What steering costs: time per token of 8 streams of which half are steered against 8 plain ones, over HTTP.

    .venv/bin/python bench/bench_steering.py [--shape smollm2-135m] [--streams 8] [--rounds 5] [--values]

A random checkpoint at the shape (bench/bench_families.py; `--shape gpt-wikitext2` serves the shipped GPT instead)
is served in its own process, its compiled steps built first. Each request is greedy, 64 tokens exactly; in the
mixed kind every other request carries a `steer`: a vector from a contrasting pair (POST /inspect/steering-vector)
after every block but the first, named (or, with --values, its values sent: 300 KB of JSON a request at the
SmolLM2 shape). Rounds alternate the
kinds; the median per-round time per token and the ratio mixed / plain. That 8 plain streams are as fast as before
the change is bench/bench_checkouts.py's comparison of two checkouts.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import tempfile
import threading
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_families import make_checkpoint  # noqa: E402
from bench.bench_structured import compared  # noqa: E402
from model_store.ingest import add_checkpoint  # noqa: E402
from scripts.processes import http_server, wait_compiled  # noqa: E402


def request(url: str, model: str, steers: itertools.cycle, lock: threading.Lock) -> int:
    with lock:
        steer = next(steers)
    parameters = {"model": model, "max_new_tokens": 64, "eos_bias": -1e9, "details": True}
    if steer is not None:
        parameters["steer"] = steer
    r = httpx.post(url + "/generate", json={"inputs": "The history of the city begins", "parameters": parameters},
                   timeout=300)  # fmt: skip
    r.raise_for_status()
    assert r.json()["details"]["generated_tokens"] == 64, r.json()
    return 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--streams", default="8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--values", dest="by_name", action="store_false", help="send the vectors' values, not their name")
    args = ap.parse_args()
    streams_list = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as work:
        if args.shape == "gpt-wikitext2":
            store, model = REPO / "model_store", "gpt-wikitext2"
        else:
            source, store, model = Path(work) / "source", Path(work) / "store", "steer-model"
            make_checkpoint(args.shape, source)
            add_checkpoint(source, model, store)
        batch = str(max(streams_list))
        with http_server(store, models=f'["{model}"]', compile_max_batch=batch, max_batch_size=batch) as (url, _):
            wait_compiled(url)  # time the compiled steps, not eager ones
            pairs = [{"positive": "I love this, it is wonderful", "negative": "I hate this, it is awful"}]
            made = httpx.post(f"{url}/inspect/steering-vector", json={"model": model, "pairs": pairs, "name": "bench"})
            made.raise_for_status()  # a direction after every block but the first, kept by name
            steer = (
                [{"name": "bench", "scale": 1.0}]
                if args.by_name
                else [{"layer": int(n), "vector": v} for n, v in made.json()["layers"].items()]
            )
            for streams in streams_list:
                sends = {
                    kind: functools.partial(request, url, model, itertools.cycle(pattern), threading.Lock())
                    for kind, pattern in {"plain": [None], "half steered": [steer, None]}.items()
                }
                row = compared(sends, streams, args.rounds)
                print(f"{args.shape}, {streams} streams, per token: {row}", flush=True)


if __name__ == "__main__":
    main()
