"""The pilot table of docs/TRAINING.md, read from the run folders that `training/pilots.sh` writes.

Pilots with different tokenizers predict different numbers of tokens for the same text, so the dev
loss is also given per word: nats/token x tokens/word of the whole valid split under the pilot's own
tokenizer (the word-level perplexity the bar is written in, estimated from the fixed dev windows).
"""

from __future__ import annotations

import json
import math
import shlex
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from training import WIKITEXT2
from training.data import encode_documents, read_split, split_documents
from training.tokenizer import eos_id


@cache
def tokens_per_word(tokenizer_path: str, data: str, doc_mode: str) -> float:
    tok = Tokenizer.from_file(tokenizer_path)
    text = read_split(data, "valid")
    return len(encode_documents(split_documents(text, doc_mode), tok, eos_id(tok))) / len(text.split())


def pilot_row(run: Path) -> dict:
    """One pilot's figures: its settings, size, and dev loss along the way and at the end."""
    card = json.loads((run / "model" / "config.json").read_text())
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    command = (run / "model" / "README.md").read_text().split("- Command: `")[1].split("`")[0]
    args = shlex.split(command)
    option = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    ratio = tokens_per_word(option["--tokenizer"], option.get("--data", str(WIKITEXT2)), "wikitext")
    last = log[-1]
    return {
        "name": run.name,
        "shape": f"{card['n_layer']} x {card['d_model']}",
        "positions": card.get("positions", "sinusoidal"),
        "vocab": card["vocab_size"],
        "context": card["context_length"],
        "lr": option.get("--lr"),
        "dropout": card["dropout"],
        "weight_decay": option.get("--weight-decay"),
        "params": json.loads((run / "metrics.json").read_text())["parameters"],
        "steps": last["step"],
        "curve": {e["step"]: e["valid_loss"] for e in log},
        "best_valid": min(e["valid_loss"] for e in log),
        "final_train": last["train_loss"],
        "final_valid": last["valid_loss"],
        "word_ppl": math.exp(last["valid_loss"] * ratio),
        "tokens_per_word": ratio,
    }


def pilot_table(runs: Path, names: list[str]) -> str:
    """Markdown: one line a pilot, the given order (the first is the baseline the others are read against)."""
    rows = [pilot_row(runs / n) for n in names if (runs / n / "metrics.json").exists()]
    checkpoints = sorted({s for r in rows for s in r["curve"]})[-3:]
    head = ["pilot", "layers x width", "positions", "vocab", "context", "lr", "dropout", "wd", "parameters"]
    head += [f"dev loss @{s}" for s in checkpoints] + ["best dev loss", "final train loss", "dev word ppl (est.)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r["shape"], r["positions"], r["vocab"], r["context"], r["lr"], r["dropout"]]
        cells += [r["weight_decay"], f"{r['params']:,}"]
        cells += [f"{r['curve'][s]:.3f}" if s in r["curve"] else "" for s in checkpoints]
        cells += [f"{r['best_valid']:.3f}", f"{r['final_train']:.3f}", f"{r['word_ppl']:.0f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
