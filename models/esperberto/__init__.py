"""EsperBERTo (a RoBERTa or ModernBERT masked LM on Esperanto) with softmax0/softmax1. Importing
registers softmax1 with transformers."""

from models.esperberto.attention import SOFTMAX1, softmax1_attention
from models.esperberto.model import PRESETS, VARIANTS, attn_implementation, build_model, make_config, save_model

__all__ = [
    "PRESETS",
    "SOFTMAX1",
    "VARIANTS",
    "attn_implementation",
    "build_model",
    "make_config",
    "save_model",
    "softmax1_attention",
]
