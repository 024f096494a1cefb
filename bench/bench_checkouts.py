"""Two checkouts of this repository against each other over HTTP: is a change slower?

    .venv/bin/python bench/bench_checkouts.py --old <checkout> [--new .] [--rounds 30] [--stream] [--streams 32]
        [--model gpt-wikitext2] [--store DIR]

Each checkout serves the model (gpt-wikitext2 of its own store, or --store's) with `python -m server` in its own
process (its one-row step compiled before timing: its steps of up to `--streams` rows; each with its own .venv, or
this one's); rounds alternate
which side goes first; a round is `--streams` clients at once, each making 5 sequential greedy requests of 64
tokens (`/generate`, or `/generate_stream` read to its end). Gives each side's median tok/s and the median of
the per-round ratios new / old.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from scripts.processes import wait_compiled, wait_healthy  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"
BODY = {"inputs": PROMPT, "parameters": {"max_new_tokens": 64, "min_new_tokens": 64, "details": True}}
PER_ROUND = 5


def serve(checkout: Path, port: int, streams: int, model: str, store: Path | None) -> subprocess.Popen:
    python = checkout / ".venv" / "bin" / "python"
    env = {**os.environ, "TINYSERVE_MODELS": f'["{model}"]', "TINYSERVE_COMPILE_MAX_BATCH": str(streams)}
    if store is not None:
        env["TINYSERVE_STORE"] = str(store.resolve())
    return subprocess.Popen(
        [str(python if python.exists() else sys.executable), "-m", "server", "--port", str(port)],
        cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def one_client(client: httpx.Client, url: str, stream: bool) -> None:
    """PER_ROUND sequential requests."""
    for _ in range(PER_ROUND):
        if stream:
            with client.stream("POST", url + "/generate_stream", json=BODY) as response:
                for _ in response.iter_lines():
                    pass
        else:
            assert client.post(url + "/generate", json=BODY).json()["details"]["generated_tokens"] == 64


def one_round(clients: list[httpx.Client], url: str, stream: bool) -> float:
    """tok/s of every client's PER_ROUND sequential requests, the clients at once."""
    t = time.perf_counter()
    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(lambda c: one_client(c, url, stream), clients))
    return len(clients) * PER_ROUND * 64 / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--new", type=Path, default=HERE)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--stream", action="store_true", help="time /generate_stream instead of /generate")
    ap.add_argument("--streams", type=int, default=1, help="clients at once (each side compiles steps this wide)")
    ap.add_argument("--model", default="gpt-wikitext2")
    ap.add_argument("--store", type=Path, default=None, help="the store both serve (default: each checkout's own)")
    args = ap.parse_args()
    sides = {"new": (args.new, 8101), "old": (args.old, 8102)}
    procs = {
        name: serve(path.resolve(), port, args.streams, args.model, args.store) for name, (path, port) in sides.items()
    }
    try:
        for name, (_, port) in sides.items():
            wait_healthy(f"http://127.0.0.1:{port}", procs[name], 600, lambda: "")
            wait_compiled(f"http://127.0.0.1:{port}")
        rates: dict[str, list[float]] = {name: [] for name in sides}
        clients = [httpx.Client(timeout=120) for _ in range(args.streams)]
        for r in range(args.rounds + 2):  # two warm-up rounds
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                rate = one_round(clients, f"http://127.0.0.1:{sides[name][1]}", args.stream)
                if r >= 2:
                    rates[name].append(rate)
                time.sleep(0.2)
        ratio = statistics.median(n / o for n, o in zip(rates["new"], rates["old"], strict=True))
        route = "/generate_stream" if args.stream else "/generate"
        medians = ", ".join(f"{name} {statistics.median(v):.1f} tok/s" for name, v in rates.items())
        print(f"{route}, {args.streams} streams, {args.rounds} rounds: {medians}; new / old {ratio:.3f}")
    finally:
        for proc in procs.values():
            proc.terminate()


if __name__ == "__main__":
    main()
