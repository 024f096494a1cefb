"""Per-request sampling: the logits pipeline and EOS downweighting (stop sequences are text: server/detokenizer.py).

One sampler for the serving engine and `GPT.generate` (so `python -m training complete` and the
server give the same tokens for the same prompt, parameters and seed).

Order of operations on a row of next-token logits (as in transformers' generate):
repetition penalty -> logit bias -> EOS bias (constant, or relaxing with length) -> min_new_tokens ->
temperature -> top-k -> top-p -> sample (greedy at temperature 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    min_new_tokens: int = 0  # EOS is impossible before this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output (CTRL-style)
    stop: list[str] = field(default_factory=list)  # stop sequences, matched on the decoded text
    seed: int | None = None  # same seed, same prompt, same params: same output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> additive bias
    eos_bias: float = 0.0  # additive bias on the end-of-text logit: < 0 = longer outputs, -inf = never stop
    eos_bias_decay: float | None = None  # in (0, 1]: the EOS bias shrinks by this factor per token ...
    eos_bias_start: int = 0  # ... after this many generated tokens (cf. exponential_decay_length_penalty)
    logprobs: bool = False  # report each chosen token's log-probability under the model
    top_logprobs: int = 0  # and this many most likely alternatives

    def eos_bias_at(self, generated: int) -> float:
        """The EOS bias for the next token after `generated` tokens: constant, or relaxing towards 0."""
        if self.eos_bias_decay is None or generated <= self.eos_bias_start or self.eos_bias == 0:
            return self.eos_bias
        return self.eos_bias * self.eos_bias_decay ** (generated - self.eos_bias_start)


def process_logits(
    logits: torch.Tensor,  # (V,) float32 raw logits of one row
    params: SamplingParams,
    seen: list[int],  # ids of prompt + generated tokens
    generated: int,
    eos_id: int,
) -> torch.Tensor:
    """Apply every adjustment except temperature/top-k/top-p; returns a new (V,) tensor."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0 and seen:
        ids = torch.tensor(sorted(set(seen)))
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    for tid, bias in params.logit_bias.items():
        logits[tid] += bias
    logits[eos_id] += params.eos_bias_at(generated)
    if generated < params.min_new_tokens:
        logits[eos_id] = float("-inf")
    return logits


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise temperature, top-k, top-p (nucleus) and a seeded draw."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    if not torch.isfinite(probs).all() or probs.sum() <= 0:  # every token banned: fall back to greedy
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(raw_logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token` under the model (before any sampling adjustment), and the top-N."""
    logp = torch.log_softmax(raw_logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = torch.topk(logp, top_n)
        top = [(int(i), float(v)) for i, v in zip(ids, vals, strict=True)]
    value = float(logp[token])
    return (value if math.isfinite(value) else -1e9), top
