"""`tinyserve store add SRC NAME`: a checkpoint folder enters the store, validated, copied, manifested.

SRC is one of ours (a folder `write_checkpoint` or `tinyserve export` wrote), a transformers model
saved with `save_pretrained` (safetensors weights, a tokenizer.json): a family of model_store/families.py
(served by our decoder), another causal LM (served by transformers) or an EsperBERTo masked LM; or a
GGUF file of a family both llama.cpp and our decoder compute (model_store/gguf_files.py). What
cannot be served safely is refused before anything is copied: pickled weights, remote code (`auto_map`
or .py files), an architecture no runner serves. The copy then loads as the server would load it; a
copy that does not load (a config value the decoder cannot compute exactly) is removed again.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from model_store.families import Family, family_of, served_names
from model_store.gguf_files import GGUFError
from model_store.gguf_import import import_gguf, is_gguf
from model_store.store import (
    MANIFEST,
    PICKLE_SUFFIXES,
    CheckpointError,
    load_causal_lm,
    load_gpt,
    load_mlm,
    resolve,
    write_manifest,
)

# configs, weights, vocabulary, card, chat template
COPIED_SUFFIXES = (".json", ".safetensors", ".txt", ".md", ".png", ".model", ".jinja")
LOADERS = {"decoder": load_gpt, "transformers": load_causal_lm, "fill-mask": load_mlm}  # by Family.runner


def check_source(src: Path) -> Family:
    """The source's family, or a CheckpointError naming the file and the rule it breaks."""
    if not (src / "config.json").is_file():
        raise CheckpointError(src, "not a checkpoint folder (no config.json)")
    for p in src.iterdir():
        if p.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(p, "pickle-format weights are never loaded; save with safetensors")
        if p.suffix == ".py":
            raise CheckpointError(p, "checkpoints with code (trust_remote_code) are not served")
    config = json.loads((src / "config.json").read_text())
    if "auto_map" in config:
        raise CheckpointError(src / "config.json", "auto_map names remote code; such checkpoints are not served")
    if not (src / "model.safetensors").is_file():
        raise CheckpointError(src / "model.safetensors", "missing: weights must be one safetensors file")
    family = family_of(config)
    if family is None:
        raise CheckpointError(
            src / "config.json",
            f"architecture {config.get('architectures') or config.get('architecture')!r} is not served "
            f"({served_names()})",
        )
    return family


def add_checkpoint(src: Path, name: str, root: Path, max_context: int | None = None) -> Path:
    """Copy the servable files of `src` into root/name with a card, metrics and a manifest; return it.
    The copy loads as the server will, its context capped at max_context (the server's setting).
    A GGUF file is first read into a folder of ours (weights dequantized, tokenizer rebuilt)."""
    src = Path(src)
    if src.suffix == ".gguf" or is_gguf(src):
        if not is_gguf(src):
            raise CheckpointError(src, "not a GGUF file (no GGUF magic bytes)")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                folder = import_gguf(src, Path(tmp) / name)
            except GGUFError as e:
                raise CheckpointError(src, str(e)) from None
            return add_checkpoint(folder, name, root, max_context)
    family = check_source(src)
    dst = resolve(name, root)
    if dst.exists():
        raise CheckpointError(dst, "already in the store; remove it first or choose another name")
    dst.mkdir(parents=True)
    try:
        for p in sorted(src.iterdir()):
            if p.is_file() and p.suffix in COPIED_SUFFIXES and p.name != MANIFEST:
                shutil.copyfile(p, dst / p.name)
        if not (dst / "README.md").exists():
            (dst / "README.md").write_text(f"# {name}\n\nAdded with `tinyserve store add` ({family.name}).\n")
        if not (dst / "metrics.json").exists():
            (dst / "metrics.json").write_text("{}\n")
        write_manifest(dst)
        if family.runner == "decoder":  # loads as the server will, or nothing is kept
            load_gpt(dst, max_context=max_context)
        else:
            LOADERS[family.runner](dst)
    except Exception:
        shutil.rmtree(dst)
        raise
    return dst
