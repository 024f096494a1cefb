"""Training-step speed of the from-scratch GPT on this machine: fp32 vs bf16 autocast vs torch.compile.

    .venv/bin/python bench/bench_training.py [--modes fp32 bf16 compile compile-bf16] [--steps 12]

Each mode runs in its own process (threads in one process share PyTorch's OpenMP pool), one after
another, on the same model shape and batch: forward, backward, clip, AdamW, as the trainer does. The
first steps (warm-up, and compilation for the compiled modes) are not timed; the table gives the
median step time of the rest, tokens/s, and the ratio to fp32 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("fp32", "bf16", "compile", "compile-bf16")


def one_mode(args: argparse.Namespace) -> dict:
    """Time training steps in this process with one mode."""
    import torch

    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab_size,
        context_length=args.context_length,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dropout=0.1,
        positions=args.positions,
    )
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    step_model = torch.compile(model) if args.mode.startswith("compile") else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.mode.endswith("bf16") else nullcontext()
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.context_length))
    y = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.context_length))
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with autocast:
            loss = step_model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = args.batch_size * cfg.context_length
    return {"mode": args.mode, "step_s": step_s, "tokens_per_s": tokens / step_s, "params": model.num_parameters()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--mode", default=None, choices=MODES, help=argparse.SUPPRESS)  # the child process's mode
    p.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context-length", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--positions", default="rope", choices=["sinusoidal", "learned", "rope"])
    args = p.parse_args()
    if args.mode:
        print(json.dumps(one_mode(args)))
        return
    shape = {k: v for k, v in vars(args).items() if k not in ("modes", "mode")}
    rows = []
    for mode in args.modes:
        child = [sys.executable, __file__, "--mode", mode]
        child += [a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", str(v))]
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    base = rows[0]["step_s"] if rows[0]["mode"] == "fp32" else None
    print(f"\n{rows[0]['params']:,} parameters, batch {args.batch_size} x {args.context_length} tokens\n")
    print("| mode | step time | tokens/s | speed vs fp32 |\n|---|---|---|---|")
    for r in rows:
        ratio = f"{base / r['step_s']:.2f}x" if base else "n/a"
        print(f"| {r['mode']} | {r['step_s'] * 1000:.0f} ms | {r['tokens_per_s']:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
