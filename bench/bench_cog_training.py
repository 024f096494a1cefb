"""The Cog trainer on a user's text: the shipped GPT fine-tuned for a time budget, then held-out text of the same
kind scored by the shipped GPT and by the result (`/score`).

    .venv/bin/python bench/bench_cog_training.py --text FILE [--kb 200] [--minutes 10]

The first --kb KB of FILE (cut at a paragraph) is the user's text, as `cog train -i text=@...` would send it
(train.py: its last tenth held out for validation); the file's last 50 paragraphs, which the training never
reads, are the held-out text. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastapi.testclient import TestClient  # noqa: E402

from model_store import STORE_ROOT  # noqa: E402
from predict import unpacked  # noqa: E402
from server.api.app import create_app  # noqa: E402
from server.config import Settings  # noqa: E402
from train import run_training  # noqa: E402


def perplexity(store: Path, model: str, paragraphs: list[str]) -> float:
    """Of the paragraphs together: each scored alone (`/score`, within the context), their losses weighted by the
    tokens they score."""
    settings = Settings(store=store, models=[model], dtype="float32", compile_models=False)
    with TestClient(create_app(settings)) as client:
        scored = [client.post("/score", json={"model": model, "text": p}).json() for p in paragraphs]
    tokens = sum(s["scored_tokens"] for s in scored)
    return math.exp(sum(s["loss"] * s["scored_tokens"] for s in scored) / tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--kb", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--weights", type=Path, help="a trained checkpoint (.tar.gz) to score instead of training one")
    args = ap.parse_args()
    paragraphs = [p for p in args.text.read_text().split("\n\n") if p.strip()]
    held_out = paragraphs[-50:]
    user, size = [], 0
    for p in paragraphs[:-50]:
        if size + len(p) > args.kb * 1024:
            break
        user.append(p)
        size += len(p) + 2
    work = Path(tempfile.mkdtemp(prefix="bench-cog-training-"))
    (work / "text.txt").write_text("\n\n".join(user))
    t = time.perf_counter()
    archive = args.weights or run_training(work / "text.txt", args.minutes, 100_000, args.learning_rate, 1337, False)
    took = time.perf_counter() - t
    store = unpacked(str(archive))
    log = [json.loads(line) for line in (Path(archive).parent / "run" / "train_log.jsonl").read_text().splitlines()]
    before, after = perplexity(STORE_ROOT, "gpt-wikitext2", held_out), perplexity(store, "gpt-trained", held_out)
    best = min(log, key=lambda e: e["valid_loss"])
    print(f"{size / 1024:.0f} KB of text, {args.minutes:g}-minute budget: {log[-1]['step']} steps, {took:.0f} s "
          f"in all; valid loss {log[0]['valid_loss']} at step {log[0]['step']}, best {best['valid_loss']} at step "
          f"{best['step']} (what ships); held-out perplexity: shipped GPT {before:.1f}, trained {after:.1f} "
          f"({after / before:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
