"""A newcomer's `make serve`: time to /health 200, completions while the server compiles, compile time, memory.

    .venv/bin/python bench/bench_startup.py [--store DIR] [--models gpt-wikitext2,...] [--max-s 900] [--cache-dir DIR]

Starts `python -m server` over the shipped store (or --store; every checkpoint unless --models) with an empty
compile cache and inductor cache (fresh temporary folders; or both in --cache-dir: empty the first time, a warm
start the next), then sends one 64-token greedy completion to the default model every --every seconds, one at a
time (--every 0: none, /health polled every 0.5 s: a start alone), until /health lists nothing loading or
compiling (or --max-s). Reports /health's time, when every model had loaded, the completions' latency while
compiling and after, when compiling ended, what the server logged per compiled pass, and the resident memory of
the server's process and its children (inductor's compile workers) when ready and when done (after five
completions), and the most the server's process held (VmHWM). Run it on an idle machine: compiling is CPU work.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import STORE_ROOT  # noqa: E402
from scripts.processes import http_server, server_output  # noqa: E402

PROMPT = "The castle was built in the early years of the"
BODY = {"inputs": PROMPT, "parameters": {"max_new_tokens": 64, "eos_bias": -1e9}}  # exactly 64 tokens


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory (VmRSS; VmHWM: its peak) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def group_rss_mib(pid: int) -> float:
    """VmRSS of the process and of its children, grandchildren included (inductor's compile workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(c) for c in children.read_text().split()] if children.exists() else []
    return rss_mib(pid) + sum(group_rss_mib(k) for k in kids if Path(f"/proc/{k}").exists())


def completed(client: httpx.Client, base: str, proc) -> None:
    """One completion; a failed one ends the run with the server's log (what failed is there)."""
    response = client.post(f"{base}/generate", json=BODY)
    if response.status_code != 200:
        sys.exit(f"{response.status_code} {response.text}\n--- the server's log ---\n{server_output(proc)[-8000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, default=STORE_ROOT, help="the model store to serve")
    parser.add_argument("--models", default=None, help="comma-separated model ids (default: the whole store)")
    parser.add_argument("--max-s", type=float, default=900, help="stop timing after this many seconds")
    parser.add_argument(
        "--every", type=float, default=2.0, help="seconds between completions while compiling (0: none until it ends)"
    )
    parser.add_argument("--cache-dir", default=None, help="compile cache to use (default: a fresh empty one)")
    parser.add_argument("--env", action="append", default=[], help="extra server setting, KEY=VALUE (repeatable)")
    args = parser.parse_args()

    settings = dict(kv.split("=", 1) for kv in args.env)
    if args.models:
        settings["models"] = "[" + ",".join(f'"{m}"' for m in args.models.split(",")) + "]"
    with tempfile.TemporaryDirectory() as fresh:
        settings["compile_cache_dir"] = args.cache_dir or fresh
        # inductor's own cache (C++ kernels by source hash) is machine-wide: its own, fresh or beside the compile cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.cache_dir or fresh) / "inductor")
        t0 = time.monotonic()
        with http_server(args.store, **settings) as (base, proc), httpx.Client(timeout=120) as client:
            health_s = time.monotonic() - t0
            rss_ready = group_rss_mib(proc.pid)
            during: list[tuple[float, float]] = []  # (seconds since start, latency)
            compiled_s = loaded_s = None
            while time.monotonic() - t0 < args.max_s:
                t = time.monotonic()
                if args.every > 0:
                    completed(client, base, proc)
                    during.append((t - t0, time.monotonic() - t))
                health = client.get(f"{base}/health").json()
                if loaded_s is None and not health["loading"]:
                    loaded_s = time.monotonic() - t0
                if not health["loading"] and not health["compiling"]:
                    compiled_s = time.monotonic() - t0
                    break
                time.sleep(max(0.0, (args.every or 0.5) - (time.monotonic() - t)))
            after = []
            for _ in range(5):
                t = time.monotonic()
                completed(client, base, proc)
                after.append(time.monotonic() - t)
            rss_done, rss_peak = group_rss_mib(proc.pid), rss_mib(proc.pid, "VmHWM")
            models = client.get(f"{base}/health").json()["models"]
            log = server_output(proc)

    builds = re.findall(r"compiled (\S+) in ([\d.]+) s", log)
    latencies = [lat for _, lat in during]
    print(f"models: {', '.join(models)}")
    print(f"compiled passes: {len(builds)}, {sum(float(s) for _, s in builds):.0f} s of building in all")
    for name, s in builds:
        print(f"  {name}: {float(s):.1f} s")
    for name, why in re.findall(r"(\S+) not built, the bucket [^:]*: (.*)", log):
        print(f"  {name}: not built ({why[:300]})")
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| /health 200 after | {health_s:.1f} s |")
    print(f"| every model loaded after (first /health that lists none loading) | {loaded_s or float('nan'):.1f} s |")
    if latencies:
        print(f"| first 64-token completion (right after /health) | {latencies[0]:.2f} s |")
        print(
            f"| 64-token completions while compiling (n={len(latencies)}): median / p90 / max | "
            f"{statistics.median(latencies):.2f} / {sorted(latencies)[int(0.9 * (len(latencies) - 1))]:.2f} / "
            f"{max(latencies):.2f} s |"
        )
        slow = [round(at) for at, lat in during if lat > 0.5]
        print(f"| completions over 0.5 s while compiling | {len(slow)} of {len(latencies)} (at {slow[:12]} s) |")
        windows: dict[int, list[float]] = {}
        for at, lat in during:
            windows.setdefault(int(at // 10) * 10, []).append(lat)
        timeline = ", ".join(f"{w}s {max(lats):.2f}" for w, lats in sorted(windows.items()))
        print(f"| slowest completion per 10 s since start | {timeline} |")
    done = f"{compiled_s:.0f} s" if compiled_s is not None else f"not within {args.max_s:.0f} s"
    print(f"| compiling ended after (seen between completions) | {done} |")
    for name, passes, s in re.findall(r"(\S+) at full speed: all (\d+) passes compiled in (\d+) s", log):
        print(f"| {name} at full speed (its log: {passes} passes) | {s} s after its compiler started |")
    print(f"| 64-token completion after compiling (median of 5) | {statistics.median(after):.2f} s |")
    print(f"| resident memory (process and children): ready / after compiling | {rss_ready:.0f} / {rss_done:.0f} MiB |")
    print(f"| the server process's peak (VmHWM) | {rss_peak:.0f} MiB |")


if __name__ == "__main__":
    main()
