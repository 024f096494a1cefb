"""The named attention variants of the experiments: GPTConfig overrides on top of a 4-head base.

Every variant is an option of the one model file (models/gpt.py), not a copy of it.
"""

from __future__ import annotations

VARIANTS: dict[str, dict] = {
    "dot": {},  # the baseline: scaled dot product, separate Q/K/V, softmax, sinusoidal positions
    "additive": {"score": "additive"},
    "shared-qk": {"qkv_sharing": "qk"},
    "shared-qkv": {"qkv_sharing": "qkv"},
    "zero-mask": {"masking": "zero_after"},  # DEMONSTRATION ONLY: leaks the future
    "softmax1": {"softmax": "softmax1"},
    "learned-pos": {"positions": "learned"},
    "rope": {"positions": "rope"},
    "dual-relative": {"n_head": 2, "n_relational_head": 2, "symbol_type": "position_relative"},
    "dual-symbolic": {"n_head": 2, "n_relational_head": 2, "symbol_type": "symbolic_attention"},
}

DESCRIPTIONS: dict[str, str] = {
    "dot": "scaled dot-product scores, separate Q/K/V, softmax, sinusoidal positions",
    "additive": "additive scores w2 . tanh(W1 [q; k]) (Bahdanau)",
    "shared-qk": "one projection for queries and keys",
    "shared-qkv": "one projection for queries, keys and values",
    "zero-mask": "weights zeroed after the softmax instead of -inf before it (leaks the future: demo only)",
    "softmax1": "softmax1 normaliser exp(x_i) / (1 + sum_j exp(x_j))",
    "learned-pos": "learned absolute position embeddings",
    "rope": "rotary position embeddings on queries and keys",
    "dual-relative": "dual attention: 2 self-attention + 2 relational heads, position-relative symbols",
    "dual-symbolic": "dual attention: 2 self-attention + 2 relational heads, symbolic-attention symbols",
}


def variant_overrides(name: str) -> dict:
    try:
        return dict(VARIANTS[name])
    except KeyError:
        raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}") from None
