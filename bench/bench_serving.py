"""Serving benchmarks, as ratios against a peer measured in the same run.

    .venv/bin/python bench/bench_serving.py [--model gpt-wikitext2] [--rounds 5] [--out results.md]

1. single-stream decode tokens/s: our engine vs transformers' generate() on a GPT-2 of the same size
2. aggregate tokens/s with 1/4/16/32 concurrent HTTP streams (and the engine in process, no HTTP) vs
   transformers' static batching, all requests asking for the same number of tokens
3. a mixed workload: 32 clients in a closed loop send requests for 8 to 128 tokens; our server vs
   static batches of 32 of the same requests (a batch runs until its longest request is done)
4. fill-mask p50 latency: our endpoint's function vs transformers' pipeline("fill-mask"), same checkpoint
5. time to first token, HTTP overhead vs in-process, cold start (process start to /health 200)

Every side runs in a process of its own (bench/serving_sides.py, driven over a pipe): our engine, our HTTP
server, transformers' peers and the matmul floor never share a process, so no two OpenMP teams meet.
Ours and the peer alternate within every round, so a change in the machine's speed (shared cores,
noisy neighbours) hits both alike; the table gives the median over rounds of the per-round ratio.
Our sides are measured with their compiled decode steps built (the benchmark waits for them).
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
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serving_sides import DEVICE, PROMPT, Worker, seconds  # noqa: E402
from model_store import STORE_ROOT, list_checkpoints  # noqa: E402
from scripts.processes import http_server, wait_compiled  # noqa: E402

NEW_TOKENS = 64
NEVER_STOP = {"eos_bias": -1e9}  # every request generates exactly the tokens it asks for


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
    text = "La suno <mask> hodiaŭ ."
    ours, hf = Worker("fill-ours", str(folder)), Worker("fill-hf", str(folder))
    r = alternate({"ours": lambda: ours("p50_s", text), "hf": lambda: hf("p50_s", text)}, rounds)
    ours.close(), hf.close()
    return {
        "ours_ms": statistics.median(r["ours"]) * 1e3,
        "hf_ms": statistics.median(r["hf"]) * 1e3,
        "ratio": ratio(r["hf"], r["ours"]),
    }


def mlm_checkpoint() -> tuple[Path, str]:
    """A shipped EsperBERTo checkpoint, or a rotary-small one with random weights in a temp folder."""
    for info in list_checkpoints():
        if info.ok and info.family.kind == "mlm":
            return info.path, info.id
    from model_store.store import write_manifest
    from models.esperberto import build_model, make_config, save_model
    from training import SHARED_DATA
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
    parser.add_argument("--out", default=None, help="also write the table here (it is always printed)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams to measure")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per measurement")
    parser.add_argument("--mixed-requests", type=int, default=96, help="requests in the mixed workload")
    parser.add_argument(
        "--fill-mask-only", action="store_true", help="measure only the fill-mask row and print it (no file written)"
    )
    parser.add_argument("--no-fill-mask", action="store_true", help="leave out the fill-mask row")
    args = parser.parse_args()
    if args.fill_mask_only:
        print("| " + " | ".join(fill_mask_row(args.rounds)) + " |")
        return
    engine = Worker("engine", args.model)
    info = engine("info")
    dtype = info["dtype"].removeprefix("torch.")
    hf32, hf_same = Worker("hf", args.model, "float32"), Worker("hf", args.model, dtype)
    floor = Worker("floor", args.model, dtype)
    rows = []
    same = f"HF in {dtype}" if dtype != "float32" else "HF"

    single = alternate(
        {
            "ours": lambda: engine("tokens_per_s", 1, NEW_TOKENS),
            "hf": lambda: hf32("tokens_per_s", [NEW_TOKENS], 1),
            "hf_same": lambda: hf_same("tokens_per_s", [NEW_TOKENS], 1),
            "floor": lambda: floor("step_ms", 1),
        },
        args.rounds,
    )
    print("single stream", single, flush=True)
    floor_tok_s = 1e3 / statistics.median(single["floor"])
    rows.append(
        (
            f"single-stream decode (greedy, {NEW_TOKENS} tokens), engine",
            f"{statistics.median(single['ours']):.0f} tok/s ({statistics.median(single['ours']) / floor_tok_s:.0%} "
            f"of the matmul floor)",
            f"HF `generate()`, GPT-2 of the same size, float32: {statistics.median(single['hf']):.0f} tok/s; "
            f"{same}: {statistics.median(single['hf_same']):.0f} tok/s",
            fmt_ratio(ratio(single["ours"], single["hf"]))
            + f"; vs {same}: "
            + fmt_ratio(ratio(single["ours"], single["hf_same"])),
        )
    )
    rows.append(
        (
            f"matmul floor: the step's matrix products alone, {dtype}, 1 row",
            f"{statistics.median(single['floor']):.2f} ms = {floor_tok_s:.0f} tok/s",
            "",
            "",
        )
    )

    t0 = time.perf_counter()
    with http_server(STORE_ROOT, models=f'["{args.model}"]', max_batch_size="32", max_queue="128") as (base, _):
        cold = time.perf_counter() - t0
        wait_compiled(base)
        body8 = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, **NEVER_STOP}}
        with httpx.Client(timeout=60) as c:
            over = alternate(
                {
                    "in_process": lambda: engine("request_s", 8),
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
                    "engine": lambda n=n: engine("tokens_per_s", n, NEW_TOKENS),
                    "hf": lambda n=n: hf32("tokens_per_s", [NEW_TOKENS] * n, n),
                    "hf_same": lambda n=n: hf_same("tokens_per_s", [NEW_TOKENS] * n, n),
                },
                args.rounds,
            )
            print(n, r, flush=True)
            rows.append(
                (
                    f"{n} concurrent streams, {NEW_TOKENS} tokens each, aggregate",
                    f"HTTP: {statistics.median(r['http']):.0f} tok/s "
                    f"(TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms); "
                    f"engine: {statistics.median(r['engine']):.0f} tok/s",
                    f"HF static batch of {n}, float32: {statistics.median(r['hf']):.0f} tok/s; "
                    f"{same}: {statistics.median(r['hf_same']):.0f} tok/s",
                    f"HTTP {fmt_ratio(ratio(r['http'], r['hf']))}, engine {fmt_ratio(ratio(r['engine'], r['hf']))}; "
                    f"vs {same}: HTTP {fmt_ratio(ratio(r['http'], r['hf_same']))}, "
                    f"engine {fmt_ratio(ratio(r['engine'], r['hf_same']))}",
                )
            )
        lengths = [random.Random(i).randint(8, 128) for i in range(args.mixed_requests)]
        mixed = alternate(
            {
                "http": lambda: asyncio.run(http_streams(base, lengths, 32))[0],
                "hf": lambda: hf32("tokens_per_s", lengths, 32),
            },
            args.rounds,
        )
        print("mixed", mixed, flush=True)
        rows.append(
            (
                f"mixed workload: {len(lengths)} requests for 8–128 tokens (mean {statistics.mean(lengths):.0f}), "
                "32 clients in a closed loop",
                f"{statistics.median(mixed['http']):.0f} tok/s over HTTP",
                f"HF static batches of 32, float32: {statistics.median(mixed['hf']):.0f} requested tok/s",
                fmt_ratio(ratio(mixed["http"], mixed["hf"])),
            )
        )
    for worker in (engine, hf32, hf_same, floor):
        worker.close()

    http_ms, in_ms = statistics.median(over["http"]) * 1e3, statistics.median(over["in_process"]) * 1e3
    rows += [fill_mask_row(args.rounds)] if not args.no_fill_mask else []
    rows += [
        (
            "/generate, 8 tokens: HTTP vs engine",
            f"{http_ms:.1f} ms",
            f"engine: {in_ms:.1f} ms",
            f"overhead {http_ms - in_ms:.1f} ms",
        ),
        ("cold start (process start to /health 200)", f"{cold:.1f} s", "", ""),
    ]
    table = "\n".join(
        [
            "| measurement | ours | peer (same run, own process) | ratio: median (min–max) over rounds |",
            "|---|---|---|---|",
        ]
        + ["| " + " | ".join(r) + " |" for r in rows]
    )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if DEVICE.type == "cuda":
        machine += f", {torch.cuda.get_device_name(DEVICE)}"
    text = (
        f"Measured by `python bench/bench_serving.py --rounds {args.rounds}` on {machine}, model `{args.model}` "
        f"({info['params']:,} parameters, served in {dtype}; compiled buckets {info['compiled']}).\n\n{table}\n"
    )
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
