"""The sampler: one call chooses the next token of every sequence in a batch, as tensor ops over the
batch's logits (stop sequences are text: server/engine/detokenizer.py).

One sampler for the serving engine and `GPT.generate` (so `python -m training complete` and the
server give the same tokens for the same prompt, parameters and seed). A seeded request draws from a
generator of its own, so its tokens do not depend on what else is in the batch.

Order of operations on each row of next-token logits (as in transformers' generate):
repetition penalty -> logit bias -> EOS bias (constant, or relaxing with length) -> min_new_tokens ->
temperature -> top-k -> top-p -> sample (greedy at temperature 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from models.steering import Steer


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    min_new_tokens: int = 0  # EOS is impossible before this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output (CTRL-style)
    stop: list[str] = field(default_factory=list)  # stop sequences, matched on the decoded text
    stop_token_ids: list[int] = field(default_factory=list)  # end the sequence as the end-of-text token does
    seed: int | None = None  # same seed, same prompt, same params: same output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> additive bias
    eos_bias: float = 0.0  # additive bias on the end-of-text logit: < 0 = longer outputs, -inf = never stop
    eos_bias_decay: float | None = None  # in (0, 1]: the EOS bias shrinks by this factor per token ...
    eos_bias_start: int = 0  # ... after this many generated tokens (cf. exponential_decay_length_penalty)
    logprobs: bool = False  # report each chosen token's log-probability under the model
    top_logprobs: int = 0  # and this many most likely alternatives
    constraint: object | None = None  # a compiled grammar at its start (llguidance's LLMatcher), copied per sequence
    steer: Steer | None = None  # vectors added to the residual stream after each block (models/steering.py)

    @property
    def greedy(self) -> bool:
        """The next token is the argmax of the logits with only the EOS bias and a constraint's mask
        applied: the decode step chooses it on the graph, with its logprob (server/execution/decoder/step.py),
        and no Python sampler runs for the row."""
        return (
            self.temperature == 0
            and self.repetition_penalty == 1.0
            and not self.logit_bias
            and not self.top_logprobs
            and not (self.stop_token_ids and (self.eos_bias or self.min_new_tokens))  # the graph biases EOS alone
        )

    def eos_bias_at(self, generated: int) -> float:
        """The EOS bias for the next token after `generated` tokens: constant, or relaxing towards 0."""
        if self.eos_bias_decay is None or generated <= self.eos_bias_start or self.eos_bias == 0:
            return self.eos_bias
        return self.eos_bias * self.eos_bias_decay ** (generated - self.eos_bias_start)


@dataclass
class SequenceState:
    """What the sampler reads of a running sequence besides its logits."""

    params: SamplingParams
    seen: list[int]  # prompt + generated ids (the repetition penalty's memory)
    generated: int
    generator: torch.Generator | None = None  # only where the request gave a seed
    matcher: object | None = None  # this sequence's copy of the constraint, advanced token by token
    consumed_ahead: int = 0  # tokens the matcher took when drawn (a multi-step run), not yet recorded here

    def __post_init__(self) -> None:
        if self.params.constraint is not None and self.matcher is None:
            self.matcher = self.params.constraint.deep_copy()

    def advance(self, token: int) -> bool:
        """Record a generated token; True when the constraint is complete (or broken): the sequence ends."""
        self.seen.append(token)
        self.generated += 1
        if self.matcher is None:
            return False
        if self.consumed_ahead:  # its state is the run's last token's: only that one may end the sequence
            self.consumed_ahead -= 1
            if self.consumed_ahead:
                return False
        else:
            self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()

    def consume_ahead(self, token: int) -> bool:
        """A token of a multi-step run into the constraint at once, so that the next step's mask follows it (advance
        records it later); True when the constraint is complete (or broken): the run stops there."""
        self.matcher.consume_token(token)
        self.consumed_ahead += 1
        return self.matcher.is_stopped() or self.matcher.is_error()

    def allowed_next(self, vocab_size: int) -> np.ndarray | None:
        """(V,) bool: the tokens the constraint allows next, or None where every token is allowed. Where the
        grammar may end here, so may the tokens that end the sequence as EOS does (a chat's end of turn)."""
        if self.matcher is None:
            return None
        allowed = allowed_tokens(self.matcher, vocab_size)
        if self.params.stop_token_ids and self.matcher.is_accepting():
            allowed[[t for t in self.params.stop_token_ids if t < vocab_size]] = True
        return allowed

    def eos_logit_bias(self, ahead: int = 0) -> float:
        """What the EOS logit of the token after the next `ahead` ones gets (0: the next token): the EOS bias,
        or -inf before min_new_tokens."""
        generated = self.generated + ahead
        if generated < self.params.min_new_tokens:
            return float("-inf")
        return self.params.eos_bias_at(generated)


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float | None = None  # under the model, before any adjustment; when asked for
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs, when asked for


def adjust_logits(logits: torch.Tensor, rows: list[SequenceState], eos_id: int) -> torch.Tensor:
    """(n, V) float32 raw logits -> a new tensor with every adjustment before temperature applied."""
    n, V = logits.shape
    out = logits.clone()
    penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 and r.seen]
    if penalised:
        mask = torch.zeros(n, V, dtype=torch.bool)
        for i in penalised:
            mask[i, torch.tensor(rows[i].seen)] = True
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], dtype=out.dtype).unsqueeze(1)
        out = torch.where(mask, torch.where(out > 0, out / penalty, out * penalty), out)
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
    if biased:
        i, t, b = zip(*biased, strict=True)
        out.index_put_((torch.tensor(i), torch.tensor(t)), torch.tensor(b, dtype=out.dtype), accumulate=True)
    out[:, eos_id] += torch.tensor([r.eos_logit_bias() for r in rows], dtype=out.dtype)
    for i, r in enumerate(rows):  # the tokens that end a sequence as EOS does get its bias too
        if r.params.stop_token_ids:
            out[i, r.params.stop_token_ids] += r.eos_logit_bias()
    for i, r in enumerate(rows):  # a constraint's mask: its disallowed tokens are impossible, whatever else says
        if r.matcher is not None:
            out[i].masked_fill_(~torch.from_numpy(r.allowed_next(V)), float("-inf"))
    return out


def greedy_choice(
    logits: torch.Tensor, eos_bias: torch.Tensor, eos_id: int, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) raw logits, (n,) EOS biases, (n, V) bool allowed tokens (a constraint's mask; all True for
    a free row) -> each row's argmax over its allowed tokens after its EOS bias, and that token's logprob
    under the model (before the bias and the mask). Tensor ops only: the decode step runs it on its graph."""
    raw = logits.float()
    columns = torch.arange(raw.shape[-1], device=raw.device)
    biased = torch.where(columns == eos_id, raw + eos_bias.unsqueeze(1), raw)
    if allowed is not None:
        biased = torch.where(allowed, biased, float("-inf"))
    greedy = biased.argmax(dim=-1)  # (n,)
    logprob = raw.gather(1, greedy.unsqueeze(1)).squeeze(1) - raw.logsumexp(dim=-1)  # (n,)
    return greedy, logprob


def reported_logprob(logprob: float) -> float:
    """A logprob as responses carry it: JSON has no -inf (a token the model rules out gets -1e9)."""
    return logprob if math.isfinite(logprob) else -1e9


def choose_tokens(logits: torch.Tensor, rows: list[SequenceState]) -> list[int]:
    """Adjusted (n, V) logits -> one token per row: greedy at temperature 0, otherwise temperature,
    top-k, top-p (nucleus) and a draw, seeded rows from their own generator."""
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, r in enumerate(rows) if r.params.temperature != 0]
    if not sampled:
        return tokens
    params = [rows[i].params for i in sampled]
    V = logits.shape[1]
    x = logits[sampled] / torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    ks = [p.top_k if p.top_k is not None and p.top_k < V else 0 for p in params]
    if any(ks):
        kth = x.topk(max(ks), dim=-1).values  # (m, max k), largest first
        floor = torch.stack([kth[j, k - 1] if k else x.new_tensor(float("-inf")) for j, k in enumerate(ks)])
        x = x.masked_fill(x < floor.unsqueeze(1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    nucleus = [p.top_p if p.top_p is not None and p.top_p < 1.0 else 2.0 for p in params]  # 2: keeps all
    if any(p < 1.0 for p in nucleus):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < torch.tensor(nucleus).unsqueeze(1)  # smallest set reaching p
        kept = torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)
        probs = torch.where(torch.tensor(nucleus).unsqueeze(1) < 1.0, kept, probs)
    usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # else every token banned: greedy
    fallback = x.argmax(dim=-1).tolist()
    unseeded = [j for j, i in enumerate(sampled) if rows[i].generator is None and usable[j]]
    if unseeded:  # one draw for every row without a seed
        for j, t in zip(unseeded, torch.multinomial(probs[unseeded], 1).squeeze(1).tolist(), strict=True):
            tokens[sampled[j]] = t
    for j, i in enumerate(sampled):
        if not usable[j]:
            tokens[i] = fallback[j]
        elif rows[i].generator is not None:  # a seeded row draws from its own stream, as when alone
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator))
    return tokens


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    """(V,) bool: the tokens a constraint allows next (llguidance's bitmask of its vocabulary, bit j of
    word i for token 32 i + j; ids past its vocabulary are not allowed)."""
    words = np.zeros(-(-vocab_size // 32), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].view(bool)


def sample(logits: torch.Tensor, rows: list[SequenceState], eos_id: int) -> list[Draw]:
    """The batch's next tokens from raw (n, V) logits, with the logprobs the rows asked for."""
    logits = logits.float()
    tokens = choose_tokens(adjust_logits(logits, rows, eos_id), rows)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
    if not wanted:
        return [Draw(t) for t in tokens]
    logp = torch.log_softmax(logits[wanted], dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in wanted]).unsqueeze(1)).squeeze(1).tolist()
    most = max(rows[i].params.top_logprobs for i in wanted)
    top_vals, top_ids = logp.topk(most, dim=-1) if most else (logp[:, :0], logp[:, :0].long())
    draws = [Draw(t) for t in tokens]
    for j, i in enumerate(wanted):
        k = rows[i].params.top_logprobs
        top = tuple(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
        draws[i] = Draw(tokens[i], reported_logprob(chosen[j]), top)
    return draws
