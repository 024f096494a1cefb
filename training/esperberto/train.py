"""Train an EsperBERTo variant with the Hugging Face Trainer, evaluate it, export it to the store.

Both variants see identical data in identical order (same data seed), start from identical weights
(same init seed) and get identical masks (the collator has its own seeded generator): the only
difference between the two runs is the attention normaliser. Every `eval_steps` a fixed held-out
slice is scored (loss, top-1/top-5, order gap) and the best checkpoint by held-out loss is kept.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    pipeline,
)

from models.esperberto.model import (
    PRESETS,
    MaskedLM,
    Preset,
    build_model,
    encoder,
    lm_logits,
    make_config,
    save_model,
)
from models.options import option
from training import SHARED_DATA
from training.esperberto.data import encode_blocks, read_corpus, split_lines, train_roberta_tokenizer


@dataclass
class MLMTrainConfig:
    out: str = field(metadata={"help": "run folder (Trainer checkpoints, heldout_log.jsonl, best/, model/)"})
    variant: Literal["softmax0", "softmax1"] = field(metadata={"help": "attention normaliser"})
    data: str = option(str(SHARED_DATA / "esperanto"), "folder of *.txt (a paragraph a line), or HF dataset id")
    export: str | None = option(None, "also write the best checkpoint to this model-store folder")
    tokenizer: str | None = option(None, "tokenizer folder shared by both variants (trained there if missing)")
    preset: Preset = option("rotary-small", "size and architecture: rotary-* = ModernBERT (shipped), others RoBERTa")
    vocab_size: int | None = option(None, "BPE vocabulary (default: the preset's)")
    dropout: float = option(0.0, "dropout everywhere (RoBERTa's own default, as in the original study: 0.1)")
    position_init: Literal["random", "sinusoidal"] = option("random", "initial position embeddings (RoBERTa)")
    block_size: int = option(128, "tokens per training block, <s> and </s> included")
    holdout_every: int = option(50, "every N-th line is held out for evaluation")
    batch_size: int = option(32, "blocks per step")
    max_steps: int = option(3000, "optimiser steps")
    lr: float = option(5e-4, "peak learning rate (linear warmup and decay)")
    warmup_steps: int = option(300, "linear warmup steps")
    weight_decay: float = option(0.01, "AdamW weight decay")
    adam_beta2: float = option(0.98, "AdamW beta2")
    mlm_probability: float = option(0.25, "share of tokens masked in training (BERT: 0.15; more helps, Wettig 2022)")
    eval_steps: int = option(250, "steps between evaluations and checkpoints")
    eval_blocks: int = option(200, "held-out blocks scored every eval_steps (a fixed slice)")
    seed: int = option(42, "seed for weights, data order and masks")
    bf16: bool = option(False, "bf16 autocast (CPU: AVX-512 bf16; CUDA: tensor cores)")
    threads: int | None = option(None, "torch intra-op threads (default: all cores; 1 each when two runs share 2)")


class MaskedPositionsTrainer(Trainer):
    """Trainer whose MLM loss runs the LM head on the masked positions only.

    The vocabulary projection of every position dominated the CPU step although only the masked
    ones carry a label; skipping the rest gives the same loss and gradients.
    """

    loss_is_scaled_for_ga = False  # a per-batch mean

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        # accelerate autocasts the model's own forward only; these calls go around it
        with self.accelerator.autocast():
            hidden = encoder(model)(
                input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask")
            ).last_hidden_state  # (B, T, C)
            masked = labels != -100  # (B, T)
            logits = lm_logits(model, hidden[masked])  # (N, vocab): N masked tokens
        loss = F.cross_entropy(logits.float(), labels[masked])
        return (loss, {"logits": logits}) if return_outputs else loss


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i]}


def load_or_train_tokenizer(cfg: MLMTrainConfig, train_lines: list[str]):
    """The shared tokenizer; trained and written atomically when missing, so that both variants may start at once."""
    folder = Path(cfg.tokenizer) if cfg.tokenizer else Path(cfg.out) / "tokenizer"
    if not (folder / "tokenizer.json").exists():
        tok = train_roberta_tokenizer(train_lines, cfg.vocab_size or PRESETS[cfg.preset]["vocab_size"])
        scratch = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        tok.save_pretrained(scratch)
        try:
            scratch.rename(folder)
        except OSError:  # the other variant's run wrote it first: the same data gives the same tokenizer
            shutil.rmtree(scratch)
    return AutoTokenizer.from_pretrained(folder)


def shuffle_inner(ids: torch.Tensor, labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permute each block's inner positions (not <s>, </s>), tokens and labels together."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = ids.clone(), labels.clone()
    for row in range(ids.shape[0]):
        perm = torch.randperm(ids.shape[1] - 2, generator=g) + 1
        ids[row, 1:-1] = ids[row, perm]
        labels[row, 1:-1] = labels[row, perm]
    return ids, labels


@torch.no_grad()
def evaluate_mlm(model: MaskedLM, tokenizer, blocks: torch.Tensor, batch_size: int = 32, seed: int = 0) -> dict:
    """Held-out MLM loss, top-1/top-5 of masked tokens, and the order gap; the same masks every call.

    The order gap is the loss on the same masked tokens with each block's tokens shuffled, minus the
    loss: ~0 for a bag-of-words model, which cannot use word order.
    """
    model.eval()
    device = next(model.parameters()).device
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=seed, return_tensors="pt")
    nll, shuffled_nll, n, top1, top5 = 0.0, 0.0, 0, 0, 0
    for i in range(0, len(blocks), batch_size):
        batch = collator([{"input_ids": b} for b in blocks[i : i + batch_size]])
        ids, labels = batch["input_ids"], batch["labels"]
        for shuffled, (x, y) in enumerate([(ids, labels), shuffle_inner(ids, labels, seed + i)]):
            y = y.to(device)
            sel = y != -100
            logits = lm_logits(model, encoder(model)(input_ids=x.to(device)).last_hidden_state[sel]).float()
            loss = F.cross_entropy(logits, y[sel], reduction="sum").item()
            if shuffled:
                shuffled_nll += loss
                continue
            nll += loss
            best5 = logits.topk(5, dim=-1).indices
            top1 += (best5[:, 0] == y[sel]).sum().item()
            top5 += (best5 == y[sel].unsqueeze(-1)).any(-1).sum().item()
            n += int(sel.sum())
    return {
        "mlm_loss": round(nll / n, 4),
        "perplexity": round(math.exp(nll / n), 2),
        "top1_accuracy": round(top1 / n, 4),
        "top5_accuracy": round(top5 / n, 4),
        "order_gap": round((shuffled_nll - nll) / n, 4),
        "masked_tokens": n,
    }


class HeldoutCallback(TrainerCallback):
    """At every logging step: score the fixed held-out slice, log a row, keep the best checkpoint."""

    def __init__(self, cfg: MLMTrainConfig, tokenizer, blocks: torch.Tensor) -> None:
        self.cfg, self.tokenizer, self.blocks = cfg, tokenizer, blocks
        self.best_dir = Path(cfg.out) / "best"
        self.log_path = Path(cfg.out) / "heldout_log.jsonl"
        best = self.best_dir / "heldout.json"
        self.best = json.loads(best.read_text())["mlm_loss"] if best.exists() else math.inf

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        start = time.time()
        h = evaluate_mlm(model, self.tokenizer, self.blocks, self.cfg.batch_size)
        model.train()
        row = {"step": state.global_step, "train_loss": logs["loss"], "valid_loss": h["mlm_loss"], **h}
        row["eval_s"] = round(time.time() - start, 1)
        row["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        with self.log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        if h["mlm_loss"] < self.best:
            self.best = h["mlm_loss"]
            save_model(model, self.best_dir)
            (self.best_dir / "heldout.json").write_text(json.dumps(row, indent=2) + "\n")


def read_log(path: Path, until_step: int | None = None) -> list[dict]:
    """Held-out rows (up to a step), the last one per step (a resumed run repeats steps)."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if until_step is None or row["step"] <= until_step:
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def train_mlm(cfg: MLMTrainConfig, command: str = "") -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train_lines, valid_lines = split_lines(read_corpus(cfg.data), cfg.holdout_every)
    tokenizer = load_or_train_tokenizer(cfg, train_lines)
    train_blocks = encode_blocks(train_lines, tokenizer, cfg.block_size)
    valid_blocks = encode_blocks(valid_lines, tokenizer, cfg.block_size)
    if len(valid_blocks) == 0:
        raise ValueError(f"held-out split has fewer than {cfg.block_size} tokens: lower --holdout-every")
    config = make_config(cfg.preset, cfg.variant, vocab_size=len(tokenizer), dropout=cfg.dropout)
    model = build_model(config, seed=cfg.seed, position_init=cfg.position_init)
    print(
        f"{cfg.variant}: {model.num_parameters():,} parameters, {train_blocks.numel():,} train tokens "
        f"({len(train_blocks)} blocks), {valid_blocks.numel():,} held-out tokens, {torch.get_num_threads()} threads"
    )

    use_cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        lr_scheduler_type="linear",
        weight_decay=cfg.weight_decay,
        adam_beta2=cfg.adam_beta2,
        max_grad_norm=1.0,
        seed=cfg.seed,
        data_seed=cfg.seed,
        eval_strategy="no",
        logging_steps=cfg.eval_steps,
        save_steps=cfg.eval_steps,
        save_total_limit=1,
        bf16=cfg.bf16,
        use_cpu=not use_cuda,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=cfg.mlm_probability, seed=cfg.seed)
    heldout = HeldoutCallback(cfg, tokenizer, valid_blocks[: cfg.eval_blocks])
    trainer = MaskedPositionsTrainer(
        model=model, args=args, train_dataset=Blocks(train_blocks), data_collator=collator, callbacks=[heldout]
    )
    last = sorted((out / "trainer").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    start = time.time()
    trainer.train(resume_from_checkpoint=str(last[-1]) if last else None)
    wall = time.time() - start

    best = type(model).from_pretrained(heldout.best_dir) if (heldout.best_dir / "config.json").exists() else model
    best_row = json.loads((heldout.best_dir / "heldout.json").read_text()) if best is not model else {}
    metrics = {
        "variant": cfg.variant,
        "preset": cfg.preset,
        "architecture": type(model).__name__,
        "parameters": model.num_parameters(),
        "steps": cfg.max_steps,
        "best_step": best_row.get("step", cfg.max_steps),
        "wall_time_s_this_invocation": round(wall, 1),
        "train_tokens": train_blocks.numel(),
        "config": asdict(cfg),
        "final_train_loss": next((e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e), None),
        "heldout": evaluate_mlm(best, tokenizer, valid_blocks, cfg.batch_size),
        "fill_mask": fill_mask_examples(best, tokenizer),
    }
    log = read_log(heldout.log_path, cfg.max_steps)
    export(best, tokenizer, out / "model", metrics, log, command)
    if cfg.export:
        export(best, tokenizer, Path(cfg.export), metrics, log, command)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics["heldout"], indent=2))
    return metrics


# simple sentences whose top 5 the model card shows: a verb, a noun, an adjective
FILL_MASK_EXAMPLES = ("La suno <mask>.", "Mi <mask> vin.", "La <mask> estas blua.", "Li estas tre <mask>.")


def fill_mask_examples(model: MaskedLM, tokenizer, texts=FILL_MASK_EXAMPLES) -> dict[str, list]:
    """{text: [(word, probability)] * 5} from transformers' own fill-mask pipeline."""
    fill = pipeline("fill-mask", model=model.eval(), tokenizer=tokenizer, device=model.device)
    return {t: [(r["token_str"].strip(), round(r["score"], 3)) for r in fill(t, top_k=5)] for t in texts}


def export(model, tokenizer, folder: Path, metrics: dict, log: list[dict], command: str) -> None:
    """A model-store checkpoint: HF files + our model card, metrics, loss curve and manifest."""
    from model_store.store import write_manifest
    from training.report import plot_mlm_curves, write_mlm_card

    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, folder)
    tokenizer.save_pretrained(folder)
    if log:
        plot_mlm_curves({metrics["variant"]: log}, folder / "loss_curve.png")
        (folder / "heldout_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    (folder / "README.md").write_text(write_mlm_card(metrics, command))
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_manifest(folder)
