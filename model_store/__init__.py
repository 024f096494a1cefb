"""The model store: checkpoint folders beside this file, and the code that lists, validates and loads them."""

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

__all__ = [
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
