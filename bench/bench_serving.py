"""Serving benchmarks, as ratios against a peer measured in the same run.

    .venv/bin/python bench/bench_serving.py [--model gpt-wikitext2] [--out docs/BENCHMARKS.md]

1. single-stream decode tokens/s: our engine vs transformers' generate() on a GPT-2 of the same size
2. aggregate tokens/s with 1/4/16/32 concurrent HTTP streams vs transformers' static batching
3. fill-mask p50 latency: our endpoint's function vs transformers' pipeline("fill-mask"), same checkpoint
4. time to first token, HTTP overhead vs in-process, cold start (process start to /health 200)

Everything runs on this machine, over loopback, bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_store import STORE_ROOT, list_checkpoints, load_gpt  # noqa: E402
from server.engine import GenerationEngine  # noqa: E402
from server.sampling import SamplingParams  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"
NEW_TOKENS = 64


def hf_twin(model):
    """A transformers GPT-2 with our model's sizes (random weights: speed does not depend on them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    sizes = dict(n_positions=c.context_length, n_embd=c.d_model, n_layer=c.n_layer, n_head=c.n_head, n_inner=c.d_ff)
    cfg = GPT2Config(vocab_size=c.vocab_size, eos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id, **sizes)
    return GPT2LMHeadModel(cfg).eval()


def timed(fn, repeat: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def single_stream(model, tok) -> dict:
    ids = tok.encode(PROMPT).ids
    engine = GenerationEngine(model, tok, model.config.eos_token_id, max_batch_size=32, max_queue=64)
    engine.start()
    never = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, eos_bias=float("-inf"))
    ours = timed(lambda: engine.generate(ids, never))
    twin = hf_twin(model)
    x = torch.tensor([ids])
    with torch.inference_mode():
        theirs = timed(lambda: twin.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False))
    engine.stop()
    return {"ours_tok_s": NEW_TOKENS / ours, "hf_tok_s": NEW_TOKENS / theirs, "ratio": theirs / ours}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_id: str) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = {
        **os.environ,
        "TINYSERVE_PORT": str(port),
        "TINYSERVE_MODELS": json.dumps([model_id]),
        "TINYSERVE_MAX_BATCH_SIZE": "32",
        "TINYSERVE_MAX_QUEUE": "128",
    }
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - start < 120:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base, time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start")


async def http_streams(base: str, n: int) -> tuple[float, float]:
    """n concurrent /generate_stream requests: (aggregate generated tokens/s, median time to first token)."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "eos_bias": -1e9}}
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient) -> int:
        t0 = time.perf_counter()
        count = 0
        async with client.stream("POST", f"{base}/generate_stream", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if count == 0:
                        ttfts.append(time.perf_counter() - t0)
                    count += 1
        return count

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(client) for _ in range(n)))
        wall = time.perf_counter() - t
    return sum(counts) / wall, statistics.median(ttfts)


def hf_static_batch(model, tok, n: int) -> float:
    twin = hf_twin(model)
    ids = tok.encode(PROMPT).ids
    x = torch.tensor([ids] * n)
    with torch.inference_mode():
        t = timed(
            lambda: twin.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            ),
            repeat=1,
        )
    return n * NEW_TOKENS / t


def http_overhead(base: str, model, tok) -> dict:
    ids = tok.encode(PROMPT).ids
    engine = GenerationEngine(model, tok, model.config.eos_token_id)
    engine.start()
    p = SamplingParams(max_new_tokens=8, temperature=0, eos_bias=float("-inf"))
    in_process = timed(lambda: engine.generate(ids, p), repeat=10)
    engine.stop()
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "eos_bias": -1e9}}
    with httpx.Client(timeout=60) as c:
        over_http = timed(lambda: c.post(f"{base}/generate", json=body).raise_for_status(), repeat=10)
    return {
        "in_process_ms": in_process * 1e3,
        "http_ms": over_http * 1e3,
        "overhead_ms": (over_http - in_process) * 1e3,
    }


def fill_mask_latency(folder: Path) -> dict:
    import transformers

    from server.config import Settings
    from server.inspection import fill_mask
    from server.registry import ModelRegistry

    registry = ModelRegistry(Settings(store=folder.parent, models=[folder.name]))  # loaded as the server does
    registry.load_all()
    served = registry.get(folder.name)
    text = "La suno <mask> hodiaŭ ."
    pipe = transformers.pipeline("fill-mask", model=str(folder))

    def p50(fn) -> float:
        fn()
        times = []
        for _ in range(30):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    ours = p50(lambda: fill_mask(served, text, 5, None))
    theirs = p50(lambda: pipe(text, top_k=5))
    return {"ours_ms": ours * 1e3, "hf_ms": theirs * 1e3, "ratio": theirs / ours}


def mlm_checkpoint() -> tuple[Path, str]:
    """A shipped EsperBERTo checkpoint, or a small-preset one with random weights in a temp folder."""
    for info in list_checkpoints():
        if info.ok and info.architecture == "roberta-mlm":
            return info.path, info.id
    from model_store.store import write_manifest
    from training.esperberto import build_model, make_config, save_model
    from training.esperberto.data import read_corpus, train_roberta_tokenizer

    folder = Path(tempfile.mkdtemp()) / "esperberto-small-random"
    lines = read_corpus(str(REPO.parent / "shared" / "data" / "esperanto"))[:20000]
    tok = train_roberta_tokenizer(lines, 8192)
    save_model(build_model(make_config("small", "softmax0", vocab_size=len(tok))), folder)
    tok.save_pretrained(folder)
    (folder / "README.md").write_text("# random small EsperBERTo for benchmarks\n")
    (folder / "metrics.json").write_text("{}")
    write_manifest(folder)
    return folder, "small preset, random weights"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-wikitext2", help="GPT checkpoint id in the model store")
    parser.add_argument("--out", default=str(REPO / "docs" / "BENCHMARKS.md"))
    parser.add_argument("--streams", default="1,4,16,32", help="concurrent HTTP streams to measure")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_gpt(STORE_ROOT / args.model)
    single = single_stream(model, tok)
    print("single stream", single, flush=True)
    proc, base, cold = start_server(args.model)
    try:
        overhead = http_overhead(base, model, tok)
        print("overhead", overhead, flush=True)
        conc = {}
        for n in [int(s) for s in args.streams.split(",")]:
            ours, ttft = asyncio.run(http_streams(base, n))
            theirs = hf_static_batch(model, tok, n)
            conc[n] = (ours, theirs, ttft)
            print(n, conc[n], flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    mlm_folder, mlm_name = mlm_checkpoint()
    fm = fill_mask_latency(mlm_folder)
    print("fill-mask", fm, flush=True)

    rows = [
        (
            f"single-stream decode (greedy, {NEW_TOKENS} tokens)",
            f"{single['ours_tok_s']:.0f} tok/s",
            f"HF `generate()`, GPT-2 of the same size: {single['hf_tok_s']:.0f} tok/s",
            f"**{single['ratio']:.2f}x** (goal ≥ 2.5x)",
        ),
        *(
            (
                f"{n} concurrent HTTP streams, aggregate",
                f"{ours:.0f} tok/s (TTFT p50 {ttft * 1e3:.0f} ms)",
                f"HF static batch of {n}, in process: {theirs:.0f} tok/s",
                f"**{ours / theirs:.2f}x**",
            )
            for n, (ours, theirs, ttft) in conc.items()
        ),
        (
            f"fill-mask p50 latency ({mlm_name})",
            f"{fm['ours_ms']:.1f} ms",
            f"HF `pipeline('fill-mask')`: {fm['hf_ms']:.1f} ms",
            f"**{fm['ratio']:.2f}x faster** (goal ≥ 2x)",
        ),
        (
            "/generate, 8 tokens: HTTP vs in-process",
            f"{overhead['http_ms']:.1f} ms",
            f"in process: {overhead['in_process_ms']:.1f} ms",
            f"overhead {overhead['overhead_ms']:.1f} ms",
        ),
        ("cold start (process start to /health 200)", f"{cold:.1f} s", "", ""),
    ]
    table = "\n".join(
        ["| measurement | ours | peer (same run) | ratio |", "|---|---|---|---|"]
        + ["| " + " | ".join(r) + " |" for r in rows]
    )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    n_prompt = len(tok.encode(PROMPT).ids)
    text = (
        f"# Benchmarks\n\nMeasured by `python bench/bench_serving.py` on {machine}, model `{args.model}` "
        f"({model.num_parameters():,} parameters), prompt of {n_prompt} tokens.\n\n{table}\n"
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
