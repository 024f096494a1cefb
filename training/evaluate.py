"""Perplexity of a GPT on a corpus split (token- and word-level) and on single sentences.

Word-level perplexity = exp(total NLL of the split / number of whitespace-separated words in its raw
text). It is independent of the tokenizer, so it compares with published WikiText-2 figures (e.g.
AWD-LSTM: 65.8 test) where token-level perplexity of a BPE model does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from models.gpt import GPT
from models.tokenizer import eos_id
from training.data import encode_documents, prepare_text, split_documents


@dataclass
class Perplexity:
    nll: float  # summed over scored tokens, nats
    tokens: int
    words: int

    @property
    def token_ppl(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def word_ppl(self) -> float:
        return math.exp(self.nll / self.words)

    def as_dict(self) -> dict:
        return {
            "token_ppl": round(self.token_ppl, 3),
            "word_ppl": round(self.word_ppl, 3),
            "tokens": self.tokens,
            "words": self.words,
        }


@torch.no_grad()
def stream_nll(model: GPT, stream: torch.Tensor, stride: int | None = None, batch_size: int = 16) -> tuple[float, int]:
    """Summed NLL of every token of the stream after the first, with sliding windows.

    Windows are context_length long and advance by `stride`; each token is scored once, in the first
    window where it has at least context_length - stride tokens of context (all of them near the start).
    """
    model.eval()
    L = model.config.context_length
    stride = stride or L // 2
    device = next(model.parameters()).device
    N = len(stream)
    # (window start, first target index to score) for each window; targets are positions 1..N-1
    windows, scored_to = [], 1
    for start in range(0, max(N - 1, 1), stride):
        end = min(start + L, N - 1)
        windows.append((start, scored_to - start, end - start))  # score targets [scored_to, end]
        scored_to = end + 1
        if end == N - 1:
            break
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        width = max(n for _, _, n in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        y = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (start, first, n) in enumerate(chunk):
            x[row, :n] = stream[start : start + n]
            y[row, first - 1 : n] = stream[start + first : start + n + 1]
        logits = model(x.to(device)).logits.float()
        y = y.to(device)
        total += F.cross_entropy(
            logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100, reduction="sum"
        ).item()
        count += int((y != -100).sum())
    return total, count


def corpus_perplexity(
    model: GPT,
    tokenizer: Tokenizer,
    raw: str,
    doc_mode: str = "wikitext",
    stride: int | None = None,
    detokenize: bool = False,
) -> Perplexity:
    """Token- and word-level perplexity of a raw-text split, prepared and encoded exactly as in training.

    Words are always counted in the raw split, so a model trained on detokenised text is divided by
    the same 241,211 test words as one trained on the tokenised text (lm-eval's wikitext task does
    the same)."""
    eos = eos_id(tokenizer)
    docs = split_documents(prepare_text(raw, detokenize), doc_mode)
    stream = torch.cat([torch.tensor([eos]), encode_documents(docs, tokenizer, eos)])
    nll, n = stream_nll(model, stream, stride)
    return Perplexity(nll=nll, tokens=n, words=len(raw.split()))


@torch.no_grad()
def sentence_scores(model: GPT, tokenizer: Tokenizer, sentences: list[str]) -> list[dict]:
    """Mean token loss and perplexity of each sentence, read as the start of a new document."""
    model.eval()
    device = next(model.parameters()).device
    eos = eos_id(tokenizer)
    out = []
    for s in sentences:
        ids = [eos] + tokenizer.encode(s, add_special_tokens=False).ids
        ids = ids[: model.config.context_length + 1]
        x = torch.tensor([ids[:-1]], device=device)
        y = torch.tensor([ids[1:]], device=device)
        loss = F.cross_entropy(model(x).logits.float()[0], y[0]).item()
        out.append({"sentence": s, "tokens": len(ids) - 1, "loss": round(loss, 4), "ppl": round(math.exp(loss), 2)})
    return out
