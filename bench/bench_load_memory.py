"""Loading one model as the server does (`load_runner`: the weights, their huge-page block, the runner with its
KV pool): the seconds it takes, the process's peak, what stays resident, each in a fresh process.

    .venv/bin/python bench/bench_load_memory.py [--shape smollm2-135m] [--dtype bfloat16] [--slots 8] [--repeats 3]

The checkpoint is a random model at the shape (bench/bench_families.py), added to a scratch store as a
user would. Each repeat waits --gap seconds first: on a VM, memory another process just freed comes back quickly
and memory left idle slowly (docs/BENCHMARKS.md, "Start-up"). To compare two versions, run with
TINYSERVE_CHECKOUT=<another checkout> (a git worktree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = Path(os.environ.get("TINYSERVE_CHECKOUT", HERE.parent))

MEASURE = """
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from server.execution.loader import load_runner

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

base = rss_mb()
start = time.perf_counter()
runner = load_runner("decoder", Path(sys.argv[2]), torch.device("cpu"), getattr(torch, sys.argv[3]), int(sys.argv[4]))
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so it gave the parent's peak (building the checkpoint)
peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) / 1024
weights = sum(t.numel() * t.element_size() for t in {id(p): p for p in runner.model.parameters()}.values()) / 2**20
print(json.dumps({"load_s": round(seconds, 2), "before_mb": round(base), "load_peak_mb": round(peak),
                  "loaded_mb": round(rss_mb()), "weights_mb": round(weights),
                  "kv_cache_mb": round(runner.facts.kv_cache_bytes / 2**20)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gap", type=float, default=5.0, help="seconds before each load")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from bench.bench_families import make_checkpoint
    from model_store.ingest import add_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(args.shape, Path(tmp) / "src")
        folder = add_checkpoint(Path(tmp) / "src", args.shape, Path(tmp) / "store")
        cmd = [sys.executable, "-c", MEASURE, str(CHECKOUT), str(folder), args.dtype, str(args.slots)]
        for _ in range(args.repeats):
            time.sleep(args.gap)
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            print(json.dumps({"shape": args.shape, "dtype": args.dtype, "checkout": str(CHECKOUT), **json.loads(out)}))


if __name__ == "__main__":
    main()
