"""A from-scratch decoder-only transformer (GPT) for next-token completion.

Everything is written out here, nanoGPT-style: token embedding, sinusoidal positions ("Attention Is
All You Need"), multi-head causal self-attention whose heads are concatenated and projected (not
averaged: averaging stalled the original project's training), pre-LayerNorm blocks with a GELU MLP,
and an (optionally tied) language-model head. The attention normaliser is pluggable (softmax or
softmax1), the forward pass takes a KV cache for incremental decoding, and it can return every
layer's attention weights for attention maps.

Shapes: B batch, T new tokens, S = cached + new tokens (keys), C = d_model, H heads, D = C // H.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.softmax import get_softmax


@dataclass
class GPTConfig:
    vocab_size: int = 8192
    context_length: int = 256  # longest sequence seen in training
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 256
    d_ff: int = 1024  # hidden width of the MLP
    dropout: float = 0.1  # on embeddings and residual branches
    attn_dropout: float = 0.0  # on attention probabilities (costly on CPU: off by default)
    tie_weights: bool = True  # share the token embedding with the LM head
    bias: bool = True
    softmax: str = "softmax"  # "softmax" or "softmax1" (see training/softmax.py)
    eos_token_id: int = 0
    architecture: str = field(default="gpt", init=False)

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        get_softmax(self.softmax)  # fail early on an unknown name

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        d = {k: v for k, v in d.items() if k != "architecture"}
        unknown = set(d) - {f for f in cls.__dataclass_fields__ if f != "architecture"}
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GPTConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def sinusoidal_encoding(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i/C)), PE[p, 2i+1] = cos(...). (B, T) int -> (B, T, C) float.

    Computed from the positions on the fly, so any position (e.g. deep into a KV cache) works.
    """
    half = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
    inv_freq = torch.exp(-math.log(10000.0) * half / d_model)  # (C/2,)
    angles = positions.float().unsqueeze(-1) * inv_freq  # (B, T, C/2)
    pe = torch.zeros(*positions.shape, d_model, device=positions.device)
    pe[..., 0::2] = torch.sin(angles)
    pe[..., 1::2] = torch.cos(angles)
    return pe


class KVCache:
    """Per-layer keys and values of the tokens seen so far.

    Each layer has (B, H, capacity, D) buffers whose first `length` positions are filled; appending
    writes in place and the buffers grow geometrically, so a decode step costs O(1) copies, not a
    concatenation of the whole history.
    """

    def __init__(self, n_layer: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.filled = [0] * n_layer

    @property
    def length(self) -> int:
        return self.filled[-1]  # the last layer is updated last: this is the committed length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's (B, H, T, D) keys/values and return views of the full (B, H, S, D) ones."""
        start, T = self.filled[layer], k.shape[2]
        if self.keys[layer] is None or start + T > self.keys[layer].shape[2]:
            self._grow(layer, k, max(16, 2 * (start + T)))
        self.keys[layer][:, :, start : start + T] = k
        self.values[layer][:, :, start : start + T] = v
        self.filled[layer] = start + T
        return self.keys[layer][:, :, : start + T], self.values[layer][:, :, : start + T]

    def _grow(self, layer: int, like: torch.Tensor, capacity: int) -> None:
        B, H, _, D = like.shape
        for store in (self.keys, self.values):
            new = like.new_zeros(B, H, capacity, D)
            if store[layer] is not None:
                new[:, :, : self.filled[layer]] = store[layer][:, :, : self.filled[layer]]
            store[layer] = new

    # Batch surgery for continuous batching: rows are right-aligned (left-padded), so every row's
    # newest token sits in the last filled column and one forward pass serves rows of different lengths.

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (a finished request leaves the batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]

    def trim_left(self, n: int) -> None:
        """Drop the first n columns (padding that no remaining row needs)."""
        self.keys = [k[:, :, n:] for k in self.keys]
        self.values = [v[:, :, n:] for v in self.values]
        self.filled = [f - n for f in self.filled]

    @staticmethod
    def concat(caches: list[KVCache]) -> KVCache:
        """Stack caches along the batch, right-aligned: shorter ones are left-padded with zeros."""
        S = max(c.length for c in caches)
        capacity = max(S + 16, *(c.keys[0].shape[2] for c in caches))
        out = KVCache(len(caches[0].keys))
        for layer in range(len(out.keys)):
            out.keys[layer] = KVCache._right_aligned([c.keys[layer][:, :, : c.length] for c in caches], S, capacity)
            out.values[layer] = KVCache._right_aligned([c.values[layer][:, :, : c.length] for c in caches], S, capacity)
        out.filled = [S] * len(out.keys)
        return out

    @staticmethod
    def _right_aligned(parts: list[torch.Tensor], S: int, capacity: int) -> torch.Tensor:
        """(b_i, H, S_i, D) tensors -> one (sum b_i, H, capacity, D) buffer, each part ending at column S."""
        _, H, _, D = parts[0].shape
        buf = parts[0].new_zeros(sum(p.shape[0] for p in parts), H, capacity, D)
        row = 0
        for p in parts:
            buf[row : row + p.shape[0], :, S - p.shape[2] : S] = p
            row += p.shape[0]
        return buf


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)  # after concatenating heads
        self.attn_dropout = config.attn_dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.softmax_name = config.softmax
        self.softmax = get_softmax(config.softmax)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        mask: torch.Tensor | None,  # (B, 1, T, S) bool, True = may attend; None = causal (T == S) or T == 1
        layer: int,
        kv_cache: KVCache | None,
        return_attention: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, H, S, D)
        dropout_p = self.attn_dropout if self.training else 0.0

        weights = None
        if self.softmax_name == "softmax" and not return_attention:
            causal = mask is None and T > 1
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
        else:
            if mask is None:  # causal over T == S keys, or one query that sees them all
                mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])  # (B, H, T, S)
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf *before* the normaliser
            weights = self.softmax(scores, -1)
            y = F.dropout(weights, dropout_p, self.training) @ v  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # concatenate the heads
        return self.resid_dropout(self.proj(y)), weights


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x, mask, layer, kv_cache, return_attention):
        a, weights = self.attn(self.ln_1(x), mask, layer, kv_cache, return_attention)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, weights


@dataclass
class GPTOutput:
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None = None
    attentions: list[torch.Tensor] | None = None  # per layer, (B, H, T, S)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,  # (B, T) token ids
        targets: torch.Tensor | None = None,  # (B, T), -100 = ignore
        *,
        attention_mask: torch.Tensor | None = None,  # (B, S) 1 = real token, 0 = padding
        position_ids: torch.Tensor | None = None,  # (B, T); default: cache length + 0..T-1
        kv_cache: KVCache | None = None,
        return_attention: bool = False,
    ) -> GPTOutput:
        B, T = idx.shape
        past = kv_cache.length if kv_cache is not None else 0
        S = past + T
        if position_ids is None:
            position_ids = torch.arange(past, S, device=idx.device).expand(B, T)

        # key j is visible to query i iff j <= i (causal) and j is not padding; a query always sees
        # itself, so no row is empty (padding rows compute garbage that nobody reads).
        # None lets the fused attention kernel take its fastest path: plain causal when T == S, and
        # no mask at all for one new token after an unpadded cache (it may see every key).
        mask = None
        if (past and T > 1) or attention_mask is not None:
            mask = self._attention_mask(B, T, past, attention_mask, idx.device)

        x = self.tok_emb(idx) * math.sqrt(self.config.d_model)  # (B, T, C), scaled as in the paper
        x = self.drop(x + sinusoidal_encoding(position_ids, self.config.d_model).to(x.dtype))
        attentions = [] if return_attention else None
        for layer, block in enumerate(self.blocks):
            x, weights = block(x, mask, layer, kv_cache, return_attention)
            if attentions is not None:
                attentions.append(weights)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)

        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return GPTOutput(logits=logits, loss=loss, attentions=attentions)

    @staticmethod
    def _attention_mask(B: int, T: int, past: int, attention_mask: torch.Tensor | None, device) -> torch.Tensor:
        """(B, 1, T, S) bool: causal, minus padded keys, plus each query's own position."""
        S = past + T
        q_pos = torch.arange(past, S, device=device).view(T, 1)
        k_pos = torch.arange(S, device=device).view(1, S)
        mask = (k_pos <= q_pos).view(1, 1, T, S).expand(B, 1, T, S)
        if attention_mask is not None:
            if attention_mask.shape != (B, S):
                raise ValueError(f"attention_mask must be (B, S)=({B}, {S}), got {tuple(attention_mask.shape)}")
            mask = (mask & attention_mask.bool().view(B, 1, 1, S)) | (k_pos == q_pos).view(1, 1, T, S)
        return mask

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,  # (1, T) prompt
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_bias: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Minimal sampler (greedy at temperature 0) with a KV cache and an additive EOS logit bias.

        The prompt is cut to the last context_length tokens; generation stops at the context limit or
        at the end-of-text token. The serving engine has the full-featured sampler.
        """
        idx = idx[:, -self.config.context_length :]
        cache = KVCache(self.config.n_layer)
        logits = self(idx, kv_cache=cache).logits[:, -1]
        out = []
        for _ in range(min(max_new_tokens, self.config.context_length - idx.shape[1])):
            logits = logits.float()
            logits[:, self.config.eos_token_id] += eos_bias
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            if nxt.item() == self.config.eos_token_id:
                break
            out.append(nxt)
            logits = self(nxt, kv_cache=cache).logits[:, -1]
        return torch.cat(out, dim=1) if out else idx.new_zeros((1, 0))
