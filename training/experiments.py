"""The attention-variant comparison: every variant trained with identical data, seed and budget.

`python -m training experiments` trains each variant of training/variants.py on a corpus with the
ordinary GPT trainer (resumable; a finished run is reused), then writes a markdown report with the
tables, sample generations and loss curves to docs/experiments/.

The first dev tokens are scored twice: in one forward pass per window, as in training, and one token
at a time through the KV cache, where no position can see a later one whatever the masking. For a
correctly masked model the two agree (a check); for the zero-mask demonstration the second is the
loss the model really has when it generates.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from tokenizers import Tokenizer

from model_store.store import load_gpt  # the store owns the checkpoint format
from models.gpt import GPT, GPTConfig
from models.options import option
from models.sampling import SamplingParams
from models.tokenizer import eos_id
from training import SHARED_DATA
from training.data import encode_documents, read_split, split_documents
from training.evaluate import corpus_perplexity, sentence_scores
from training.trainer import TrainConfig, train
from training.variants import DESCRIPTIONS, VARIANTS, variant_overrides

CORPORA = {
    "wikitext2": {"source": SHARED_DATA / "wikitext-2-raw", "doc_mode": "wikitext"},
    "tinystories": {"source": SHARED_DATA / "tinystories" / "tinystories_valid_sample.txt", "doc_mode": "paragraph"},
}
# the per-sentence test of the original attention experiments
SENTENCES = [
    "After learning language models model natural language.",
    "The quick brown fox jumps over the lazy dog.",
    "Amidst the twilight, the ancient ruins whispered secrets long forgotten.",
    "Quantum entanglement fascinates physicists and philosophers alike, bridging worlds with invisible threads.",
]
PROMPTS = {
    "wikitext2": ["The history of the city", "In 1998 , the band"],
    "tinystories": ["Once upon a time, there was a little", "Tom and his dog went to the park."],
}


@dataclass
class ExperimentConfig:
    corpus: Literal["wikitext2", "tinystories"] = option("wikitext2", "which shared corpus")
    data: str | None = option(None, "another source for the corpus (a folder or one file), e.g. a test fixture")
    runs: str = option("runs/experiments", "run folders (checkpoints, logs); a finished run is reused")
    out: str = option("docs/experiments", "where the report goes: CORPUS.md, CORPUS-loss.png, CORPUS.json")
    variants: list[str] = option(list(VARIANTS), "which variants", choices=list(VARIANTS))
    model: GPTConfig = field(
        default_factory=lambda: GPTConfig(
            n_layer=2, n_head=4, d_model=128, d_ff=512, context_length=64, dropout=0.0, tie_weights=True
        ),
        metadata={"help": argparse.SUPPRESS},  # the one shape every variant shares
    )
    vocab_size: int = option(4096, "BPE vocabulary, trained on the train split")
    batch_size: int = option(32, "windows per step")
    max_steps: int = option(400, "optimiser steps per variant (the same for all)", aliases=["--steps"])
    lr: float = option(1e-3, "peak learning rate")
    warmup_steps: int = option(50, "linear warmup steps")
    eval_interval: int = option(50, "steps between validation-loss checks")
    seed: int = option(1337, "seed for weights and batch order")
    export: list[str] = option([], "variants copied to STORE/gpt-CORPUS-VARIANT", choices=list(VARIANTS))
    store: str = option("model_store", "the model store the exports go to")
    leak_free_tokens: int = option(2048, "dev tokens scored one at a time through the KV cache")
    train_ppl_chars: int = option(500_000, "train perplexity on the first characters of the train split")


def corpus_folder(cfg: ExperimentConfig) -> Path:
    """A folder with train/valid/test.txt; a single-file corpus is split 90/5/5 by paragraphs, in order."""
    source = Path(cfg.data) if cfg.data else CORPORA[cfg.corpus]["source"]
    if source.is_dir():
        return source
    folder = Path(cfg.runs) / cfg.corpus / "data"
    if not (folder / "test.txt").exists():
        paragraphs = [p for p in re.split(r"\n\s*\n", source.read_text(encoding="utf-8")) if p.strip()]
        a, b = int(0.9 * len(paragraphs)), int(0.95 * len(paragraphs))
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", paragraphs[:a]), ("valid", paragraphs[a:b]), ("test", paragraphs[b:])):
            (folder / f"{split}.txt").write_text("\n\n".join(part) + "\n", encoding="utf-8")
    return folder


def windows(stream: torch.Tensor, n_tokens: int, context: int):
    """Consecutive windows of at most context + 1 tokens covering the first n_tokens predictions."""
    for start in range(0, min(n_tokens, len(stream) - 1), context):
        yield stream[start : min(start + context, n_tokens) + 1]


@torch.no_grad()
def leak_free_loss(model: GPT, stream: torch.Tensor, n_tokens: int) -> float:
    """Mean next-token loss over the first n_tokens of a stream, one token at a time via the KV cache."""
    model.eval()
    nll, n = 0.0, 0
    for window in windows(stream, n_tokens, model.config.context_length):
        cache = model.new_cache(1)
        for t in range(len(window) - 1):
            pos = torch.tensor([[t]], device=window.device)
            logits = model(window[t : t + 1].view(1, 1), input_pos=pos, cache=cache).logits[0, -1].float()
            nll += F.cross_entropy(logits, window[t + 1]).item()
            n += 1
    return nll / n


@torch.no_grad()
def full_pass_loss(model: GPT, stream: torch.Tensor, n_tokens: int) -> float:
    """The same tokens and windows as leak_free_loss, each window in one forward pass (as in training)."""
    model.eval()
    nll, n = 0.0, 0
    for window in windows(stream, n_tokens, model.config.context_length):
        logits = model(window[:-1].unsqueeze(0)).logits[0].float()
        nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
        n += len(window) - 1
    return nll / n


@torch.no_grad()
def samples(model: GPT, tokenizer: Tokenizer, prompts: list[str], n_new: int = 30) -> list[str]:
    params = SamplingParams(max_new_tokens=n_new, temperature=0.7, top_k=40, seed=0)
    out = []
    for p in prompts:
        ids = torch.tensor([tokenizer.encode(p, add_special_tokens=False).ids])
        new = model.generate(ids, params)
        out.append(p + tokenizer.decode(new[0].tolist()))
    return out


def dev_stream(cfg: ExperimentConfig, data: Path, tokenizer: Tokenizer) -> torch.Tensor:
    docs = split_documents(read_split(str(data), "valid"), CORPORA[cfg.corpus]["doc_mode"])
    return encode_documents(docs, tokenizer, eos_id(tokenizer))


def run_variant(cfg: ExperimentConfig, name: str, data: Path, tokenizer_path: Path) -> dict:
    """Train one variant (or reuse its finished run) and measure it."""
    run = Path(cfg.runs) / cfg.corpus / name
    if (run / "experiment.json").exists():
        result = json.loads((run / "experiment.json").read_text())
        if "full_pass_dev_loss" not in result:  # written before this column existed
            model, tokenizer = load_gpt(run / "model")
            stream = dev_stream(cfg, data, tokenizer)
            result["full_pass_dev_loss"] = round(full_pass_loss(model, stream, cfg.leak_free_tokens), 4)
            (run / "experiment.json").write_text(json.dumps(result, indent=2) + "\n")
        return result
    model_cfg = GPTConfig.from_dict({**cfg.model.to_dict(), **variant_overrides(name)})
    train_cfg = TrainConfig(
        data=str(data),
        out=str(run),
        tokenizer=str(tokenizer_path),
        doc_mode=CORPORA[cfg.corpus]["doc_mode"],
        model=model_cfg,
        batch_size=cfg.batch_size,
        max_steps=cfg.max_steps,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        eval_interval=cfg.eval_interval,
        save_interval=cfg.eval_interval,
        seed=cfg.seed,
        amp="off",
    )
    metrics = train(train_cfg, command=f"python -m training experiments --corpus {cfg.corpus} --variants {name}")
    model, tokenizer = load_gpt(run / "model")  # the exported checkpoint: what would be served
    doc_mode = CORPORA[cfg.corpus]["doc_mode"]
    valid_stream = dev_stream(cfg, data, tokenizer)
    train_text = read_split(str(data), "train")[: cfg.train_ppl_chars]
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    result = {
        "variant": name,
        "settings": model.config.attention_settings(),
        "parameters": metrics["parameters"],
        "train_time_s": metrics["wall_time_s"],
        "final_train_loss": metrics["final_train_loss"],
        "train_ppl": round(corpus_perplexity(model, tokenizer, train_text, doc_mode).token_ppl, 2),
        "dev_ppl": round(metrics["valid"]["token_ppl"], 2),
        "test_ppl": round(metrics["test"]["token_ppl"], 2),
        "dev_loss": round(math.log(metrics["valid"]["token_ppl"]), 4),
        "full_pass_dev_loss": round(full_pass_loss(model, valid_stream, cfg.leak_free_tokens), 4),
        "leak_free_dev_loss": round(leak_free_loss(model, valid_stream, cfg.leak_free_tokens), 4),
        "sentences": sentence_scores(model, tokenizer, SENTENCES),
        "samples": samples(model, tokenizer, PROMPTS[cfg.corpus]),
        "log": log,
    }
    (run / "experiment.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def step_times(cfg: ExperimentConfig, vocab_size: int, rounds: int = 3, steps: int = 4) -> dict[str, float]:
    """Seconds per training step of each variant, measured back to back in this process.

    The runs' wall times depend on whatever else the machine was doing; these are taken in
    interleaved rounds (median per variant) so the ratios between variants are fair.
    """
    models = {}
    for name in cfg.variants:
        torch.manual_seed(cfg.seed)
        config = GPTConfig.from_dict({**cfg.model.to_dict(), **variant_overrides(name), "vocab_size": vocab_size})
        model = GPT(config).train()
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randint(0, vocab_size, (cfg.batch_size, cfg.model.context_length), generator=torch.Generator())
    samples_s: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (model, opt) in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                model(x, x).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if r:
                samples_s[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(v) for name, v in samples_s.items()}


def run_experiments(cfg: ExperimentConfig) -> list[dict]:
    data = corpus_folder(cfg)
    tokenizer_path = Path(cfg.runs) / cfg.corpus / "tokenizer.json"
    results = []
    for name in cfg.variants:
        print(f"== {cfg.corpus}: {name}", flush=True)
        results.append(run_variant(cfg, name, data, tokenizer_path))
    cached = Path(cfg.runs) / cfg.corpus / "step_times.json"  # measured once, like the runs
    times = json.loads(cached.read_text()) if cached.exists() else {}
    if not set(cfg.variants) <= set(times):
        times = step_times(cfg, Tokenizer.from_file(str(tokenizer_path)).get_vocab_size())
        cached.write_text(json.dumps(times, indent=2) + "\n")
    for r in results:
        r["step_time_s"] = round(times[r["variant"]], 4)
    write_report(cfg, results)
    for name in cfg.export:  # the run's model/ folder is a complete store checkpoint (manifest included)
        shutil.copytree(
            Path(cfg.runs) / cfg.corpus / name / "model",
            Path(cfg.store) / f"gpt-{cfg.corpus}-{name}",
            dirs_exist_ok=True,
        )
    return results


def plot_losses(results: list[dict], path: Path, title: str) -> None:
    fig = Figure(figsize=(12, 4.5))  # object API: no pyplot global state
    ax_train, ax_dev = fig.subplots(1, 2, sharey=True)
    for r in results:
        steps = [e["step"] for e in r["log"]]
        style = dict(linestyle="--") if r["settings"]["masking"] == "zero_after" else {}
        ax_train.plot(steps, [e["train_loss"] for e in r["log"]], label=r["variant"], **style)
        ax_dev.plot(steps, [e["valid_loss"] for e in r["log"]], label=r["variant"], **style)
    for ax, name in ((ax_train, "training loss (batch)"), (ax_dev, "dev loss")):
        ax.set_title(f"{title}: {name}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_train.set_ylabel("cross-entropy (nats / token)")
    ax_dev.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(cfg: ExperimentConfig, results: list[dict]) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_losses(results, out / f"{cfg.corpus}-loss.png", cfg.corpus)
    m = cfg.model
    lines = [
        f"# Attention variants on {cfg.corpus}",
        "",
        f"Every variant: {m.n_layer} layers, d_model {m.d_model}, 4 heads (dual: 2 self-attention + 2 relational),",
        f"d_ff {m.d_ff}, context {m.context_length}, byte-level BPE vocabulary {cfg.vocab_size} trained on the train",
        f"split; {cfg.max_steps} steps x batch {cfg.batch_size} x {m.context_length} tokens, AdamW lr {cfg.lr}",
        f"(warmup {cfg.warmup_steps}, cosine), seed {cfg.seed}, fp32 on CPU: identical data, order and budget.",
        f"Command: `python -m training experiments --corpus {cfg.corpus} --steps {cfg.max_steps}`.",
        "",
        "| variant | parameters | step time (x dot) | training time | final train loss | train ppl | dev ppl "
        "| test ppl | dev loss, full pass | dev loss, one token at a time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r["step_time_s"] for r in results if r["variant"] == "dot"), results[0]["step_time_s"])
    for r in results:
        mins, secs = divmod(round(r["train_time_s"]), 60)
        lines.append(
            f"| {r['variant']} | {r['parameters']:,} "
            f"| {1000 * r['step_time_s']:.0f} ms ({r['step_time_s'] / base:.2f}x) "
            f"| {mins}:{secs:02d} | {r['final_train_loss']:.3f} "
            f"| {r['train_ppl']:.1f} | {r['dev_ppl']:.1f} | {r['test_ppl']:.1f} "
            f"| {r['full_pass_dev_loss']:.3f} | {r['leak_free_dev_loss']:.3f} |"
        )
    lines += [
        "",
        "Step time: one training step (forward, backward, AdamW) of each variant, measured back to back in one "
        "process (median of 3 interleaved rounds), so the ratios are fair; training time is the run's wall "
        "clock on a shared 2-core machine (other jobs ran beside it), not a comparison.",
        "Perplexities are per token (this vocabulary). Train ppl: the first "
        f"{cfg.train_ppl_chars:,} characters of the train split. The two dev-loss columns score the same first "
        f"{cfg.leak_free_tokens:,} dev tokens: in one forward pass per window (as in training), and one token at a "
        "time through the KV cache (what generation sees; no position can see a later one).",
        "",
        f"![loss curves]({cfg.corpus}-loss.png)",
        "",
        "## Per-sentence test loss (nats / token) and perplexity",
        "",
        "| sentence | " + " | ".join(r["variant"] for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for i, s in enumerate(SENTENCES):
        row = " | ".join(f"{r['sentences'][i]['loss']:.3f} ({r['sentences'][i]['ppl']:,.0f})" for r in results)
        lines.append(f"| {s} | {row} |")
    lines += ["", "## Samples (temperature 0.7, top-k 40, seed 0, 30 tokens)", ""]
    for r in results:
        lines.append(f"- **{r['variant']}** ({DESCRIPTIONS[r['variant']]}):")
        lines += [f"  - {json.dumps(s)}" for s in r["samples"]]
    path = out / f"{cfg.corpus}.md"
    path.write_text("\n".join(lines) + "\n")
    summary = {"config": asdict(cfg), "results": [{k: v for k, v in r.items() if k != "log"} for r in results]}
    (out / f"{cfg.corpus}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path
