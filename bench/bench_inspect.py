"""Looking inside a model over HTTP: each /inspect route's time on a 64-token text, and what a streaming
completion sees while the costliest one (patching) runs beside it.

    .venv/bin/python bench/bench_inspect.py [--model gpt-wikitext2] [--rounds 5]

The server runs in its own process (`python -m server`, the model's compiled steps built first). For
each route: the median wall time of `--rounds` requests. Then a 64-token greedy stream alone and with a
patching request sent when it starts: its tokens/s and its longest gap between two tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import STORE_ROOT  # noqa: E402
from scripts.processes import http_server, wait_compiled  # noqa: E402

# 64 tokens of the shipped GPT's tokenizer; clean and corrupt differ in one word
CLEAN = (
    "The history of the city begins in the early Middle Ages , when a small settlement grew around the "
    "castle on the river . In 1850 the town was connected to the railway , and its population grew quickly "
    "as workers came from the valley to the new mills , and the old castle was left to the birds"
)
CORRUPT = CLEAN.replace("the castle on", "the church on")


def timed(client: httpx.Client, url: str, body: dict) -> float:
    t = time.perf_counter()
    r = client.post(url, json=body, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t


def stream(client: httpx.Client, url: str) -> tuple[float, float]:
    """tokens/s of a 64-token greedy stream, and its longest gap between two tokens (s)."""
    body = {"inputs": "The castle", "parameters": {"max_new_tokens": 64, "min_new_tokens": 64}}
    stamps = []
    t = time.perf_counter()
    with client.stream("POST", url + "/generate_stream", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return 64 / (stamps[-1] - t), max(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-wikitext2")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with http_server(STORE_ROOT, models=json.dumps([args.model]), compile_max_batch="1") as (url, _):
        wait_compiled(url)
        routes = {
            "logit-lens": {"model": args.model, "text": CLEAN},
            "ablate (2 heads)": {"model": args.model, "text": CLEAN, "heads": [[0, 1], [2, 3]]},
            "ablate each": {"model": args.model, "text": CLEAN, "heads": "each"},
            "patch": {"model": args.model, "clean": CLEAN, "corrupt": CORRUPT, "answer": " was", "foil": " is"},
        }
        with httpx.Client() as client:
            tokens = client.post(url + "/inspect/logit-lens", json=routes["logit-lens"]).json()["tokens"]
            print(f"{args.model}: a {len(tokens)}-token text")
            for name, body in routes.items():
                path = "/inspect/" + name.split(" ")[0]
                timed(client, url + path, body)  # warm
                times = [timed(client, url + path, body) for _ in range(args.rounds)]
                print(f"{name:18s} median {1000 * statistics.median(times):7.1f} ms  (min {1000 * min(times):.1f})")
            alone = [stream(client, url) for _ in range(args.rounds)]
            beside = []
            for _ in range(args.rounds):
                worker = threading.Thread(target=timed, args=(httpx.Client(), url + "/inspect/patch", routes["patch"]))
                worker.start()
                beside.append(stream(client, url))
                worker.join()
        for label, runs in (("stream alone", alone), ("stream beside patch", beside)):
            rate = statistics.median(r[0] for r in runs)
            gap = statistics.median(r[1] for r in runs)
            print(f"{label:20s} {rate:7.1f} tok/s, longest gap between tokens {1000 * gap:.1f} ms (median of runs)")


if __name__ == "__main__":
    main()
