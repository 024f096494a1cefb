"""One decode step of a checkpoint three ways: eager, regional and frozen, its time and what each build adds to
resident memory.

    .venv/bin/python bench/bench_step_kinds.py FOLDER [--dtype bfloat16] [--rows 1,8]

Each row count's step is built regionally and whole (frozen) as the server's compiler builds it (each checked on a
real request's inputs), then run 32 times three times on those inputs (median ms per step); resident memory
(VmRSS) is read after each build. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import load_gpt  # noqa: E402
from server.execution.compiler import BackgroundCompiler, Pass  # noqa: E402
from server.execution.decoder.runner import GPTRunner  # noqa: E402


def rss_mib() -> float:
    return int(Path(f"/proc/{os.getpid()}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,8")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    model, tokenizer = load_gpt(args.folder, dtype=getattr(torch, args.dtype))
    step = GPTRunner(model, tokenizer, max(rows)).step
    print(f"loaded: {rss_mib():.0f} MiB resident")
    for r in rows:
        for kind in ("eager", "regional", "frozen"):
            t = time.perf_counter()
            if kind == "eager":
                fn = step.uncompiled
            else:
                fn = BackgroundCompiler([Pass(step, r, kind == "regional")], None, "bench").build(r, kind == "regional")
            built = time.perf_counter() - t
            with torch.inference_mode():
                inputs = step.real_inputs(r)
                for _ in range(5):
                    fn(*inputs)
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(32):
                        fn(*inputs)
                    times.append((time.perf_counter() - t) / 32 * 1e3)
            took = f"{statistics.median(times):.2f} ms a step, built in {built:.0f} s"
            print(f"{r} rows, {kind}: {took}, {rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
