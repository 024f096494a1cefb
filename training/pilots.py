"""The pilot table of docs/TRAINING.md, read from the run folders that `training/pilots.sh` writes.

Pilots with different tokenizers predict different numbers of tokens for the same text, so the dev
loss is also given per word: nats/token x tokens/word of the whole valid split under the pilot's own
tokenizer (the word-level perplexity the bar is written in, estimated from the fixed dev windows).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from models.tokenizer import eos_id
from training.data import encode_documents, read_split, split_documents


@cache
def tokens_per_word(tokenizer_path: str, data: str, doc_mode: str) -> float:
    tok = Tokenizer.from_file(tokenizer_path)
    text = read_split(data, "valid")
    return len(encode_documents(split_documents(text, doc_mode), tok, eos_id(tok))) / len(text.split())


def pilot_row(run: Path) -> dict:
    """One pilot's figures from its run_config.json and train_log.jsonl (a pilot stopped early included)."""
    run_config = json.loads((run / "run_config.json").read_text())
    cfg, m = run_config["config"], run_config["config"]["model"]
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    ratio = tokens_per_word(cfg["tokenizer"], cfg["data"], cfg["doc_mode"])
    last = log[-1]
    return {
        "name": run.name,
        "shape": f"{m['n_layer']} x {m['d_model']}",
        "positions": m["positions"],
        "vocab": m["vocab_size"],
        "context": m["context_length"],
        "lr": cfg["lr"],
        "dropout": m["dropout"],
        "weight_decay": cfg["weight_decay"],
        "params": run_config["parameters"],
        "steps": f"{last['step']} of {cfg['max_steps']}",
        "curve": {e["step"]: e["valid_loss"] for e in log},
        "final_train": last["train_loss"],
        "tokens_per_word": ratio,
    }


def pilot_table(runs: Path, names: list[str], columns: int = 6) -> str:
    """Markdown, one line a pilot in the given order. The first is the baseline the others are read
    against: dev loss per token at the last `columns` evaluations, and per word at the last step each
    pilot shares with the baseline (pilots stopped early are compared where they stopped)."""
    rows = [pilot_row(runs / n) for n in names if (runs / n / "run_config.json").exists()]
    steps = sorted({s for r in rows for s in r["curve"]})[-columns:]
    head = ["pilot", "layers x width", "positions", "vocab", "context", "lr", "dropout", "wd", "parameters", "steps"]
    head += [f"dev loss @{s}" for s in steps] + ["dev nats/word (pilot vs baseline @step)", "last train loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = rows[0]
    for r in rows:
        shared = max(s for s in r["curve"] if s in base["curve"])
        per_word = (r["curve"][shared] * r["tokens_per_word"], base["curve"][shared] * base["tokens_per_word"])
        cells = [r["name"], r["shape"], r["positions"], r["vocab"], r["context"], r["lr"], r["dropout"]]
        cells += [r["weight_decay"], f"{r['params']:,}", r["steps"]]
        cells += [f"{r['curve'][s]:.3f}" if s in r["curve"] else "" for s in steps]
        cells += [f"{per_word[0]:.3f} vs {per_word[1]:.3f} @{shared}", f"{r['final_train']:.3f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
