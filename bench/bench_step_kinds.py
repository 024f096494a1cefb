"""One decode step (or, with --prompts, the prompts' pass) of a checkpoint several ways, its time and what each
build adds to resident memory.

    .venv/bin/python bench/bench_step_kinds.py FOLDER [--dtype bfloat16] [--rows 1,8] [--prompts]
        [--kinds eager,regional,own,frozen]

Each row count's step (prefill group) is built as the server's compiler builds it (each checked on a real
request's inputs): regional (the graph shared by the buckets of 2 or more rows where the server shares one, built
for the first of them), own (a regional graph of the bucket's rows alone) and whole (frozen); then run 32 times
(prefills: 5) three times on those inputs (median ms per call); resident memory (VmRSS) is read after each build.
A prefill group is `rows` prompts of 89 tokens of English. Run it on an idle machine.
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
from server.execution.compiler import BackgroundCompiler  # noqa: E402
from server.execution.decoder.runner import GPTRunner  # noqa: E402
from server.execution.huge_pages import on_huge_pages  # noqa: E402
from server.execution.passes import Pass  # noqa: E402
from server.execution.runner import right_padded  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages, when a small market grew up beside the river. " * 4


def rss_mib() -> float:
    return int(Path(f"/proc/{os.getpid()}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--prompts", action="store_true", help="the prompts' pass (one graph for every group)")
    parser.add_argument("--kinds", default="eager,regional,own,frozen")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    model, tokenizer = load_gpt(args.folder, dtype=getattr(torch, args.dtype))
    on_huge_pages(model)  # as the server loads it (server/execution/loader.py)
    runner = GPTRunner(model, tokenizer, max(rows))
    target, calls = (runner.prompts, 5) if args.prompts else (runner.step, 32)
    print(f"loaded: {rss_mib():.0f} MiB resident")
    built_fns = {}
    buckets = [None] if args.prompts else rows
    shared = BackgroundCompiler([Pass(target, b, True) for b in buckets], None, "bench")  # as the server's
    for r in rows:
        bucket = None if args.prompts else r
        for kind in args.kinds.split(","):
            t = time.perf_counter()
            if kind == "eager":
                fn = target.uncompiled
            elif (bucket, kind) in built_fns:  # the prompts' one graph, built for the first group
                fn = built_fns[bucket, kind]
            elif kind == "regional":
                fn = built_fns[bucket, kind] = shared.build(bucket, True)
            else:
                compiler = BackgroundCompiler([Pass(target, bucket, kind == "own")], None, "bench")
                compiler.shared_key = lambda bucket: None  # a graph of its own
                fn = built_fns[bucket, kind] = compiler.build(bucket, kind == "own")
            built = time.perf_counter() - t
            with torch.inference_mode():
                inputs = prefill_group(runner, tokenizer, r) if args.prompts else runner.step.real_inputs(r)
                for _ in range(2):
                    fn(*inputs)
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(calls):
                        fn(*inputs)
                    times.append((time.perf_counter() - t) / calls * 1e3)
            took = f"{statistics.median(times):.2f} ms a call, built in {built:.0f} s"
            print(f"{r} rows, {kind}: {took}, {rss_mib():.0f} MiB")


def prefill_group(runner: GPTRunner, tokenizer, rows: int) -> tuple[torch.Tensor, ...]:
    """`rows` copies of PROMPT as the runner's prefill gives them to the pass (slots 0..rows-1, their rows whole)."""
    prompt = tokenizer.encode(PROMPT)
    prompt = getattr(prompt, "ids", prompt)
    ids, positions, last = right_padded(list(range(rows)), [prompt] * rows, 0, runner.device)
    return ids, positions, last, *runner.step.cache.view(rows, runner.step.context + 1).tensors()


if __name__ == "__main__":
    main()
