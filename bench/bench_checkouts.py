"""Two checkouts of this repository against each other at one stream over HTTP: is a change slower?

    .venv/bin/python bench/bench_checkouts.py --old <checkout> [--new .] [--rounds 30] [--stream]

Each checkout serves gpt-wikitext2 with `python -m server` in its own process (its one-row step compiled
before timing; each with its own .venv, or this one's); rounds alternate which side goes first; a round
is 5 sequential greedy requests of 64 tokens (`/generate`, or `/generate_stream` read to its end). Gives
each side's median tok/s and the median of the per-round ratios new / old.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from scripts.processes import wait_compiled, wait_healthy  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"
BODY = {"inputs": PROMPT, "parameters": {"max_new_tokens": 64, "min_new_tokens": 64, "details": True}}
PER_ROUND = 5


def serve(checkout: Path, port: int) -> subprocess.Popen:
    python = checkout / ".venv" / "bin" / "python"
    env = {**os.environ, "TINYSERVE_MODELS": '["gpt-wikitext2"]', "TINYSERVE_COMPILE_MAX_BATCH": "1"}
    return subprocess.Popen(
        [str(python if python.exists() else sys.executable), "-m", "server", "--port", str(port)],
        cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def one_round(client: httpx.Client, url: str, stream: bool) -> float:
    """tok/s over PER_ROUND sequential requests."""
    t = time.perf_counter()
    for _ in range(PER_ROUND):
        if stream:
            with client.stream("POST", url + "/generate_stream", json=BODY) as response:
                for _ in response.iter_lines():
                    pass
        else:
            assert client.post(url + "/generate", json=BODY).json()["details"]["generated_tokens"] == 64
    return PER_ROUND * 64 / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--new", type=Path, default=HERE)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--stream", action="store_true", help="time /generate_stream instead of /generate")
    args = ap.parse_args()
    sides = {"new": (args.new, 8101), "old": (args.old, 8102)}
    procs = {name: serve(path.resolve(), port) for name, (path, port) in sides.items()}
    try:
        for name, (_, port) in sides.items():
            wait_healthy(f"http://127.0.0.1:{port}", procs[name], 600, lambda: "")
            wait_compiled(f"http://127.0.0.1:{port}")
        rates: dict[str, list[float]] = {name: [] for name in sides}
        with httpx.Client(timeout=60) as client:
            for r in range(args.rounds + 2):  # two warm-up rounds
                for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                    rate = one_round(client, f"http://127.0.0.1:{sides[name][1]}", args.stream)
                    if r >= 2:
                        rates[name].append(rate)
                    time.sleep(0.2)
        ratio = statistics.median(n / o for n, o in zip(rates["new"], rates["old"], strict=True))
        route = "/generate_stream" if args.stream else "/generate"
        medians = ", ".join(f"{name} {statistics.median(v):.1f} tok/s" for name, v in rates.items())
        print(f"{route}, {args.rounds} rounds: {medians}; new / old {ratio:.3f}")
    finally:
        for proc in procs.values():
            proc.terminate()


if __name__ == "__main__":
    main()
