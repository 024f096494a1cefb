"""The machine's read bandwidth, the bound of a decode step that reads every weight once per token.

    .venv/bin/python bench/bench_memory.py [--threads 2]

A one-row step of gpt-wikitext2 reads its linear layers' weights once: 13.4M values, 53.5 MB in float32,
26.7 MB in bf16, 13.4 MB in int8 (the KV cache adds under 1 MB at the benchmark's lengths). A block that
fits the last-level cache is read faster than one that streams from DRAM, so the sizes bracket both.
Prints GB/s per block size (median of the repeats; a sum over float32 or int8 values, what a GEMV does
with its weights), and the step bytes for each weight format.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

STEP_WEIGHTS = 13_369_344  # gpt-wikitext2's linear layers (4 x (qkv, proj, fc, out) + the head)


def read_gbs(numel: int, dtype: torch.dtype, repeats: int) -> float:
    x = torch.ones(numel, dtype=dtype)
    x.sum()  # warm: pages touched, caches as in a decode loop
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum(dtype=torch.float32) if dtype != torch.float32 else x.sum()
        times.append(time.perf_counter() - t)
    return numel * x.element_size() / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for mb in (8, 16, 32, 64, 256):
        fp32 = read_gbs(mb * 2**20 // 4, torch.float32, args.repeats)
        print(f"{mb:4d} MB block: float32 {fp32:5.1f} GB/s")
    for name, size in (("float32", 4), ("bf16", 2), ("int8", 1)):
        print(f"step weights in {name}: {STEP_WEIGHTS * size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
