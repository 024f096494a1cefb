"""Where a decode step's time goes, at 1 and 32 rows: the compiled step's ops, then the engine around it.

    .venv/bin/python bench/profile_step.py [--model gpt-wikitext2] [--rows 1,32] [--steps 64] [--weights int8]

For each row count: the prefill of that many prompts, eager against the compiled prompts' pass (alternating
blocks), the model's compiled step alone (ms per step), a torch.profiler table of its ops,
and the engine's whole iteration (step + sampling + events, no HTTP) with a cProfile of its Python.
The model is loaded and compiled as the server does (registry, compute thread); run it on an idle
machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import queue
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.kv_cache import blocks_for  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from server.config import Settings  # noqa: E402
from server.engine.events import Retired  # noqa: E402
from server.execution.runner import DecodeRows  # noqa: E402
from server.serving.registry import ModelRegistry  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"


def tables_for(runner, rows: int, positions: int) -> list[list[int]]:
    """Each row its own blocks of the runner's pool, enough for `positions` (block 0 is the null block)."""
    n = blocks_for(positions)
    if 1 + rows * n > runner.facts.kv_blocks:
        raise SystemExit(f"{rows} rows of {positions} positions need {1 + rows * n} blocks of {runner.facts.kv_blocks}")
    return [list(range(1 + r * n, 1 + (r + 1) * n)) for r in range(rows)]


def prefill_both(served, compute, rows: int, blocks: int = 15) -> tuple[float, float]:
    """ms per prefill of `rows` copies of the prompt through the runner: eagerly and with its compiled prompts' pass
    (if built), in alternating blocks of 10 calls (the machine's speed drifts over minutes), medians of the blocks."""
    runner = served.runner
    prompts = runner.prompts
    if not prompts.compiled:
        return math.nan, math.nan
    prompt = served.tokenizer.encode(PROMPT)
    tables = tables_for(runner, rows, len(prompt))
    built = dict(prompts.compiled)

    def run() -> tuple[float, float]:
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        with torch.inference_mode():
            for _ in range(blocks):
                for name, compiled in (("eager", {}), ("compiled", built)):
                    prompts.compiled = compiled
                    t = time.perf_counter()
                    for _ in range(10):
                        runner.prefill(list(range(rows)), [prompt] * rows, tables, [0] * rows)
                    times[name].append((time.perf_counter() - t) / 10)
        prompts.compiled = built
        return tuple(1000 * statistics.median(times[k]) for k in ("eager", "compiled"))

    return compute.call(run)


def step_alone(served, compute, rows: int, steps: int) -> tuple[float, str]:
    """ms per compiled step over `rows` rows at positions 14.., and the profiler's op table."""
    runner = served.runner
    prompt = served.tokenizer.encode(PROMPT)
    tables = tables_for(runner, rows, len(prompt) + steps + 16)

    def run() -> tuple[float, str]:
        with torch.inference_mode():
            prompt_tables = [t[: blocks_for(len(prompt))] for t in tables]  # the prompt's, then the steps'
            runner.prefill(list(range(rows)), [prompt] * rows, prompt_tables, [0] * rows)
            tokens = [prompt[-1]] * rows
            times = []
            for i in range(steps):
                t = time.perf_counter()
                runner.decode(DecodeRows(tokens, [len(prompt) + i] * rows, [0.0] * rows, [None] * rows, tables))
                times.append(time.perf_counter() - t)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for i in range(16):
                    runner.decode(DecodeRows(tokens, [len(prompt) + i] * rows, [0.0] * rows, [None] * rows, tables))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        return 1000 * statistics.median(times), table

    return compute.call(run)


def engine_iteration(served, compute, rows: int, new_tokens: int) -> tuple[float, str]:
    """ms per engine iteration with `rows` greedy requests running (prefill included; median of 3 runs
    without the profiler), and a cProfile of the compute thread over a fourth."""
    p = SamplingParams(max_new_tokens=new_tokens, temperature=0, eos_bias=float("-inf"))
    prompt = served.tokenizer.encode(PROMPT)
    engine = served.engine
    done: queue.Queue = queue.Queue()
    profiler = cProfile.Profile()

    def submit_all() -> float:
        t = time.perf_counter()
        for _ in range(rows):
            engine.submit(prompt, p, lambda e: isinstance(e, Retired) and done.put(e))
        for _ in range(rows):
            done.get()
        return time.perf_counter() - t

    submit_all()  # warm
    seconds = statistics.median(submit_all() for _ in range(3))
    compute.call(profiler.enable)
    submit_all()
    compute.call(profiler.disable)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(22)
    return 1000 * seconds / new_tokens, out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-wikitext2")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="native", choices=["native", "int8", "int4"])
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    registry = ModelRegistry(
        Settings(models=[args.model], max_batch_size=max(rows), dtype=args.dtype, weights=args.weights)
    )
    registry.load_all()
    registry.start()
    registry.compiled.wait()
    served = registry.get(args.model)
    print(f"dtype {next(served.model.parameters()).dtype}, compiled buckets {sorted(served.runner.step.compiled)}")
    for n in rows:
        eager, compiled = prefill_both(served, registry.compute, n)
        print(f"\n=== {n} prompts of 14 tokens: prefill eager {eager:.2f} ms, compiled {compiled:.2f} ms ===")
        ms, table = step_alone(served, registry.compute, n, args.steps)
        print(f"\n=== {n} rows: compiled step alone {ms:.3f} ms ===\n{table}")
        ms, stats = engine_iteration(served, registry.compute, n, args.steps)
        print(f"=== {n} rows: engine, {ms:.3f} ms per iteration ({n * 1000 / ms:.0f} tok/s) ===\n{stats}")
    registry.stop()


if __name__ == "__main__":
    main()
