"""Predictions at once through Cog's server (coglet) running predict.py: 8 sent together against the same 8 one
after another, on the shipped GPT.

    .venv/bin/python bench/bench_cog_concurrency.py [--predictions 8] [--tokens 64] [--rounds 3]

coglet runs in its own process over the shipped store, as `cog run` runs it (scripts/cog_predict.py, its
COG_MAX_CONCURRENCY from the runner's @concurrent); each prediction is greedy, exactly --tokens tokens; per round
the wall time of the 8 sequential and of the 8 together, medians and their ratio (the issue's bar: <= 0.4x).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import STORE_ROOT  # noqa: E402
from scripts.cog_predict import free_port, start_server, wait_ready  # noqa: E402

PROMPTS = ["The castle", "The river", "In 1920 the", "A small", "The king", "Music", "The old", "Her first"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.predictions)]
    port = free_port()
    proc = start_server(port, {"TINYSERVE_STORE": str(STORE_ROOT)})
    base = f"http://127.0.0.1:{port}"

    def predict(prompt: str) -> str:
        body = {"input": {"prompt": prompt, "max_new_tokens": args.tokens, "temperature": 0, "eos_bias": -1e9}}
        r = httpx.post(f"{base}/predictions", json=body, timeout=600).json()
        assert r["status"] == "succeeded", r
        return "".join(r["output"])

    try:
        wait_ready(base, proc, timeout_s=600)
        predict("Warm up")
        sequential, together = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            alone = [predict(p) for p in prompts]
            sequential.append(time.perf_counter() - t)
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                at_once = list(pool.map(predict, prompts))
            together.append(time.perf_counter() - t)
            assert at_once == alone  # greedy: each its own text
        s, c = statistics.median(sequential), statistics.median(together)
        print(f"{args.predictions} predictions of {args.tokens} tokens: one after another {s:.2f} s, together "
              f"{c:.2f} s: {c / s:.2f}x")  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
