"""Memory of loading one model: the process's peak while `load_gpt` reads it, what stays resident, and
what the runner adds (its prepacked copy and KV cache), each in a fresh process.

    .venv/bin/python bench/bench_load_memory.py [--shape smollm2-135m] [--dtype bfloat16] [--slots 8]

The checkpoint is a random model at the shape (bench/bench_families.py), added to a scratch store as a
user would. To compare two versions, run with TINYSERVE_CHECKOUT=<another checkout> (a git worktree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = Path(os.environ.get("TINYSERVE_CHECKOUT", HERE.parent))

MEASURE = """
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from model_store.store import load_gpt
try:
    from server.execution.decoder.runner import GPTRunner
except ImportError:  # a checkout from before the decoder's package
    from server.execution.gpt import GPTRunner

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

base = rss_mb()
model, tokenizer = load_gpt(sys.argv[2], "cpu", getattr(torch, sys.argv[3]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
loaded = rss_mb()
runner = GPTRunner(model, tokenizer, int(sys.argv[4]))
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(json.dumps({"before_mb": round(base), "load_peak_mb": round(peak), "loaded_mb": round(loaded),
                  "with_runner_mb": round(rss_mb()), "weights_mb": round(weights),
                  "kv_cache_mb": round(runner.facts.kv_cache_bytes / 2**20)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from bench.bench_families import make_checkpoint
    from model_store.ingest import add_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(args.shape, Path(tmp) / "src")
        folder = add_checkpoint(Path(tmp) / "src", args.shape, Path(tmp) / "store")
        cmd = [sys.executable, "-c", MEASURE, str(CHECKOUT), str(folder), args.dtype, str(args.slots)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    print(json.dumps({"shape": args.shape, "dtype": args.dtype, "checkout": str(CHECKOUT), **json.loads(out)}))


if __name__ == "__main__":
    main()
