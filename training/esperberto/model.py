"""EsperBERTo: Hugging Face `RobertaForMaskedLM` in two variants, softmax0 (standard) and softmax1.

The variant lives in config.json twice: `attention_variant` for people, and for softmax1 also
`attn_implementation: "softmax1"`, which `from_pretrained` reads back, so that loading a saved
checkpoint restores the variant once this package is imported (which registers the function).
A softmax0 checkpoint is a plain RoBERTa that loads anywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import RobertaConfig, RobertaForMaskedLM

from training.esperberto.attention import SOFTMAX1
from training.model import sinusoidal_encoding

VARIANTS = ("softmax0", "softmax1")

# "full" is the configuration of the original study (~84M parameters with its 52k vocabulary);
# "small" trains on 2 CPU cores in about an hour and stays under 25 MB.
PRESETS: dict[str, dict] = {
    "full": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=514, vocab_size=52_000),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                  max_position_embeddings=130, vocab_size=8192),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=66, vocab_size=400),
}  # fmt: skip


def make_config(preset: str, variant: str, vocab_size: int | None = None, **overrides) -> RobertaConfig:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: choose one of {VARIANTS}")
    params = {**PRESETS[preset], **overrides}
    if vocab_size is not None:
        params["vocab_size"] = vocab_size
    config = RobertaConfig(
        **params, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5
    )
    config.attention_variant = variant
    return config


def attn_implementation(variant: str, need_weights: bool = False) -> str:
    """The transformers attention function for a variant (eager when attention maps are wanted)."""
    if variant == "softmax1":
        return SOFTMAX1
    return "eager" if need_weights else "sdpa"


POSITION_INITS = ("random", "sinusoidal")


def build_model(config: RobertaConfig, seed: int = 0, position_init: str = "random") -> RobertaForMaskedLM:
    """A freshly initialised model; the same seed gives the same weights for both variants.

    position_init="sinusoidal" starts RoBERTa's learned position embeddings from the sinusoidal
    table (scaled to the embeddings' init std) instead of noise: nearby positions then start
    similar, which shortens the bag-of-words plateau small MLMs sit on before they use word order.
    """
    if position_init not in POSITION_INITS:
        raise ValueError(f"unknown position_init {position_init!r}: choose one of {POSITION_INITS}")
    torch.manual_seed(seed)
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


def save_model(model: RobertaForMaskedLM, folder: Path) -> None:
    """save_pretrained, plus the keys that make from_pretrained restore the variant."""
    model.save_pretrained(folder)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    variant = getattr(model.config, "attention_variant", "softmax0")
    config["attention_variant"] = variant
    if variant == "softmax1":
        config["attn_implementation"] = SOFTMAX1
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
