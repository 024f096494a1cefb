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
Norm = Literal["layernorm", "rmsnorm"]
MLPKind = Literal["gelu", "gelu_tanh", "swiglu", "geglu"]
LayerType = Literal["full", "sliding"]
RopePairs = Literal["interleaved", "half"]


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
    softmax: Literal["softmax0", "softmax1"] = option("softmax0", "attention normaliser (models/softmax.py)")
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
    # the options other decoder families need (model_store/families.py maps their checkpoints onto them);
    # the defaults are the from-scratch GPT's
    norm: Norm = option("layernorm", None)  # LayerNorm (with bias) or RMSNorm (no bias, normalised in float32)
    norm_eps: float = option(1e-5, None)
    mlp: MLPKind = option("gelu", None)  # GELU (erf), GELU's tanh approximation, SwiGLU: down(silu(gate) * up), or
    # GeGLU: down(gelu_tanh(gate) * up) (Gemma)
    # None below means derived (the properties head_dim, kv_heads, rotated_channels and has_bias resolve it):
    # a config changed with dataclasses.replace or from_dict derives it anew
    n_kv_head: int | None = option(None, None)  # grouped-query attention: key/value heads (default n_head)
    head_size: int | None = option(None, None)  # width of a head (default d_model / (n_head + n_relational_head))
    qkv_bias: bool | None = option(None, None)  # biases of the query/key/value projection (default `bias`)
    out_bias: bool | None = option(None, None)  # bias of attention's output projection (default `bias`)
    mlp_bias: bool | None = option(None, None)  # biases of the MLP (default `bias`)
    qk_norm: bool = option(False, None)  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    rope_theta: float = option(10000.0, None)
    rope_pairs: RopePairs = option("interleaved", None)  # rotate channels (2i, 2i+1), or (i, i + r/2) as HF
    rotary_dim: int | None = option(None, None)  # channels of a head that RoPE rotates (default all)
    rope_scaling: dict | None = option(None, None)  # {"rope_type": "linear" | "llama3" | "factors", ...}
    scale_embeddings: bool = option(True, None)  # token embedding x sqrt(d_model) (ours), or as stored
    parallel_residual: bool = option(False, None)  # x + attn(ln_1 x) + mlp(ln_2 x) (GPT-NeoX), not in sequence
    post_norms: bool = option(False, None)  # attention's and the MLP's outputs normed too, before each add (Gemma 3)
    attn_scale: float | None = option(
        None, None
    )  # scores x this (default head_dim^-0.5; Gemma: query_pre_attn_scalar^-0.5)
    # sliding-window attention (Gemma 3): the layers `layer_types` names "sliding" see keys less than sliding_window
    # positions before the query (q - k < window), with their own RoPE base; the others see every earlier key
    layer_types: list[str] | None = option(None, None)  # per layer "full" or "sliding" (default: every layer full)
    sliding_window: int | None = option(None, None)
    rope_local_theta: float | None = option(None, None)  # RoPE base of the sliding layers (default rope_theta)
    architecture: str = field(default="gpt", init=False)

    def __post_init__(self) -> None:
        heads = self.n_head + self.n_relational_head
        if self.n_head < 1 or self.n_relational_head < 0:
            raise ValueError(f"n_head={self.n_head} must be >= 1 and n_relational_head >= 0")
        if self.head_size is None and self.d_model % heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head + n_relational_head={heads}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.kv_heads}")
        if self.kv_heads != self.n_head and (self.qkv_sharing != "none" or self.n_relational_head):
            raise ValueError(
                "grouped-query attention (n_kv_head < n_head) needs qkv_sharing=none and no relational heads"
            )
        if self.rotated_channels % 2 or not 0 < self.rotated_channels <= self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even, > 0 and at most the head width {self.head_dim}"
            )
        if self.layer_types is not None:
            odd = sorted(set(self.layer_types) - set(get_args(LayerType)))
            if len(self.layer_types) != self.n_layer or odd:
                raise ValueError(f"layer_types must name 'full' or 'sliding' for each of the {self.n_layer} layers")
            if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError("sliding layers need sliding_window > 0")
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
        return self.head_size or self.d_model // self.n_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def rotated_channels(self) -> int:
        """The channels of each head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def gated(self) -> bool:
        """Whether the MLP's first product is cat(gate, up) (SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    def layer_type(self, i: int) -> str:
        """Layer i's attention: "full" or "sliding"."""
        return self.layer_types[i] if self.layer_types is not None else "full"

    def has_bias(self, part: str) -> bool:
        """Whether the linear layers of `part` (qkv, out, mlp) have biases."""
        own = getattr(self, f"{part}_bias")
        return self.bias if own is None else own

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
        ("norm", Norm),
        ("mlp", MLPKind),
        ("rope_pairs", RopePairs),
    )
}
