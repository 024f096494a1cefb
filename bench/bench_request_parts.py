"""Where one stream's request goes, ours against llama-server's, in the same alternating rounds.

    .venv/bin/python bench/bench_request_parts.py [--dtype float32] [--weights native] [--gguf f32] [--rounds 40]
        [--runs 1]

One-stream throughput over HTTP is a decode step per token plus what surrounds the steps. Each round runs
one greedy 64-token request of the 14-token benchmark prompt on three sides, 0.3 s apart:
- ours in this process: the engine behind the model's runner, its prefill, every decode step and every draft
  check (`draft_tokens`: server/engine/speculation.py) timed (the gap is the engine's own Python between two passes),
  no HTTP;
- ours over HTTP: `python -m server` in its own process, the same settings, `POST /generate` as
  ../shared/peers/bench_peers.py sends it (details on, EOS masked);
- llama-server over HTTP on the exact GGUF twin that ../shared/peers/setup.sh made (`--gguf` picks its
  type: f32, bf16, q8_0 after convert_gguf.py), 2 threads, with its own prompt and per-token timings.
Both of ours build only the one-row decode bucket and the prompts' pass (what one stream runs). The bytes
a step reads are the served model's linear weights (the head included) and, for llama-server, every tensor
of the GGUF but the token embedding (of which a step reads one row); GB/s divides them by the median step.
Medians over the rounds; the VM's speed drifts (a shared VM flipped between a fast and a slow phase every few
seconds), so only same-round figures compare, and one run of 40 rounds may not average the phases out: `--runs`
repeats the run, with new server processes each time (the in-process engine stays). PEERS_WORK is the peers'
work folder (default ~/.cache/tinyserve-peers; for an AVX2-emulated run, a copy whose llama.cpp was built
without AVX-512, as docs/BENCHMARKS.md says). TINYSERVE_DRAFT_TOKENS=0 in front: both of ours without drafts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_store import STORE_ROOT  # noqa: E402
from models.quantize import WeightOnlyInt8Linear  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from scripts.processes import free_port, http_server, wait_compiled, wait_healthy  # noqa: E402
from server.config import Settings  # noqa: E402
from server.engine.events import Retired  # noqa: E402
from server.serving.registry import ModelRegistry  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"  # 14 tokens, as the peers' benchmark
MODEL = "gpt-wikitext2"


def step_bytes(model: torch.nn.Module) -> int:
    """What a one-row decode step reads: every linear layer's weight (and int8 scales), the head included."""
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.nbytes
        elif isinstance(m, WeightOnlyInt8Linear):
            total += m.weight.nbytes + m.scales.nbytes
    return total


def gguf_step_bytes(path: Path) -> int:
    """What llama-server's one-token step reads of the GGUF: every tensor but the token embedding."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "token_embd.weight")


class InProcess:
    """Our engine in this process, its runner's prefill and decode calls timed."""

    def __init__(self, settings: Settings, new_tokens: int) -> None:
        self.registry = ModelRegistry(settings)
        self.registry.load_all()
        self.registry.start()
        self.registry.compiled.wait()
        self.served = self.registry.get(MODEL)
        runner = self.served.runner
        self.stamps: list[tuple[str, float, float]] = []  # (part, start, end)
        for part in ("prefill", "decode", "verify"):
            setattr(runner, part, self.timed(part, getattr(runner, part)))
        self.params = SamplingParams(max_new_tokens=new_tokens, temperature=0, eos_bias=float("-inf"), logprobs=True)
        self.ids = self.served.tokenizer.encode(PROMPT)
        self.done: queue.Queue = queue.Queue()

    def timed(self, part: str, fn):
        def call(*args):
            t = time.perf_counter()
            out = fn(*args)
            self.stamps.append((part, t, time.perf_counter()))
            return out

        return call

    def request(self) -> dict:
        self.stamps.clear()
        t = time.perf_counter()
        self.served.engine.submit(self.ids, self.params, lambda e: isinstance(e, Retired) and self.done.put(e))
        self.done.get()
        total = time.perf_counter() - t
        steps = [(a, b) for part, a, b in self.stamps if part == "decode"]
        checks = [(a, b) for part, a, b in self.stamps if part == "verify"]
        passes = sorted(steps + checks)
        prefill = next(b - a for part, a, b in self.stamps if part == "prefill")
        gaps = [b[0] - a[1] for a, b in zip(passes[:-1], passes[1:], strict=True)]
        return {
            "total_ms": 1e3 * total,
            "prefill_ms": 1e3 * prefill,
            "before_prefill_ms": 1e3 * (self.stamps[0][1] - t),
            "step_ms": 1e3 * statistics.median(b - a for a, b in steps) if steps else float("nan"),
            "steps_ms": 1e3 * sum(b - a for a, b in steps),
            "checks": len(checks),
            "checks_ms": 1e3 * sum(b - a for a, b in checks),
            "passes": len(passes),
            "gaps_ms": 1e3 * sum(gaps),
            "gap_ms": 1e3 * statistics.median(gaps),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="native", choices=["native", "int8"])
    ap.add_argument("--gguf", default="f32", help="llama-server's twin: gguf/twin-<this>.gguf in PEERS_WORK")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1, help="runs of --rounds rounds, each with new server processes")
    ap.add_argument("--out", type=Path, help="write every run's medians here (JSON)")
    args = ap.parse_args()
    work = Path(os.environ.get("PEERS_WORK", Path.home() / ".cache/tinyserve-peers"))
    gguf_path = work / "gguf" / f"twin-{args.gguf}.gguf"
    if not gguf_path.exists():
        raise SystemExit(f"{gguf_path} is missing: run ../shared/peers/setup.sh (and convert_gguf.py {args.gguf})")

    settings = Settings(models=[MODEL], dtype=args.dtype, weights=args.weights, compile_max_batch=1)
    local = InProcess(settings, args.new_tokens)
    nbytes = step_bytes(local.served.model), gguf_step_bytes(gguf_path)
    runs = []
    for run in range(args.runs):
        with servers(work, gguf_path, args) as (ours, llama):
            rounds = run_rounds(local, ours, llama, args.rounds, args.new_tokens)
        print(f"--- run {run + 1} of {args.runs}")
        runs.append(report(rounds, *nbytes, args))
    if args.runs > 1:
        ratios = [r["ratio"] for r in runs]
        each = ", ".join(f"{r:.3f}x" for r in ratios)
        print(f"ours / llama-server over HTTP, each run: {each}; median {statistics.median(ratios):.3f}x")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    local.registry.stop()


@contextlib.contextmanager
def servers(work: Path, gguf_path: Path, args) -> Iterator[tuple[str, str]]:
    """Our server and llama-server, each in its own process, 2 threads; their base URLs once ready."""
    port = free_port()
    llama = subprocess.Popen(
        [str(work / "llama.cpp-build/bin/llama-server"), "-m", str(gguf_path), "--host", "127.0.0.1", "--port",
         str(port), "-t", "2", "-tb", "2", "-np", "1", "-cb", "-c", "512"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    settings = {"models": json.dumps([MODEL]), "dtype": args.dtype, "weights": args.weights, "compile_max_batch": "1"}
    try:
        with http_server(STORE_ROOT, **settings) as (ours, _):
            llama_base = f"http://127.0.0.1:{port}"
            wait_healthy(llama_base, llama, 300, lambda: "llama-server")
            wait_compiled(ours)
            yield ours, llama_base
    finally:
        llama.terminate()
        llama.wait(30)


def run_rounds(local: InProcess, ours: str, llama: str, rounds: int, new_tokens: int) -> list[dict]:
    client = httpx.Client(timeout=120)
    our_body = {"inputs": PROMPT, "parameters": {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                                                 "details": True}}  # fmt: skip
    llama_body = {"prompt": local.ids, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
                  "cache_prompt": False}  # fmt: skip
    out = []
    for i in range(rounds + 2):  # two warm-up rounds
        row = {f"ours_{k}": v for k, v in local.request().items()}
        time.sleep(0.3)
        t = time.perf_counter()
        r = client.post(f"{ours}/generate", json=our_body).json()
        row["ours_http_ms"] = 1e3 * (time.perf_counter() - t)
        assert r["details"]["generated_tokens"] == new_tokens, r
        time.sleep(0.3)
        t = time.perf_counter()
        r = client.post(f"{llama}/completion", json=llama_body).json()
        row["llama_http_ms"] = 1e3 * (time.perf_counter() - t)
        timings = r["timings"]
        assert timings["predicted_n"] == new_tokens, timings
        row["llama_prompt_ms"] = timings["prompt_ms"]
        row["llama_token_ms"] = 1e3 / timings["predicted_per_second"]
        time.sleep(0.3)
        if i >= 2:
            out.append(row)
    return out


def report(rounds: list[dict], ours_bytes: int, llama_bytes: int, args) -> dict:
    """Prints the run's medians and returns them, with the ratio ours / llama-server over HTTP (median of the
    rounds')."""
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    n = args.new_tokens
    print(f"{args.dtype}/{args.weights} against llama-server {args.gguf}, {len(rounds)} rounds, medians, ms")
    print(
        f"ours in process: total {med['ours_total_ms']:.1f} = before the prefill {med['ours_before_prefill_ms']:.2f}"
        f" + prefill {med['ours_prefill_ms']:.2f} + {med['ours_passes'] - med['ours_checks']:.0f} steps"
        f" {med['ours_steps_ms']:.1f} (one {med['ours_step_ms']:.3f}) + {med['ours_checks']:.0f} draft checks"
        f" {med['ours_checks_ms']:.1f} + gaps {med['ours_gaps_ms']:.2f} (one {med['ours_gap_ms']:.3f});"
        f" {n - 1} tokens after the prefill's"
    )
    print(f"ours over HTTP: {med['ours_http_ms']:.1f} ({n / med['ours_http_ms'] * 1e3:.0f} tok/s)")
    print(
        f"llama-server over HTTP: {med['llama_http_ms']:.1f} ({n / med['llama_http_ms'] * 1e3:.0f} tok/s):"
        f" prompt {med['llama_prompt_ms']:.2f}, a token {med['llama_token_ms']:.3f}"
    )
    ratio = statistics.median(r["llama_http_ms"] / r["ours_http_ms"] for r in rounds)
    step_ratio = statistics.median(r["llama_token_ms"] / r["ours_step_ms"] for r in rounds)
    print(f"ours / llama-server over HTTP: {ratio:.3f}x; a step, ours / llama-server's token: {step_ratio:.3f}x")
    ours_mb, llama_mb = ours_bytes / 1e6, llama_bytes / 1e6
    print(
        f"a step reads: ours {ours_mb:.1f} MB, {ours_mb / med['ours_step_ms']:.1f} GB/s; llama-server"
        f" {llama_mb:.1f} MB, {llama_mb / med['llama_token_ms']:.1f} GB/s (over its token time)"
    )
    return {**med, "ratio": ratio, "step_ratio": step_ratio}


if __name__ == "__main__":
    main()
