"""The model store: checkpoint folders beside this file, and the code that lists, validates and loads them.

Checkpoints enter the server only through here (validated, never unpickled).
"""

from model_store.store import (
    STORE_ROOT,
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    load_causal_lm,
    load_gpt,
    load_mlm,
    resolve,
    validate,
    write_checkpoint,
)
from models.gpt import GPT, GPTConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "STORE_ROOT",
    "CheckpointError",
    "CheckpointInfo",
    "list_checkpoints",
    "load_causal_lm",
    "load_gpt",
    "load_mlm",
    "resolve",
    "validate",
    "write_checkpoint",
]
