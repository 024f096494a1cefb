"""A chat's second turn: time to its first token with prefix caching on and off, against llama-server's prompt cache.

    .venv/bin/python bench/bench_prefix_cache.py --llama DIR [--shape qwen3-0.6b] [--dtype bfloat16]
        [--first-tokens 1500] [--reply-tokens 32] [--turn-tokens 24] [--rounds 3] [--store DIR]

A random checkpoint of the shape with our 16k vocabulary (bench/bench_families.py makes it, or --store holds one
already); llama-server serves the same weights as a GGUF of the dtype (`cache_prompt` on, its default). Each side in
its own process, its prompts' pass built first (ours: /health no longer compiling). A round: turn 1, a prompt of
--first-tokens token ids and a greedy reply of --reply-tokens; then turn 2, turn 1's prompt, --reply-tokens ids for
the reply and --turn-tokens new ids, one token asked for: its time (the prompt's pass and one step) is the figure.
Each round's turn 1 is another text, so that nothing of an earlier round is cached. Ours runs twice,
TINYSERVE_PREFIX_CACHING=true and false; the table gives the median over the rounds and the ratios. One JSON line
per side as it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_families import make_checkpoint, to_gguf, wait_ready  # noqa: E402

VOCAB = 16000


def text(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * j) % VOCAB + 3 for j in range(n)]


def turn(url: str, ours: bool, model: str, ids: list[int], new: int) -> float:
    """A greedy completion of `ids`, exactly `new` tokens: the seconds it took (with one token: the time to the
    first token, the prompt's pass and one step)."""
    if ours:
        body = {"model": model, "prompt": ids, "max_tokens": new, "min_new_tokens": new, "temperature": 0}
        path = "/v1/completions"
    else:
        body, path = (
            {"prompt": ids, "n_predict": new, "ignore_eos": True, "top_k": 1, "cache_prompt": True},
            "/completion",
        )
    start = time.perf_counter()
    httpx.post(url + path, json=body, timeout=600).raise_for_status()
    return time.perf_counter() - start


def rounds(url: str, ours: bool, model: str, args) -> list[float]:
    """Each round's turn 2's time to first token; turn 2 repeats turn 1 and a reply (ids of its own: a client sends
    the reply's text back, whose ids need not be the ones generated), then new ids."""
    times = []
    for r in range(args.rounds + 1):
        first = text(args.first_tokens, 1000 + r)
        turn(url, ours, model, first, args.reply_tokens)
        second = first + text(args.reply_tokens + args.turn_tokens, 2000 + r)
        ttft = turn(url, ours, model, second, 1)
        if r:  # round 0 warms up
            times.append(ttft)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", type=Path, required=True, help="peers work folder (llama.cpp source and build)")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--first-tokens", type=int, default=1500)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--turn-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store", type=Path, default=None, help="where the checkpoint and its GGUF are kept")
    args = ap.parse_args()
    llama_src = next(args.llama.glob("src/llama_cpp_python-*/vendor/llama.cpp"))
    llama_bin = args.llama / "llama.cpp-build" / "bin"
    work = args.store or Path(tempfile.mkdtemp())
    src, store, gguf = work / "src", work / "store", work / f"{args.shape}-{args.dtype}.gguf"
    if not (store / args.shape).exists():
        from model_store.ingest import add_checkpoint

        make_checkpoint(args.shape, src)
        add_checkpoint(src, args.shape, store)
    if not gguf.exists():
        to_gguf(
            str(args.llama / "venv-peers" / "bin" / "python"),
            llama_src,
            src,
            {"bfloat16": "bf16"}.get(args.dtype, "f32"),
            gguf,
        )
    results = {}
    for caching in ("true", "false"):
        settings = {"STORE": str(store), "MODELS": json.dumps([args.shape]), "DTYPE": args.dtype,
                    "MAX_BATCH_SIZE": "1", "COMPILE_MAX_BATCH": "1", "PREFIX_CACHING": caching}  # fmt: skip
        env = {**os.environ, **{f"TINYSERVE_{k}": v for k, v in settings.items()}}
        proc = subprocess.Popen([sys.executable, "-m", "server", "--port", "8941"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=open(work / f"ours-{caching}.log", "w"))  # fmt: skip
        try:
            wait_ready("http://127.0.0.1:8941", proc, True)
            results[f"ours, prefix caching {caching}"] = rounds("http://127.0.0.1:8941", True, args.shape, args)
        finally:
            proc.terminate()
            proc.wait()
        print(json.dumps({k: [round(1000 * t, 1) for t in v] for k, v in results.items()}), flush=True)
    ctx = args.first_tokens + args.reply_tokens + args.turn_tokens + 64
    proc = subprocess.Popen([str(llama_bin / "llama-server"), "-m", str(gguf), "--port", "8942", "-t", "2", "-tb", "2",
                             "-np", "1", "-c", str(ctx)],
                            stdout=subprocess.DEVNULL, stderr=open(work / "llama.log", "w"))  # fmt: skip
    try:
        wait_ready("http://127.0.0.1:8942", proc, False)
        results["llama-server (cache_prompt)"] = rounds("http://127.0.0.1:8942", False, "", args)
    finally:
        proc.terminate()
        proc.wait()
    medians = {k: round(1000 * statistics.median(v), 1) for k, v in results.items()}
    on, off = medians["ours, prefix caching true"], medians["ours, prefix caching false"]
    print(json.dumps({"second turn ttft_ms": medians, "on/off": round(on / off, 3),
                      "on/llama-server": round(on / medians["llama-server (cache_prompt)"], 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
