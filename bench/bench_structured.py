"""What a constraint costs: time per token of constrained requests against unconstrained ones, over HTTP.

    .venv/bin/python bench/bench_structured.py [--model gpt-wikitext2] [--streams 1,8] [--rounds 7]

The server runs in its own process (`python -m server`, its compiled steps built first). Each request
is greedy, 64 tokens exactly (the end of text is never chosen), `/generate` with `details`: free, or
constrained by a regex or a JSON schema that can go on for 64 tokens. Rounds alternate the kinds; for
each stream count, the median per-round time per token and the ratio constrained / free.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import STORE_ROOT  # noqa: E402
from scripts.processes import http_server, wait_compiled  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"
KINDS = {
    "free": None,
    "regex": {"type": "regex", "value": "[a-z ,.]+"},
    "json": {"type": "json", "value": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
}


def request(url: str, grammar: dict | None) -> int:
    parameters = {"max_new_tokens": 64, "eos_bias": -1e9, "details": True}
    if grammar is not None:
        parameters["grammar"] = grammar
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    r.raise_for_status()
    assert r.json()["details"]["generated_tokens"] == 64, r.json()["details"]  # per token over the same work
    return 64


def ms_per_token(send: Callable[[], int], streams: int) -> float:
    """Wall time of `streams` concurrent requests (`send` makes one, returning its tokens) over the tokens they made
    (ms per token per stream)."""
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        tokens = list(pool.map(lambda _: send(), range(streams)))
    return 1000 * (time.perf_counter() - t) / (sum(tokens) / streams)


def compared(kinds: dict[str, Callable[[], int]], streams: int, rounds: int) -> str:
    """Each kind's median ms per token over `rounds` (after one warm-up round, the kinds' order alternating each
    round) and its ratio to the first kind's."""
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(rounds + 1):
        for kind, send in kinds.items() if r % 2 else reversed(kinds.items()):
            ms = ms_per_token(send, streams)
            if r:
                times[kind].append(ms)
    base = statistics.median(next(iter(times.values())))
    return ", ".join(f"{kind} {statistics.median(v):.2f} ms ({statistics.median(v) / base:.2f}x)"
                     for kind, v in times.items())  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-wikitext2")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    streams_list = [int(s) for s in args.streams.split(",")]
    with http_server(STORE_ROOT, models=f'["{args.model}"]', compile_max_batch=str(max(streams_list))) as (url, _):
        wait_compiled(url)  # time the compiled steps, not eager ones
        for streams in streams_list:
            sends = {kind: functools.partial(request, url, grammar) for kind, grammar in KINDS.items()}
            print(f"{streams} streams, per token: {compared(sends, streams, args.rounds)}")

if __name__ == "__main__":
    main()
