"""EsperBERTo: a Hugging Face masked LM in two variants, softmax0 (standard) and softmax1.

Two architectures, chosen by preset:
- "roberta": `RobertaForMaskedLM`, post-LayerNorm with learned absolute positions, the original
  study's model. On 2 CPU cores it stayed a bag of words (docs/esperberto/pilots.md).
- "modernbert": `ModernBertForMaskedLM`, pre-LayerNorm, rotary positions, GeGLU; every layer global
  attention (blocks are short) and the biases the kurtosis study measures switched on. This is the
  shipped one: with rotary positions the same-size encoder leaves the plateau within a few hundred steps.

The variant lives in config.json twice: `attention_variant` for people, and for softmax1 also
`attn_implementation: "softmax1"`, which `from_pretrained` reads back, so that loading a saved
checkpoint restores the variant once this package is imported (which registers the function).
A softmax0 checkpoint is a plain RoBERTa / ModernBERT that loads anywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import torch
from transformers import ModernBertConfig, ModernBertForMaskedLM, PretrainedConfig, RobertaConfig, RobertaForMaskedLM

from models.esperberto.attention import SOFTMAX1
from models.positions import sinusoidal_encoding

VARIANTS = ("softmax0", "softmax1")
Preset = Literal["tiny", "small", "full", "rotary-tiny", "rotary-small"]  # the keys of PRESETS
ARCHITECTURES = ("roberta", "modernbert")
MaskedLM = RobertaForMaskedLM | ModernBertForMaskedLM

# "full" is the configuration of the original study (~84M parameters with its 52k vocabulary).
# "rotary-small" is the shipped one (GeGLU width 768 ~ a 4x GELU MLP's parameters; under 25 MB).
PRESETS: dict[str, dict] = {
    "full": dict(architecture="roberta", hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=514, vocab_size=52_000),
    "small": dict(architecture="roberta", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=1024, max_position_embeddings=130, vocab_size=8192),
    "tiny": dict(architecture="roberta", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=66, vocab_size=400),
    "rotary-small": dict(architecture="modernbert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=768, max_position_embeddings=512, vocab_size=8192),
    "rotary-tiny": dict(architecture="modernbert", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=128, vocab_size=400),
}  # fmt: skip


def make_config(
    preset: str, variant: str, vocab_size: int | None = None, dropout: float | None = None, **overrides
) -> PretrainedConfig:
    """The preset's config for a variant; dropout None keeps the architecture's default (0.1 / 0)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: choose one of {VARIANTS}")
    params = {**PRESETS[preset], **overrides}
    architecture = params.pop("architecture")
    if vocab_size is not None:
        params["vocab_size"] = vocab_size
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)  # RoBERTa's special tokens
    if architecture == "roberta":
        if dropout is not None:
            params |= dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        config = RobertaConfig(**params, **ids, type_vocab_size=1, layer_norm_eps=1e-5)
    else:
        if dropout is not None:
            params |= dict(attention_dropout=dropout, mlp_dropout=dropout, embedding_dropout=dropout)
        config = ModernBertConfig(
            **params,
            **ids,
            cls_token_id=0,
            sep_token_id=2,
            layer_types=["full_attention"] * params["num_hidden_layers"],
            global_rope_theta=10_000.0,
            attention_bias=True,
            norm_bias=True,
            mlp_bias=True,
        )
    config.attention_variant = variant
    return config


def attn_implementation(variant: str, need_weights: bool = False) -> str:
    """The transformers attention function for a variant (eager when attention maps are wanted)."""
    if variant == "softmax1":
        return SOFTMAX1
    return "eager" if need_weights else "sdpa"


POSITION_INITS = ("random", "sinusoidal")


def build_model(config: PretrainedConfig, seed: int = 0, position_init: str = "random") -> MaskedLM:
    """A freshly initialised model; the same seed gives the same weights for both variants.

    position_init="sinusoidal" (RoBERTa only) starts the learned position embeddings from the
    sinusoidal table (scaled to the embeddings' init std) instead of noise.
    """
    if position_init not in POSITION_INITS:
        raise ValueError(f"unknown position_init {position_init!r}: choose one of {POSITION_INITS}")
    torch.manual_seed(seed)
    if isinstance(config, ModernBertConfig):
        if position_init != "random":
            raise ValueError("position_init applies to learned positions (roberta presets); rotary has none")
        model = ModernBertForMaskedLM(config)
    else:
        model = RobertaForMaskedLM(config)
    model.set_attn_implementation(attn_implementation(config.attention_variant))
    if position_init == "sinusoidal":
        table = model.roberta.embeddings.position_embeddings.weight  # (P, C)
        positions = torch.arange(table.size(0)).unsqueeze(0)  # (1, P)
        pe = sinusoidal_encoding(positions, table.size(1))[0]  # (P, C), std ~ 1/sqrt(2)
        with torch.no_grad():
            table.copy_(pe * config.initializer_range * math.sqrt(2))
            table[config.pad_token_id].zero_()  # as the random init does for padding_idx
    return model


def max_tokens(config: PretrainedConfig) -> int:
    """Longest input, special tokens included (RoBERTa's positions start after the padding index)."""
    return config.max_position_embeddings - (2 if isinstance(config, RobertaConfig) else 0)


def encoder(model: MaskedLM) -> torch.nn.Module:
    """The encoder without its LM head (RoBERTa: .roberta, ModernBERT: .model)."""
    return model.roberta if isinstance(model, RobertaForMaskedLM) else model.model


def lm_logits(model: MaskedLM, hidden: torch.Tensor) -> torch.Tensor:
    """(..., C) final hidden states -> (..., vocab) logits: the LM head alone."""
    if isinstance(model, RobertaForMaskedLM):
        return model.lm_head(hidden)
    return model.decoder(model.head(hidden))


def save_model(model: MaskedLM, folder: Path) -> None:
    """save_pretrained, plus the keys that make from_pretrained restore the variant."""
    model.save_pretrained(folder)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    variant = getattr(model.config, "attention_variant", "softmax0")
    config["attention_variant"] = variant
    if variant == "softmax1":
        config["attn_implementation"] = SOFTMAX1
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
