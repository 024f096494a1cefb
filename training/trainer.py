"""Training loop for the from-scratch GPT: AdamW, warmup + cosine decay, clipping, periodic
validation, resumable checkpoints, bf16 autocast, optional torch.compile, and DDP under torchrun
(gloo on CPU, nccl on GPU).

At the end the run exports a model-store checkpoint (see model_store/) with its model card.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from models.device import resolve_device
from models.gpt import GPT, GPTConfig
from models.options import option
from models.tokenizer import eos_id
from training import WIKITEXT2
from training.card import eos_markdown, samples_markdown
from training.data import DocMode, encode_documents, prepare_text, random_windows, read_split, split_documents
from training.evaluate import corpus_perplexity, sentence_scores
from training.report import plot_loss_curve, write_gpt_card
from training.tokenizer import train_bpe

DEFAULT_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "The game was released in Japan in 2011 , and later in North America .",
    "After learning language models model natural language.",
]


@dataclass
class TrainConfig:
    out: str = field(metadata={"help": "run folder: checkpoint.pt, best.pt, train_log.jsonl, loss_curve.png, model/"})
    data: str = option(str(WIKITEXT2), "corpus folder with train/valid/test.txt, or HF id")
    export: str | None = option(None, "also write the shipped (best) checkpoint to this model-store folder")
    tokenizer: str | None = option(None, "tokenizer.json to use (default: OUT/tokenizer.json, trained if missing)")
    init_from: str | None = option(
        None, "model-store GPT folder whose weights start this run (a fresh optimiser and schedule; its tokenizer)"
    )
    doc_mode: DocMode = option("wikitext", "how the text splits into documents (an end-of-text token follows each)")
    detokenize: bool = option(False, "undo WikiText's tokenisation (' @,@ ' -> ',', ' , ' -> ', ') in every split")
    model: GPTConfig = field(default_factory=GPTConfig, metadata={"help": argparse.SUPPRESS})  # the model flags
    batch_size: int = option(32, "windows per process per micro-step")
    grad_accum: int = option(1, "micro-steps per optimiser step")
    max_steps: int = option(2000, "optimiser steps (the cosine schedule ends here)")
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = option(100, "linear warmup steps")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    grad_clip: float = option(1.0, "max global gradient norm")
    eval_interval: int = option(200, "steps between validation-loss checks")
    eval_batches: int = option(20, "validation batches per check (the same windows every time)")
    save_interval: int = option(200, "steps between resumable checkpoints")
    seed: int = option(1337, "seed for weights and batch order")
    device: str = option("auto", "auto (CUDA if present), cpu, cuda, cuda:N")
    amp: Literal["auto", "bf16", "off"] = option("auto", "bf16 autocast: auto = on CUDA only")
    compile: bool = option(False, "torch.compile the model")
    final_eval: bool = option(True, "full valid/test perplexity and the model card at the end")
    stop_at: int | None = option(None, "end this invocation after this step; rerun the command to resume")
    time_limit_s: float | None = option(None, "end the run (evaluated and exported) once it has trained this long")
    patience: int | None = option(None, "end the run after this many evaluations without a new best valid loss")
    ema_decay: float | None = option(
        None, "also keep an exponential moving average of the weights (e.g. 0.999); ships if its dev loss is lower"
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def evals_since_best(log: list[dict]) -> int:
    """How many evaluations ago the valid loss was lowest (0: the last one is the best)."""
    losses = [e["valid_loss"] for e in log]
    return len(losses) - 1 - losses.index(min(losses)) if losses else 0


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorm or positions)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def load_or_train_tokenizer(cfg: TrainConfig, train_text: str, is_main: bool, distributed: bool) -> Tokenizer:
    if cfg.tokenizer:
        path = Path(cfg.tokenizer)
    elif cfg.init_from:
        path = Path(cfg.init_from) / "tokenizer.json"
    else:
        path = Path(cfg.out) / "tokenizer.json"
    if not path.exists() and is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        train_bpe(split_documents(train_text, cfg.doc_mode), vocab_size=cfg.model.vocab_size).save(str(path))
    if distributed:
        dist.barrier()  # the other ranks wait for rank 0's tokenizer
    return Tokenizer.from_file(str(path))


def init_weights(model: GPT, folder: Path) -> None:
    """Copy a shipped GPT's weights into `model`; only settings that hold no weights may differ.

    RoPE holds no position weights, so a run can go on at a longer context than its start was trained at.
    """
    from model_store.store import load_gpt  # the store owns the on-disk format

    source, _ = load_gpt(folder)
    ours, theirs = model.state_dict(), source.state_dict()
    if ours.keys() != theirs.keys() or any(ours[k].shape != theirs[k].shape for k in ours):
        raise ValueError(f"--init-from {folder}: its weights do not fit this model's shape flags")
    model.load_state_dict(theirs)


def train(cfg: TrainConfig, command: str = "") -> dict:
    """Run (or resume) a training run; returns the final metrics."""
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    device = resolve_device(cfg.device)
    if distributed:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    is_main = rank == 0
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    train_text = prepare_text(read_split(cfg.data, "train"), cfg.detokenize)
    tokenizer = load_or_train_tokenizer(cfg, train_text, is_main, distributed)
    eos = eos_id(tokenizer)
    cfg.model.vocab_size = tokenizer.get_vocab_size()
    cfg.model.eos_token_id = eos
    train_stream = encode_documents(split_documents(train_text, cfg.doc_mode), tokenizer, eos)
    valid_raw = read_split(cfg.data, "valid")
    valid_text = prepare_text(valid_raw, cfg.detokenize)
    valid_stream = encode_documents(split_documents(valid_text, cfg.doc_mode), tokenizer, eos)

    model = GPT(cfg.model).to(device)  # same seed on every rank: identical initial weights
    ckpt_path, best_path, best_ema_path = out / "checkpoint.pt", out / "best.pt", out / "best_ema.pt"
    if cfg.init_from and not ckpt_path.exists():
        init_weights(model, Path(cfg.init_from))
    optimizer = make_optimizer(model, cfg)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay)) if cfg.ema_decay else None
    step, log = 0, []
    if ckpt_path.exists():  # resume: tensors and plain containers only (weights_only)
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        if ema is not None and "ema" in state:
            ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], json.loads(state["log"])
        if "rng" in state:  # dropout masks continue as if never interrupted (map_location moved it: back to the CPU)
            torch.set_rng_state(state["rng"].cpu())
        if "cuda_rng" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)
        if is_main:
            print(f"resumed from {ckpt_path} at step {step}")

    train_model: torch.nn.Module = torch.compile(model) if cfg.compile else model
    if distributed:
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)
    use_amp = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_amp else nullcontext()

    # each rank draws its own batches; the generator is reseeded from (seed, rank, step) every step, so
    # a resumed run sees the batches it would have seen
    gen, eval_gen = torch.Generator(), torch.Generator()

    def evaluate(net: torch.nn.Module) -> float:
        net.eval()
        eval_gen.manual_seed(cfg.seed)  # the same validation windows every time
        losses = []
        with torch.no_grad(), autocast:
            for _ in range(cfg.eval_batches):
                x, y = random_windows(valid_stream, cfg.batch_size, cfg.model.context_length, eval_gen)
                losses.append(net(x.to(device), y.to(device)).loss.item())
        model.train()
        return sum(losses) / len(losses)

    def save(state: dict, path: Path) -> None:
        if is_main:  # write then rename: an interrupted save never leaves a torn file
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            tmp.replace(path)

    def save_checkpoint() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        if ema is not None:
            state["ema"] = ema.state_dict()
        if device.type == "cuda":  # dropout draws from the device's generator there
            state["cuda_rng"] = torch.cuda.get_rng_state(device)
        save({**state, "log": json.dumps(log), "rng": torch.get_rng_state()}, ckpt_path)

    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.model.context_length * world
    if is_main:
        n_params, n_tokens = model.num_parameters(), len(train_stream)
        run = {"command": command, "parameters": n_params, "train_tokens": n_tokens, "config": asdict(cfg)}
        (out / "run_config.json").write_text(json.dumps(run, indent=2) + "\n")  # what a partial run was
        print(f"{n_params:,} parameters, {n_tokens:,} train tokens, {tokens_per_step:,} tokens/step, device {device}")
    start_time = time.time() - (log[-1]["elapsed_s"] if log else 0.0)
    model.train()
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not is_main, desc="train", dynamic_ncols=True)
    out_of_time = False
    while step < cfg.max_steps:
        gen.manual_seed(cfg.seed * 1000 + rank + 7919 * step)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss_sum = 0.0
        for micro in range(cfg.grad_accum):
            x, y = random_windows(train_stream, cfg.batch_size, cfg.model.context_length, gen)
            # DDP all-reduces gradients on the last micro-step only
            sync = nullcontext() if not distributed or micro == cfg.grad_accum - 1 else train_model.no_sync()
            with sync:
                with autocast:
                    loss = train_model(x.to(device), y.to(device)).loss / cfg.grad_accum
                loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update_parameters(model)
        step += 1
        out_of_time = cfg.time_limit_s is not None and time.time() - start_time >= cfg.time_limit_s
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}", lr=f"{lr_at(step - 1, cfg):.2e}")
        if step % cfg.eval_interval == 0 or step == cfg.max_steps or out_of_time:
            entry = {"step": step, "train_loss": round(loss_sum, 4), "elapsed_s": round(time.time() - start_time, 1)}
            entry["valid_loss"] = round(evaluate(model), 4)
            if entry["valid_loss"] < min((e["valid_loss"] for e in log), default=math.inf):
                save({"model": model.state_dict(), "step": step}, best_path)  # what ships: the best, not the last
            if ema is not None:
                entry["ema_valid_loss"] = round(evaluate(ema.module), 4)
                if entry["ema_valid_loss"] < min((e["ema_valid_loss"] for e in log), default=math.inf):
                    save({"model": ema.module.state_dict(), "step": step}, best_ema_path)
            log.append(entry)
            if is_main:
                bar.write(json.dumps(entry))
                with open(out / "train_log.jsonl", "a") as f:
                    f.write(json.dumps(entry) + "\n")
        if step % cfg.save_interval == 0 or step == cfg.max_steps or step == cfg.stop_at or out_of_time:
            save_checkpoint()
        if step == cfg.stop_at or evals_since_best(log) == cfg.patience or out_of_time:
            break
    bar.close()

    metrics: dict = {}
    ended = step == cfg.max_steps or evals_since_best(log) == cfg.patience or out_of_time
    if is_main and ended:
        best_ema = min((e["ema_valid_loss"] for e in log if "ema_valid_loss" in e), default=math.inf)
        shipped = best_ema_path if best_ema < min(e["valid_loss"] for e in log) else best_path
        if shipped.exists():
            model.load_state_dict(torch.load(shipped, map_location=device, weights_only=True)["model"])
        metrics = finish_run(cfg, model, tokenizer, log, valid_raw, command, ema=shipped == best_ema_path)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return metrics


def finish_run(
    cfg: TrainConfig, model: GPT, tokenizer: Tokenizer, log: list[dict], valid_raw: str, command: str, ema: bool = False
) -> dict:
    """Final evaluation, loss curve, and the exported model-store checkpoint with its card."""
    from model_store.store import write_checkpoint  # the store owns the on-disk format

    out = Path(cfg.out)
    model.eval()
    with torch.no_grad():  # evaluate exactly what ships: weights rounded to the stored half precision
        for p in model.parameters():
            p.copy_(p.half().float())
    key = "ema_valid_loss" if ema else "valid_loss"
    best = min(log, key=lambda e: e[key]) if log else {}
    metrics: dict = {
        "steps": log[-1]["step"] if log else 0,
        "best_step": best.get("step", 0),
        "best_valid_loss": best.get(key),
        "weights": "ema" if ema else "raw",
        "wall_time_s": log[-1]["elapsed_s"] if log else 0.0,
        "parameters": model.num_parameters(),
        "final_train_loss": log[-1]["train_loss"] if log else None,
        "final_valid_loss": log[-1]["valid_loss"] if log else None,
    }
    if cfg.final_eval:
        for split, raw in (("valid", valid_raw), ("test", read_split(cfg.data, "test"))):
            metrics[split] = corpus_perplexity(model, tokenizer, raw, cfg.doc_mode, detokenize=cfg.detokenize).as_dict()
        metrics["sentences"] = sentence_scores(model, tokenizer, DEFAULT_SENTENCES)
        metrics["samples"] = samples_markdown(model, tokenizer)
        metrics["eos"] = eos_markdown(model, tokenizer)
    plot_loss_curve(log, out / "loss_curve.png")
    card = write_gpt_card(cfg_dict=asdict(cfg), metrics=metrics, command=command)
    for folder in [out / "model"] + ([Path(cfg.export)] if cfg.export else []):
        write_checkpoint(
            folder, model, tokenizer, card=card, metrics=metrics, extra_files={"loss_curve.png": out / "loss_curve.png"}
        )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    return metrics
