"""Decode steps per schedule (`steps_per_schedule`) and draft tokens (`draft_tokens`), in one process, same rounds.

    .venv/bin/python bench/bench_multi_step.py [--dtype auto] [--streams 1,32] [--steps 1,8,16] [--drafts 0]
        [--rounds 20]

Each round submits `streams` greedy 64-token requests of the 14-token benchmark prompt at once to the
engine of gpt-wikitext2 (loaded and compiled as the server does, no HTTP) and times them until the last
ends, once for every (steps_per_schedule, draft_tokens) pair, the order alternating from round to round. Over
HTTP a difference of a few percent is below what a round varies on a shared 2-vCPU VM; here the requests are the
only work. Prints each setting's median tok/s, its median per-round ratio to the first setting, and the draft
tokens the model agreed with.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.sampling import SamplingParams  # noqa: E402
from server.config import Settings  # noqa: E402
from server.engine.events import Retired  # noqa: E402
from server.serving.registry import ModelRegistry  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"  # 14 tokens, as the peers' benchmark
MODEL = "gpt-wikitext2"
NEW_TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--steps", default="1,8,16", help="steps_per_schedule values; ratios are to the first")
    ap.add_argument("--drafts", default="0", help="draft_tokens values (speculation); ratios are to the first pair")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    settings = [(int(k), int(d)) for k in args.steps.split(",") for d in args.drafts.split(",")]

    registry = ModelRegistry(Settings(models=[MODEL], dtype=args.dtype, compile_max_batch=max(streams)))
    registry.load_all()
    registry.start()
    registry.compiled.wait()
    engine = registry.get(MODEL).engine
    ids = registry.get(MODEL).tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0, logprobs=True)

    def tok_per_s(n: int, setting: tuple[int, int]) -> float:
        engine.steps_per_schedule, engine.draft_tokens = setting
        done: queue.Queue = queue.Queue()
        t = time.perf_counter()
        for _ in range(n):
            engine.submit(ids, params, lambda e: isinstance(e, Retired) and done.put(e))
        for _ in range(n):
            done.get()
        return n * NEW_TOKENS / (time.perf_counter() - t)

    for n in streams:
        for _ in range(2):  # warm-up
            for k in settings:
                tok_per_s(n, k)
        got: dict[tuple[int, int], list[float]] = {k: [] for k in settings}
        drafted, agreed = engine.stats.draft_tokens, engine.stats.draft_tokens_agreed
        for r in range(args.rounds):
            for k in settings if r % 2 == 0 else settings[::-1]:
                got[k].append(tok_per_s(n, k))
                time.sleep(0.1)
        base = got[settings[0]]
        for k in settings:
            ratio = statistics.median(b / a for a, b in zip(base, got[k], strict=True))
            print(
                f"{args.dtype}, {n} streams, steps_per_schedule={k[0]} draft_tokens={k[1]}:"
                f" {statistics.median(got[k]):.0f} tok/s, {ratio:.3f}x the first (median of {args.rounds} rounds)"
            )
        drafted, agreed = engine.stats.draft_tokens - drafted, engine.stats.draft_tokens_agreed - agreed
        print(f"{n} streams: {agreed} of {drafted} draft tokens agreed ({agreed / max(drafted, 1):.0%})")
    registry.stop()


if __name__ == "__main__":
    main()
