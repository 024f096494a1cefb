"""On a GPU, over HTTP: our server, compiled (steps replayed as CUDA graphs) and eager, against transformers'
generate() on a static batch, on the same GPU in the same dtype (float16, `dtype=auto` on CUDA).

    python bench/bench_gpu.py [--models gpt-wikitext2,smollm2-135m] [--streams 1,8,32,64] [--rounds 3]
        [--new-tokens 64] [--ttft-tokens 512] [--store DIR] [--prepare] [--prewarm ROWS] [--out results.json]

gpt-wikitext2 is the shipped GPT (its peer: a transformers GPT-2 of the same sizes, as in
bench/bench_serving.py); smollm2-135m is SmolLM2-135M's shape with random weights and our 16k tokenizer
(bench/bench_families.py makes it; its peer: that checkpoint itself in transformers). Each side runs in a
process of its own; ours and the peer alternate within every round (after a warm-up round), and the
results give the median tok/s per side and the median per-round ratio. n streams are n concurrent
/v1/completions requests of the same 14-token prompt, greedy, exactly --new-tokens tokens each; the peer
runs them as one batch. Time to first token: one request with a --ttft-tokens prompt (capped at the
model's context less 16), best of 3. Each stream count is measured as soon as it runs compiled: on the
smallest built bucket of at least its rows (on CUDA padded on a larger one while its own builds; the server
builds one row, the most, then the rest), named in its record. Also: each compiled bucket's compile time (the
server's log: from the compile cache where an earlier server on the machine compiled it). --store keeps the
random checkpoints (--prepare: only make them), so that servers started beside this script compile the same
weights; --prewarm ROWS builds that decode bucket into the compile cache where the measured server (its batch the
most --streams) looks for it, and exits: one process a bucket, before the measurement (the GPU machine's torch
2.11 took 77-85 s a bucket of the Llama shape, the measured server then 12-18 s).
One JSON line per measurement as it is made, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import bench_families  # noqa: E402
from bench.serving_sides import Worker  # noqa: E402
from model_store import STORE_ROOT  # noqa: E402
from server.execution.decoder.step import compile_order  # noqa: E402
from server.execution.passes import buckets  # noqa: E402


def our_server(store: Path, model: str, port: int, compiled: bool, streams: int, log: Path) -> subprocess.Popen:
    settings = {"STORE": str(store), "MODELS": json.dumps([model]), "MAX_BATCH_SIZE": str(streams),
                "COMPILE_MAX_BATCH": str(streams), "MAX_QUEUE": str(2 * streams),
                "COMPILE_MODELS": "true" if compiled else "false"}  # fmt: skip
    env = {**os.environ, **{f"TINYSERVE_{k}": v for k, v in settings.items()}}
    cmd = [sys.executable, "-m", "server", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def compile_seconds(log: Path) -> dict[str, float]:
    """{bucket label: seconds} from the server's 'compiled ... in N s' lines."""
    return {m[1]: float(m[2]) for m in re.finditer(r"compiled (.+?) in ([\d.]+) s", log.read_text())}


def wait_built(log: Path, row_buckets: list[int], rows: int, limit_s: float) -> int:
    """The smallest built bucket of at least `rows` rows, once the server's log names one: on CUDA a step runs
    padded on any larger built bucket while its own builds (DecodeStep.padding_limit), so a stream count is
    measured as soon as it runs compiled, while the other buckets build (between requests)."""
    deadline = time.time() + limit_s
    while True:
        built = {int(b) for b in re.findall(r"compiled DecodeStep_(\d+)(?:_regional)? in", log.read_text())}
        if ready := [b for b in row_buckets if b >= rows and b in built]:
            return ready[0]
        if time.time() > deadline:
            raise TimeoutError(f"no bucket of at least {rows} rows built after {limit_s} s")
        time.sleep(0.5)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def store_of(model: str, work: Path) -> Path:
    """The store that holds `model`: ours, or work/store with a random checkpoint of the shape made once."""
    if model not in bench_families.SHAPES:
        return STORE_ROOT
    from model_store.ingest import add_checkpoint

    if not (work / "store" / model).exists():
        bench_families.make_checkpoint(model, work / model)
        add_checkpoint(work / model, model, work / "store")
    return work / "store"


def bench_model(args, model: str, work: Path) -> list[dict]:
    store = store_of(model, work)
    folder = store / model
    context = json.loads((folder / "config.json").read_text())
    context = context.get("context_length") or context.get("max_position_embeddings") or context.get("n_positions")
    bench_families.MODEL[0] = model
    top = max(args.streams)
    logs = {name: work / f"{model}-{name}.log" for name in ("compiled", "eager")}
    servers = {
        "compiled": (our_server(store, model, 8941, True, top, logs["compiled"]), "http://127.0.0.1:8941"),
        "eager": (our_server(store, model, 8942, False, top, logs["eager"]), "http://127.0.0.1:8942"),
    }
    hf = Worker("hf", str(folder), "float16")
    records = []
    try:
        t = time.time()
        for proc, url in servers.values():  # serving (the compiled one's buckets are awaited one by one below)
            bench_families.wait_ready(url, proc, False, limit=args.ready_limit_s)
        records.append({"model": model, "ready_s": round(time.time() - t, 1)})
        emit(records[-1])

        def ours(name: str, prompts: list[list[int]], new: int) -> float:  # tok/s
            return asyncio.run(bench_families.tokens_per_s(servers[name][1], True, prompts, new))

        sides = {
            "compiled": lambda prompts, new: ours("compiled", prompts, new),
            "eager": lambda prompts, new: ours("eager", prompts, new),
            "transformers": lambda prompts, new: len(prompts) * new / hf("batch_s", prompts, new),
        }
        prompt = hf("prompt")
        order = compile_order(buckets(top), top)  # the server's build order
        first_serving = {n: next(b for b in order if b >= n) for n in args.streams}  # the first built that runs n
        for n in sorted(args.streams, key=lambda n: order.index(first_serving[n])):  # each as soon as it can be
            bucket = wait_built(logs["compiled"], buckets(top), n, args.ready_limit_s)
            emit({"model": model, "compile_s": compile_seconds(logs["compiled"])})  # as they come: a cut run keeps them
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds + 1):
                for name, tokens_per_s in sides.items():
                    rate = tokens_per_s([prompt] * n, args.new_tokens)
                    if r:  # round 0 warms up
                        rates[name].append(rate)
            record = {"model": model, "streams": n, "bucket": bucket}  # bucket: the graph's rows (padded past n)
            record |= {k: round(statistics.median(v), 1) for k, v in rates.items()}
            for a in ("compiled", "eager"):
                per_round = (x / y for x, y in zip(rates[a], rates["transformers"], strict=True))
                record[f"{a}/transformers"] = round(statistics.median(per_round), 2)
            records.append(record)
            emit(record)
        length = min(args.ttft_tokens, context - 16)
        long = [(13 * j) % 16000 + 3 for j in range(length)]
        ttft = {name: min(time_s(lambda name=name: ours(name, [long], 1)) for _ in range(3)) for name in servers}
        ttft["transformers"] = min(hf("batch_s", [long], 1) for _ in range(3))
        records.append({"model": model, "ttft_prompt_tokens": length} | {k: round(v * 1e3, 1) for k, v in ttft.items()})
        emit(records[-1])
        compile_s = compile_seconds(logs["compiled"])
        records.append({"model": model, "gpu_memory_mb": gpu_memory_mb(), "compile_s": compile_s})
        emit(records[-1])
    finally:
        hf.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
        for name, log in logs.items():  # the servers' logs go with the results
            print(f"--- {model} {name} server log (tail) ---\n{log.read_text()[-4000:]}", file=sys.stderr)
    return records


def time_s(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gpu_memory_mb() -> dict[str, int]:
    """MiB of GPU memory per process, as nvidia-smi sees them (none without it)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout  # fmt: skip
    return {pid.strip(): int(mb) for pid, mb in (line.split(",") for line in out.splitlines() if "," in line)}


def prewarm(store: Path, model: str, rows: int, top: int) -> None:
    """Build the model's `rows` decode bucket, regionally, as a server with `top` rows builds its first pass of it,
    into that server's compile cache."""
    from server.config import Settings
    from server.serving.registry import ModelRegistry

    settings = Settings(store=store, models=[model], max_batch_size=top, compile_max_batch=top, compile_models=False)
    registry = ModelRegistry(settings)
    registry.load_all()
    try:
        (compiler,) = registry._compilers()  # the server's, with its cache folder and key
        t = time.perf_counter()
        compiler.build(rows, regional=True)
        emit({"model": model, "prewarmed": compiler.label(rows, True), "seconds": round(time.perf_counter() - t, 1)})
    finally:
        registry.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-wikitext2,smollm2-135m")
    ap.add_argument("--streams", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ttft-tokens", type=int, default=512)
    ap.add_argument("--ready-limit-s", type=float, default=900, help="give up on a server not ready by then")
    ap.add_argument("--store", type=Path, default=None, help="keep the random checkpoints here (default: a temp dir)")
    ap.add_argument("--prepare", action="store_true", help="only make the random checkpoints in --store")
    ap.add_argument("--prewarm", type=int, default=None, help="only build this decode bucket into the compile cache")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.store or Path(tmp)
        for model in args.models.split(","):
            if args.prepare:
                print(store_of(model, work))
            elif args.prewarm is not None:
                prewarm(store_of(model, work), model, args.prewarm, max(args.streams))
            else:
                results += bench_model(args, model, work)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
