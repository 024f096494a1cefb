"""Cog trainer: `cog train -i text=@corpus.txt` (or POST /trainings) fine-tunes the shipped GPT on a user's text
with the training package, or trains a new one, its tokenizer too (`from_scratch`), within a time and step
budget; the output is the trained checkpoint as a .tar.gz, which predict.py's `setup(weights)` serves (Replicate
passes it to a trained version; `COG_WEIGHTS` locally)."""

from __future__ import annotations

import asyncio
import json
import tarfile
import tempfile
from pathlib import Path

from cog import Input
from cog import Path as CogPath

from model_store import STORE_ROOT
from models.gpt import GPTConfig
from training.trainer import TrainConfig
from training.trainer import train as train_gpt
from training.user_text import corpus_folder

BASE = STORE_ROOT / "gpt-wikitext2"  # what a fine-tune starts from


async def train(
    text: CogPath = Input(description="A UTF-8 text file, or a zip of them (paragraphs: blocks between blank lines)."),
    minutes: float = Input(default=10.0, ge=0.1, le=120.0, description="Time budget of the training itself."),
    max_steps: int = Input(default=1000, ge=1, le=100_000, description="Optimiser steps at most (8 x 512 tokens)."),
    learning_rate: float = Input(default=3e-4, ge=1e-6, le=1e-2, description="Peak learning rate (cosine decay)."),
    seed: int = Input(default=1337, ge=0, le=2**31 - 1, description="Weights and batch order."),
    from_scratch: bool = Input(default=False, description="A new GPT and tokenizer, not the shipped GPT fine-tuned."),
) -> CogPath:
    """Async (the work on a thread of its own): the image's COG_MAX_CONCURRENCY, the runner's, also applies here."""
    return await asyncio.to_thread(run_training, Path(text), minutes, max_steps, learning_rate, seed, from_scratch)


def run_training(
    text: Path, minutes: float, max_steps: int, learning_rate: float, seed: int, from_scratch: bool
) -> CogPath:
    work = Path(tempfile.mkdtemp(prefix="tinyserve-train-"))
    data = corpus_folder(text, work / "data")
    model = GPTConfig.from_dict(json.loads((BASE / "config.json").read_text()))  # the shipped GPT's shape
    cfg = TrainConfig(
        out=str(work / "run"),
        data=str(data),
        export=str(work / "model"),
        init_from=None if from_scratch else str(BASE),
        doc_mode="paragraph",
        model=model,
        batch_size=8,
        max_steps=max_steps,
        lr=learning_rate,
        min_lr=learning_rate / 10,
        warmup_steps=min(100, max(1, max_steps // 10)),
        eval_interval=max(1, min(100, max_steps // 5)),
        eval_batches=5,
        save_interval=max_steps,
        seed=seed,
        time_limit_s=minutes * 60,
        final_eval=False,  # the card's samples and EOS study take minutes on a CPU: the log has each valid loss
    )
    train_gpt(cfg, command="cog train")
    archive = work / "weights.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work / "model", arcname="gpt-trained")
    return CogPath(archive)
