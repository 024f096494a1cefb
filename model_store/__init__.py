"""The model store: checkpoint folders beside this file, and the code that lists, validates and loads them.

The server reaches model code only through here.
"""

from model_store.store import (
    STORE_ROOT,
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    load_gpt,
    load_mlm,
    resolve,
    validate,
    write_checkpoint,
)
from training.kv_cache import KVCache
from training.model import GPT, GPTConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "STORE_ROOT",
    "CheckpointError",
    "CheckpointInfo",
    "list_checkpoints",
    "load_gpt",
    "load_mlm",
    "resolve",
    "validate",
    "write_checkpoint",
]
