"""The GPT's configuration: shapes and the attention variant, saved as the checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

from models.options import option
from models.softmax import LEGACY_NAMES, get_softmax

Score = Literal["dot", "additive"]
QKVSharing = Literal["none", "qk", "qkv"]
Masking = Literal["causal", "zero_after"]
Positions = Literal["sinusoidal", "learned", "rope"]
SymbolType = Literal["position_relative", "symbolic_attention"]


@dataclass
class GPTConfig:
    vocab_size: int = option(8192, "BPE vocabulary (a tokenizer trained by the run gets this size)")
    context_length: int = option(256, "longest sequence seen in training (tokens per window)")
    n_layer: int = option(6, "transformer blocks")
    n_head: int = option(8, "attention heads per block")
    d_model: int = option(256, "residual stream width")
    d_ff: int | None = option(None, "MLP hidden width (default 4 x d_model)")
    dropout: float = option(0.1, "dropout on embeddings and residual branches")
    attn_dropout: float = option(0.0, "dropout on attention probabilities (costly on CPU)")
    tie_weights: bool = option(True, "share the token embedding with the LM head")
    bias: bool = option(True, "biases in linear layers and LayerNorms")
    softmax: Literal["softmax0", "softmax1"] = option("softmax0", "attention normaliser (training/softmax.py)")
    eos_token_id: int = option(0, None)  # set from the tokenizer
    # attention variants (the defaults are the standard transformer)
    score: Score = option("dot", "q.k / sqrt(D), or additive w2 . tanh(W1 [q; k]) (Bahdanau)")
    qkv_sharing: QKVSharing = option("none", "one projection for queries and keys (qk), or for all three (qkv)")
    masking: Masking = option("causal", "-inf before the normaliser; zero_after LEAKS the future (demo only)")
    positions: Positions = option("sinusoidal", "added sinusoidal or learned table, or rope (rotates q and k)")
    n_relational_head: int = option(0, "relational-attention heads beside the n_head self-attention heads")
    n_relations: int = option(0, "relations r(x_i, x_j) per relational layer; 0 = as many as relational heads")
    symbol_type: SymbolType = option("position_relative", "relational symbols")
    n_symbols: int = option(64, "size of the symbol library for symbolic_attention")
    architecture: str = field(default="gpt", init=False)

    def __post_init__(self) -> None:
        heads = self.n_head + self.n_relational_head
        if self.n_head < 1 or self.n_relational_head < 0:
            raise ValueError(f"n_head={self.n_head} must be >= 1 and n_relational_head >= 0")
        if self.d_model % heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head + n_relational_head={heads}")
        self.d_ff = self.d_ff or 4 * self.d_model
        get_softmax(self.softmax)  # fail early on an unknown name
        self.softmax = LEGACY_NAMES.get(self.softmax, self.softmax)
        for name, allowed in VARIANT_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {allowed}")

    @property
    def n_attention_heads(self) -> int:
        """Every head that has attention weights: self-attention then relational."""
        return self.n_head + self.n_relational_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_attention_heads

    def attention_settings(self) -> dict:
        """The attention settings that differ between the experiment's variants."""
        keys = ("score", "qkv_sharing", "masking", "softmax", "positions", "n_head", "n_relational_head")
        out = {k: getattr(self, k) for k in keys}
        if self.n_relational_head:
            out |= {"n_relations": self.n_relations or self.n_relational_head, "symbol_type": self.symbol_type}
        return out

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


VARIANT_CHOICES = {
    name: get_args(kind)
    for name, kind in (
        ("score", Score),
        ("qkv_sharing", QKVSharing),
        ("masking", Masking),
        ("positions", Positions),
        ("symbol_type", SymbolType),
    )
}
