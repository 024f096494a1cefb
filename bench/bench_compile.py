"""One bucket's compile time and step time, the step compiled as one whole graph or regionally (as the server
builds it first).

    .venv/bin/python bench/bench_compile.py [--shape smollm2-135m | --model FOLDER] [--dtype float32] [--rows 1]
        [--regional] [--unfrozen] [--phases] [--gated]

A random model at a family's shape (bench/bench_families.py), or --model's checkpoint (e.g. model_store/gpt-wikitext2),
on this machine's device, its decode step built
as the server builds a bucket (`BackgroundCompiler.build`: compiled, checked against eager), then timed over
50 steps. --regional: the regional pass (server/execution/decoder/regional.py: every block one nested compile
region, the weights graph inputs, the prepacked layers on the CPU). --unfrozen: a whole graph with the weights
as graph inputs (no freezing). --phases: dynamo's and inductor's time per phase, each call's time listed (a region
traced once per block lists as many). --gated: built as the server builds it, on a thread that yields to requests
(server/execution/compute_thread.py, YieldToRequests; none run here). Run it on an idle machine with an empty
inductor cache
(TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import server.execution.compiler  # noqa: E402
import server.execution.compute_thread  # noqa: E402
from bench.bench_families import SHAPES, shape_config  # noqa: E402
from model_store.families import family_of  # noqa: E402
from models.gpt import GPT  # noqa: E402
from server.execution.compute_thread import YieldToRequests  # noqa: E402
from server.execution.decoder.step import DecodeStep  # noqa: E402
from server.execution.runner import DecodeRows  # noqa: E402


def random_model(shape: str, dtype: torch.dtype, device: torch.device) -> GPT:
    config = shape_config(shape).to_dict()
    torch.manual_seed(0)
    return GPT(family_of(config).config(config, 512)).to(device, dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint folder instead of a random shape")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--regional", action="store_true")
    ap.add_argument("--unfrozen", action="store_true")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--gated", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.unfrozen:
        server.execution.compiler.inductor_settings = lambda device, rows, dtype, weights_bytes: {}
    if args.model is not None:
        from model_store import load_gpt

        model, _ = load_gpt(args.model, device, getattr(torch, args.dtype))
    else:
        model = random_model(args.shape, getattr(torch, args.dtype), device)
    step = DecodeStep(model, args.rows)
    t = time.perf_counter()
    compiler = server.execution.compiler.BackgroundCompiler.of(step, [args.rows], None, "bench")
    if args.gated:
        idle = threading.Event()
        idle.set()
        with YieldToRequests(idle).gating():
            step.compiled[args.rows] = server.execution.compute_thread.on_own_thread(
                compiler.build, args.rows, args.regional
            )
    else:
        step.compiled[args.rows] = compiler.build(args.rows, regional=args.regional)
    compile_s = time.perf_counter() - t
    if args.phases:
        print(torch._dynamo.utils.compile_times(repr="str"))
    times, n = [], args.rows
    tables = [[1 + row * 6 + j for j in range(6)] for row in range(n)]  # 6 blocks of 16 a row: positions up to 95
    with torch.inference_mode():
        for i in range(60):
            t = time.perf_counter()
            step(DecodeRows([5] * n, [20 + i] * n, [0.0] * n, [None] * n, tables))
            times.append(time.perf_counter() - t)
    step_ms = 1000 * statistics.median(times[10:])
    print(f"{args.model or args.shape} {args.dtype} {args.rows} rows on {device.type}, regional={args.regional}, "
          f"unfrozen={args.unfrozen}: compiled in {compile_s:.1f} s, step {step_ms:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
