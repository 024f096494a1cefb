"""The decode step's candidates, each in its own process: which compiler, which dtype, how close to the floor.

    .venv/bin/python bench/bench_decode_step.py [--model gpt-wikitext2] [--rows 1,32] [--dtypes float32,bfloat16]

One step of the shipped GPT over a static KV cache (rows x 128 key columns, the serving engine's
shapes; server/execution/decoder/step.py), 64 steps timed three times, median per step. Candidates: the eager
static step, torch.compile (inductor; + cpp_wrapper, + freezing, max-autotune-no-cudagraphs), and AOTInductor
packages (torch.export + aoti_compile_and_package, with and without freezing). "floor" is the
step's matrix products alone. Each candidate's logits are compared with the eager step's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_store import STORE_ROOT, load_gpt  # noqa: E402
from server.execution.decoder.step import eager_step  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"
COLUMNS, STEPS = 128, 64
CANDIDATES = [
    "floor",
    "eager",
    "compile",
    "compile + cpp_wrapper",
    "compile + freezing",
    "compile + freezing + cpp_wrapper",
    "compile max-autotune-no-cudagraphs",
    "AOTInductor",
    "AOTInductor + freezing",
]


def build(candidate: str, step, example: tuple) -> object:
    if candidate.startswith("compile"):
        options = {"cpp_wrapper": "cpp_wrapper" in candidate, "freezing": "freezing" in candidate}
        mode = "max-autotune-no-cudagraphs" if "autotune" in candidate else None
        return torch.compile(step, fullgraph=True, dynamic=False, mode=mode, options=None if mode else options)
    if candidate.startswith("AOTInductor"):

        class Step(torch.nn.Module):
            def forward(self, *args):
                return step(*args)

        program = torch.export.export(Step(), example)
        package = torch._inductor.aoti_compile_and_package(
            program,
            package_path=tempfile.mktemp(suffix=".pt2"),
            inductor_configs={"freezing": "freezing" in candidate},
        )
        return torch._inductor.aoti_load_package(package)
    return step


def measure_one(model_id: str, candidate: str, dtype: str, rows: int) -> dict:
    """In this process: build the candidate, check it, time it."""
    torch.manual_seed(0)
    model, tok = load_gpt(STORE_ROOT / model_id)
    model.to(getattr(torch, dtype))
    c = model.config
    ids = torch.tensor([tok.encode(PROMPT).ids] * rows)
    T = ids.shape[1]
    if candidate == "floor":
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        inputs = {m.in_features: torch.randn(rows, 1, m.in_features, dtype=model.lm_head.weight.dtype) for m in linears}

        def chain() -> None:
            for m in linears:
                torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)

        with torch.no_grad():
            return {"ms": timed(lambda i: chain()), "build_s": 0.0, "diff": 0.0}
    with torch.no_grad():  # not inference_mode: AOTInductor mutates the cache outside it
        static = model.new_cache(rows)
        model(ids, input_pos=torch.arange(T).expand(rows, T), cache=static)  # the prompt in every slot
        span, cache = torch.empty(COLUMNS, dtype=torch.int8), static.tensors()  # the step reads COLUMNS columns
        tokens, positions = torch.full((rows, 1), 5), torch.full((rows, 1), T)
        eos_bias, allowed = torch.zeros(rows), torch.ones(rows, c.vocab_size, dtype=torch.bool)
        step = eager_step(model, fused_attention=False)
        t = time.perf_counter()
        fn = build(candidate, step, (tokens, positions, eos_bias, allowed, span, *cache))
        expected = step(tokens, positions, eos_bias, allowed, span, *[x.clone() for x in cache])[2].float()
        got = fn(tokens, positions, eos_bias, allowed, span, *[x.clone() for x in cache])[2].float()
        build_s = time.perf_counter() - t

        def one(i: int) -> None:
            positions.fill_(T + i)
            fn(tokens, positions, eos_bias, allowed, span, *cache)

        diff = float((got - expected).abs().max() / (1 + expected.abs().max()))
        return {"ms": timed(one), "build_s": build_s, "diff": diff}


def timed(step) -> float:
    for i in range(8):
        step(i)
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for i in range(STEPS):
            step(i)
        runs.append((time.perf_counter() - t) / STEPS * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-wikitext2")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # internal: candidate dtype rows
    args = parser.parse_args()
    if args.one:
        candidate, dtype, rows = args.one
        print(json.dumps(measure_one(args.model, candidate, dtype, int(rows))))
        return
    results: dict[tuple[str, str, int], dict] = {}
    for dtype in args.dtypes.split(","):
        for rows in map(int, args.rows.split(",")):
            for candidate in args.candidates.split(","):
                cmd = [sys.executable, __file__, "--model", args.model, "--one", candidate, dtype, str(rows)]
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                try:
                    results[candidate, dtype, rows] = json.loads(done.stdout.strip().splitlines()[-1])
                except (IndexError, json.JSONDecodeError):
                    results[candidate, dtype, rows] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
                print(candidate, dtype, rows, results[candidate, dtype, rows], flush=True)
    header = "| candidate | " + " | ".join(
        f"{d}, {r} rows" for d in args.dtypes.split(",") for r in args.rows.split(",")
    )
    lines = [header + " |", "|---" * (1 + len(header.split("|")) - 3) + "|"]
    for candidate in args.candidates.split(","):
        cells = []
        for dtype in args.dtypes.split(","):
            for rows in map(int, args.rows.split(",")):
                r = results[candidate, dtype, rows]
                if "error" in r:
                    cells.append(f"failed: {r['error'][:60]}")
                else:
                    extra = f", build {r['build_s']:.0f} s, diff {r['diff']:.0e}" if r["build_s"] else ""
                    cells.append(f"{r['ms']:.2f} ms{extra}")
        lines.append(f"| {candidate} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
