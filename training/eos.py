"""How the EOS bias changes completion length: the figures the model card and docs/TRAINING.md give.

A completion that samples the end-of-text token before its limit has ended by itself (its paragraph
is over); `eos_bias < 0` makes that rarer, `> 0` sooner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from models.generation import continuations
from models.gpt import GPT
from models.sampling import SamplingParams

EOS_BIASES = (4.0, 0.0, -4.0, -8.0)


@dataclass
class EosRow:
    eos_bias: float
    mean_tokens: float  # generated tokens, the end-of-text token not counted
    ended_share: float  # completions that ended by themselves before the limit
    samples: list[str]  # one completion per seed


def eos_lengths(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    biases: tuple[float, ...] = EOS_BIASES,
    seeds: int = 20,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = 40,
) -> list[EosRow]:
    """Sample `seeds` completions of the prompt at each EOS bias (seeds 0..seeds-1, the same at every bias)."""
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
    rows = []
    for bias in biases:
        params = [
            SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, eos_bias=bias, seed=s)
            for s in range(seeds)
        ]
        outs = continuations(model, ids, params)  # the seeds as one batch, each sampled as alone
        lengths, samples = [len(out) for out in outs], [tokenizer.decode(out) for out in outs]
        ended = sum(n < max_new_tokens for n in lengths)
        rows.append(EosRow(bias, sum(lengths) / seeds, ended / seeds, samples))
    return rows


def bias_text(bias: float) -> str:
    return f"{bias:+g}" if bias else "0"


def eos_table(rows: list[EosRow], prompt: str, seeds: int, max_new_tokens: int) -> str:
    """Markdown: one line per bias, then one sample at each."""
    lines = [
        f"Prompt {prompt!r}, {seeds} seeds, at most {max_new_tokens} tokens, temperature 0.8, top-k 40:",
        "",
        "| eos_bias | mean completion length (tokens) | ended by itself |",
        "|---|---|---|",
    ]
    lines += [f"| {bias_text(r.eos_bias)} | {r.mean_tokens:.1f} | {r.ended_share:.0%} |" for r in rows]
    lines += ["", "Seed 0 at each bias (the prompt, then the completion):", ""]
    lines += [f"- `eos_bias {bias_text(r.eos_bias)}`: {prompt}{r.samples[0]}".replace("\n", " ⏎ ") for r in rows]
    return "\n".join(lines)
