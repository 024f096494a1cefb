"""Serving benchmarks, as ratios against a peer measured in the same run.

    .venv/bin/python bench/bench_serving.py [--model gpt-wikitext2] [--rounds 5] [--out docs/BENCHMARKS.md]

1. single-stream decode tokens/s: our engine vs transformers' generate() on a GPT-2 of the same size
2. aggregate tokens/s with 1/4/16/32 concurrent HTTP streams (and the engine in process, no HTTP) vs
   transformers' static batching, all requests asking for the same number of tokens
3. a mixed workload: 32 clients in a closed loop send requests for 8 to 128 tokens; our server vs
   static batches of 32 of the same requests (a batch runs until its longest request is done)
4. fill-mask p50 latency: our endpoint's function vs transformers' pipeline("fill-mask"), same checkpoint
5. time to first token, HTTP overhead vs in-process, cold start (process start to /health 200)

Ours and the peer alternate within every round, so a change in the machine's speed (shared cores,
noisy neighbours) hits both alike; the table gives the median over rounds of the per-round ratio.
Everything runs on this machine, over loopback, bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_store import STORE_ROOT, list_checkpoints, load_gpt  # noqa: E402
from scripts.processes import http_server  # noqa: E402
from server.engine import GenerationEngine  # noqa: E402
from training.sampling import SamplingParams  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"
NEW_TOKENS = 64
NEVER_STOP = {"eos_bias": -1e9}  # every request generates exactly the tokens it asks for


def hf_twin(model):
    """A transformers GPT-2 with our model's sizes (random weights: speed does not depend on them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    sizes = dict(n_positions=c.context_length, n_embd=c.d_model, n_layer=c.n_layer, n_head=c.n_head, n_inner=c.d_ff)
    special = dict(bos_token_id=c.eos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id)
    return GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, **sizes, **special)).eval()


def seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def alternate(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each measure once per round, in turn (after one warm-up each): {name: [value per round]}."""
    for fn in measures.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, fn in measures.items():
            out[name].append(fn())
    return out


def ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median, min and max over rounds of a[i] / b[i]."""
    r = [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(r), min(r), max(r)


class HFStatic:
    """transformers' generate() on a static batch: every row runs until the batch's longest is done."""

    def __init__(self, model, prompt_ids: list[int]) -> None:
        self.twin = hf_twin(model)
        self.prompt_ids = prompt_ids

    def tokens_per_s(self, lengths: list[int], batch: int) -> float:
        """Requests for `lengths` new tokens, in batches of `batch`: requested tokens per second."""
        t = time.perf_counter()
        for i in range(0, len(lengths), batch):
            n = lengths[i : i + batch]
            x = torch.tensor([self.prompt_ids] * len(n))
            with torch.inference_mode():
                self.twin.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=max(n), min_new_tokens=max(n), do_sample=False
                )
        return sum(lengths) / (time.perf_counter() - t)


def engine_tokens_per_s(engine: GenerationEngine, prompt_ids: list[int], n: int) -> float:
    """n threads generate NEW_TOKENS each on the in-process engine, at once: aggregate tokens/s."""
    p = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, eos_bias=float("-inf"))
    threads = [threading.Thread(target=engine.generate, args=(prompt_ids, p)) for _ in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n * NEW_TOKENS / (time.perf_counter() - t)


async def http_streams(base: str, lengths: list[int], clients: int) -> tuple[float, float]:
    """`clients` concurrent /generate_stream loops working through `lengths` (max_new_tokens per
    request): (aggregate generated tokens/s, median time to first token)."""
    todo = list(reversed(lengths))
    ttfts: list[float] = []

    async def client_loop(client: httpx.AsyncClient) -> int:
        count = 0
        while todo:
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": todo.pop(), **NEVER_STOP}}
            t0 = time.perf_counter()
            first = True
            async with client.stream("POST", f"{base}/generate_stream", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        if first:
                            ttfts.append(time.perf_counter() - t0)
                            first = False
                        count += 1
        return count

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        t = time.perf_counter()
        counts = await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - t
    return sum(counts) / wall, statistics.median(ttfts)


def fill_mask_latency(folder: Path, rounds: int) -> dict:
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
        return statistics.median(seconds(fn) for _ in range(15))

    r = alternate(
        {"ours": lambda: p50(lambda: fill_mask(served, text, 5, None)), "hf": lambda: p50(lambda: pipe(text, top_k=5))},
        rounds,
    )
    return {
        "ours_ms": statistics.median(r["ours"]) * 1e3,
        "hf_ms": statistics.median(r["hf"]) * 1e3,
        "ratio": ratio(r["hf"], r["ours"]),
    }


def mlm_checkpoint() -> tuple[Path, str]:
    """A shipped EsperBERTo checkpoint, or a rotary-small one with random weights in a temp folder."""
    for info in list_checkpoints():
        if info.ok and info.architecture == "mlm":
            return info.path, info.id
    from model_store.store import write_manifest
    from training import SHARED_DATA
    from training.esperberto import build_model, make_config, save_model
    from training.esperberto.data import read_corpus, train_roberta_tokenizer

    scratch = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, scratch, True)  # no checkpoint left behind per run
    folder = Path(scratch) / "esperberto-rotary-small-random"
    lines = read_corpus(str(SHARED_DATA / "esperanto"))[:20000]
    tok = train_roberta_tokenizer(lines, 8192)
    save_model(build_model(make_config("rotary-small", "softmax0", vocab_size=len(tok))), folder)
    tok.save_pretrained(folder)
    (folder / "README.md").write_text("# random small EsperBERTo for benchmarks\n")
    (folder / "metrics.json").write_text("{}")
    write_manifest(folder)
    return folder, "rotary-small preset, random weights"


def fill_mask_row(rounds: int) -> tuple[str, str, str, str]:
    mlm_folder, mlm_name = mlm_checkpoint()
    fm = fill_mask_latency(mlm_folder, rounds)
    print("fill-mask", fm, flush=True)
    return (
        f"fill-mask p50 latency ({mlm_name})",
        f"{fm['ours_ms']:.1f} ms",
        f"HF `pipeline('fill-mask')`: {fm['hf_ms']:.1f} ms",
        fmt_ratio(fm["ratio"]) + " faster (goal ≥ 2x)",
    )


def fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"**{r[0]:.2f}x** ({r[1]:.2f}–{r[2]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-wikitext2", help="GPT checkpoint id in the model store")
    parser.add_argument("--out", default=str(REPO / "docs" / "BENCHMARKS.md"))
    parser.add_argument("--streams", default="1,4,16,32", help="concurrent HTTP streams to measure")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per measurement")
    parser.add_argument("--mixed-requests", type=int, default=96, help="requests in the mixed workload")
    parser.add_argument(
        "--fill-mask-only", action="store_true", help="measure only the fill-mask row and print it (no file written)"
    )
    args = parser.parse_args()
    if args.fill_mask_only:
        print("| " + " | ".join(fill_mask_row(args.rounds)) + " |")
        return
    torch.manual_seed(0)
    model, tok = load_gpt(STORE_ROOT / args.model)
    ids = tok.encode(PROMPT).ids
    engine = GenerationEngine(model, tok, model.config.eos_token_id, max_batch_size=32, max_queue=128)
    engine.start()
    hf = HFStatic(model, ids)
    rows = []

    never = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, eos_bias=float("-inf"))
    single = alternate(
        {
            "ours": lambda: NEW_TOKENS / seconds(lambda: engine.generate(ids, never)),
            "hf": lambda: hf.tokens_per_s([NEW_TOKENS], 1),
        },
        args.rounds,
    )
    print("single stream", single, flush=True)
    rows.append(
        (
            f"single-stream decode (greedy, {NEW_TOKENS} tokens)",
            f"{statistics.median(single['ours']):.0f} tok/s",
            f"HF `generate()`, GPT-2 of the same size: {statistics.median(single['hf']):.0f} tok/s",
            fmt_ratio(ratio(single["ours"], single["hf"])) + " (goal ≥ 2.5x)",
        )
    )

    t0 = time.perf_counter()
    with http_server(STORE_ROOT, models=f'["{args.model}"]', max_batch_size="32", max_queue="128") as (base, _):
        cold = time.perf_counter() - t0
        p8 = SamplingParams(max_new_tokens=8, temperature=0, eos_bias=float("-inf"))
        body8 = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, **NEVER_STOP}}
        with httpx.Client(timeout=60) as c:
            over = alternate(
                {
                    "in_process": lambda: statistics.median(
                        seconds(lambda: engine.generate(ids, p8)) for _ in range(5)
                    ),
                    "http": lambda: statistics.median(
                        seconds(lambda: c.post(f"{base}/generate", json=body8).raise_for_status()) for _ in range(5)
                    ),
                },
                args.rounds,
            )
        print("overhead", over, flush=True)
        for n in [int(s) for s in args.streams.split(",")]:
            ttft: list[float] = []

            def over_http(n=n, ttft=ttft) -> float:
                tok_s, first = asyncio.run(http_streams(base, [NEW_TOKENS] * n, n))
                ttft.append(first)
                return tok_s

            r = alternate(
                {
                    "http": over_http,
                    "engine": lambda n=n: engine_tokens_per_s(engine, ids, n),
                    "hf": lambda n=n: hf.tokens_per_s([NEW_TOKENS] * n, n),
                },
                args.rounds,
            )
            print(n, r, flush=True)
            rows.append(
                (
                    f"{n} concurrent HTTP streams, {NEW_TOKENS} tokens each, aggregate",
                    f"{statistics.median(r['http']):.0f} tok/s (TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms); "
                    f"engine in process: {statistics.median(r['engine']):.0f} tok/s, "
                    f"{fmt_ratio(ratio(r['engine'], r['hf']))}",
                    f"HF static batch of {n}, in process: {statistics.median(r['hf']):.0f} tok/s",
                    fmt_ratio(ratio(r["http"], r["hf"])) + (" (goal ≥ 1.5x)" if n == 32 else ""),
                )
            )
        lengths = [random.Random(i).randint(8, 128) for i in range(args.mixed_requests)]
        mixed = alternate(
            {
                "http": lambda: asyncio.run(http_streams(base, lengths, 32))[0],
                "hf": lambda: hf.tokens_per_s(lengths, 32),
            },
            args.rounds,
        )
        print("mixed", mixed, flush=True)
        rows.append(
            (
                f"mixed workload: {len(lengths)} requests for 8–128 tokens (mean {statistics.mean(lengths):.0f}), "
                "32 clients in a closed loop",
                f"{statistics.median(mixed['http']):.0f} tok/s over HTTP",
                f"HF static batches of 32, in process: {statistics.median(mixed['hf']):.0f} requested tok/s",
                fmt_ratio(ratio(mixed["http"], mixed["hf"])),
            )
        )
    engine.stop()

    http_ms, in_ms = statistics.median(over["http"]) * 1e3, statistics.median(over["in_process"]) * 1e3
    rows += [
        fill_mask_row(args.rounds),
        (
            "/generate, 8 tokens: HTTP vs in-process",
            f"{http_ms:.1f} ms",
            f"in process: {in_ms:.1f} ms",
            f"overhead {http_ms - in_ms:.1f} ms",
        ),
        ("cold start (process start to /health 200)", f"{cold:.1f} s", "", ""),
    ]
    table = "\n".join(
        ["| measurement | ours | peer (same run) | ratio: median (min–max) over rounds |", "|---|---|---|---|"]
        + ["| " + " | ".join(r) + " |" for r in rows]
    )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    text = (
        f"# Benchmarks\n\nMeasured by `python bench/bench_serving.py --rounds {args.rounds}` on {machine}, model "
        f"`{args.model}` ({model.num_parameters():,} parameters), prompt of {len(ids)} tokens.\n\n{table}\n"
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
