"""What a user sees of a GPT, for its model card: samples and the EOS-length table, and the command
that (re)writes a run's card into its exported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from models.gpt import GPT
from models.sampling import SamplingParams
from training.eos import eos_lengths, eos_table

SAMPLE_PROMPTS = ("The castle was built in", "In 1998, the band", "The species is found")


def samples_markdown(model: GPT, tokenizer: Tokenizer, prompts: tuple[str, ...] = SAMPLE_PROMPTS) -> str:
    """Greedy with a repetition penalty, and sampled at temperature 0.8 (top-k 40, seed 0), 60 tokens."""
    settings = {
        "greedy, repetition penalty 1.3": SamplingParams(max_new_tokens=60, temperature=0, repetition_penalty=1.3),
        "temperature 0.8, top-k 40, seed 0": SamplingParams(max_new_tokens=60, temperature=0.8, top_k=40, seed=0),
    }
    lines = []
    for name, params in settings.items():
        lines += [f"{name}:", ""]
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
            with torch.no_grad():
                text = tokenizer.decode(model.generate(ids, params)[0].tolist())
            lines.append(f"- {prompt}{text}".replace("\n", " ⏎ "))
        lines.append("")
    return "\n".join(lines).rstrip()


def eos_markdown(model: GPT, tokenizer: Tokenizer, prompt: str = "The castle was built in") -> str:
    return eos_table(eos_lengths(model, tokenizer, prompt), prompt, seeds=20, max_new_tokens=128)


def rewrite_card(run: Path, folder: Path, note: str = "") -> dict:
    """The run's card, with samples and EOS table of the exported weights (computed if the run has none)
    and a note (e.g. how it compares with the model it replaces), into `folder` (manifest too)."""
    from model_store.store import load_gpt, write_manifest
    from training.report import write_gpt_card

    run_config = json.loads((run / "run_config.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    if not metrics.get("samples") or not metrics.get("eos"):  # a run from before cards had them
        model, tokenizer = load_gpt(folder)
        metrics["samples"] = samples_markdown(model, tokenizer)
        metrics["eos"] = eos_markdown(model, tokenizer)
    card = write_gpt_card(cfg_dict=run_config["config"], metrics=metrics, command=run_config["command"])
    if note:
        card = card.replace("\n![loss curve]", f"\n## Notes\n\n{note.strip()}\n\n![loss curve]")
    (folder / "README.md").write_text(card)
    for path in (folder / "metrics.json", run / "metrics.json"):
        path.write_text(json.dumps(metrics, indent=2) + "\n")
    write_manifest(folder)
    return metrics
