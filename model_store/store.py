"""Checkpoint folders: write, list, validate and load them.

A checkpoint is a folder under the store root:

    config.json         architecture + hyper-parameters ("architecture": "gpt" | "mlm")
    model.safetensors   weights (safetensors only: nothing here ever unpickles)
    tokenizer.json      Hugging Face `tokenizers` file
    tokenizer_config.json  its special tokens, so `AutoTokenizer.from_pretrained(folder)` knows EOS (older
                        checkpoints without it still load here)
    README.md           model card; metrics.json: the same figures, machine-readable
    manifest.json       sha256 and size of every other file

Validation checks the manifest before any weight is read, so a corrupt or incomplete folder fails
with an error naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from model_store.digests import sha256_of
from model_store.families import Family, MissingTensor, decoder_checkpoint, family_of
from model_store.placement import Arena, cast, joining_in, read_placed
from model_store.weights_file import WeightsFile
from models.gpt import GPT, GPTConfig
from models.quantize import attach_groups
from models.tokenizer import EOS_TOKEN

STORE_ROOT = Path(__file__).resolve().parent
MANIFEST = "manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "README.md", "metrics.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CheckpointError(ValueError):
    """A checkpoint folder that must not be served; the message names the file and the problem."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def write_manifest(folder: Path) -> dict:
    """Record sha256 and size of every file in the folder (except the manifest itself)."""
    files = {
        p.name: {"sha256": sha256_of(p), "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_checkpoint(
    folder: Path,
    model: GPT,
    tokenizer: Tokenizer,
    card: str,
    metrics: dict,
    extra_files: dict[str, Path] | None = None,
    dtype: torch.dtype = torch.float16,
    tokenizer_config: dict | None = None,
    generation: dict | None = None,
) -> None:
    """Export a trained GPT as a store checkpoint (generation: generation_config.json's fields, if any).

    Weights are stored in half precision by default (half the bytes, within git's comfort; loading
    casts them to the serving dtype); a tied LM head is stored once, as the token embedding.
    """
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder / "config.json")
    state = {
        name: cast(t.detach().cpu(), dtype).contiguous()  # codes of quantized layers stay integers
        for name, t in model.state_dict().items()
        if not (model.config.tie_weights and name.startswith("lm_head."))
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    eos = tokenizer.id_to_token(model.config.eos_token_id) or EOS_TOKEN
    write_tokenizer(folder, tokenizer, model.config.context_length, **{"eos_token": eos, **(tokenizer_config or {})})
    (folder / "README.md").write_text(card)
    if generation:
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, folder / name)
    write_manifest(folder)


def write_tokenizer(folder: Path, tokenizer: Tokenizer, context_length: int, **settings) -> None:
    """tokenizer.json and the tokenizer_config.json that tells transformers (and through it lm-eval) which
    token ends a document (`settings` add to it or change it: a bos_token, a chat_template);
    PreTrainedTokenizerFast is the class every transformers version knows."""
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,  # byte-level BPE round-trips text exactly
        **settings,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def resolve(model_id: str, root: Path = STORE_ROOT) -> Path:
    """The folder of a model id; ids are plain names, so no id can reach outside the store."""
    if not MODEL_ID.match(model_id) or model_id in {".", ".."}:
        raise CheckpointError(Path(model_id), "invalid model id (letters, digits, '.', '_', '-'; no paths)")
    folder = (root / model_id).resolve()
    if folder.parent != root.resolve():
        raise CheckpointError(Path(model_id), "model id resolves outside the model store")
    return folder


def validate(folder: Path) -> dict:
    """Check the folder against its manifest; returns the parsed config.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(folder, "not a checkpoint folder")
    for p in folder.iterdir():
        if p.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(p, "pickle-format file in a checkpoint; only safetensors weights are loaded")
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(manifest_path, "missing manifest")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(manifest_path, f"unreadable manifest ({e})") from None
    for name in REQUIRED_FILES:
        if name not in files:
            raise CheckpointError(folder / name, "required file not listed in the manifest")
    for name, entry in files.items():
        path = folder / name
        if Path(name).name != name:
            raise CheckpointError(manifest_path, f"manifest entry {name!r} is not a plain file name")
        if not path.is_file():
            raise CheckpointError(path, "missing (listed in the manifest)")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                path, f"size {path.stat().st_size} bytes, manifest says {entry['bytes']} (truncated?)"
            )
        if sha256_of(path) != entry["sha256"]:
            raise CheckpointError(path, "sha256 does not match the manifest (corrupted or modified)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(folder / "config.json", f"invalid JSON ({e})") from None
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt"):
            pass
    except Exception as e:
        raise CheckpointError(folder / "model.safetensors", f"not a readable safetensors file ({e})") from None
    return config


@dataclass
class CheckpointInfo:
    id: str
    path: Path
    family: Family | None  # None: not served (or invalid)
    error: str | None  # why it cannot be served, or None

    @property
    def ok(self) -> bool:
        return self.error is None


def list_checkpoints(root: Path = STORE_ROOT) -> list[CheckpointInfo]:
    """Every checkpoint folder in the store, validated (invalid ones carry their error)."""
    infos = []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir() and (p / "config.json").exists()):
        try:
            config = validate(folder)
            infos.append(CheckpointInfo(folder.name, folder, family_of(config), None))
        except CheckpointError as e:
            infos.append(CheckpointInfo(folder.name, folder, None, str(e)))
    return infos


def load_gpt(
    folder: Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_context: int | None = None,
    arena: Arena | None = None,
) -> tuple[GPT, Tokenizer]:
    """Validate and load a checkpoint our decoder serves (ours, or a transformers family mapped onto it,
    its positions capped at max_context) in eval mode; shape mismatches name the tensor. arena: where the weights
    are read into, as they are served (model_store/placement.py; a CPU model's)."""
    folder = Path(folder)
    config_dict = validate(folder)
    if (family := family_of(config_dict)) is None or family.runner != "decoder":
        name = config_dict.get("architecture") or config_dict.get("architectures")
        raise CheckpointError(folder / "config.json", f"architecture {name!r} is not served by the decoder")

    def mapped(state: dict[str, torch.Tensor]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
        if family.name == "gpt":
            return GPTConfig.from_dict(config_dict), state
        return decoder_checkpoint(config_dict, state, max_context)

    with WeightsFile(folder / "model.safetensors") as f:  # cast one tensor at a time, the file not mapped
        layers = quantized_layers(f)  # group-quantized layers (a GGUF file's blocks): codes and float32 scales as kept
        names = [k for k in f.keys() if k.rpartition(".")[0] not in layers]
        if arena is not None:
            state = read_placed(f, names, dtype, lambda s: mapped(s)[1], arena)
        else:
            state = {k: cast(f.get_tensor(k), dtype) for k in names}
    try:
        with joining_in(arena) if arena is not None else contextlib.nullcontext():
            config, state = mapped(state)
    except MissingTensor as e:
        raise CheckpointError(folder / "model.safetensors", f"missing tensor {e}") from None
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(
            folder / "config.json", f"invalid or unsupported config ({type(e).__name__}: {e})"
        ) from None
    with torch.device("meta"):
        expected = GPT(config).state_dict()  # shapes only
    for name, tensor in state.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise CheckpointError(
                folder / "model.safetensors",
                f"tensor {name} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name].shape)}",
            )
    unexpected = [name for name in state if name not in expected]
    model = GPT.from_state(config, state)  # the file's tensors as cast: no float32 copy at random first
    try:
        attach_groups(
            model,
            {k: {n: cast(t, dtype) if n == "bias" else t for n, t in v.items()} for k, v in layers.items()},
            dtype,
        )
    except (AttributeError, ValueError, RuntimeError) as e:
        raise CheckpointError(folder / "model.safetensors", f"quantized layers do not fit the config ({e})") from None
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing or unexpected:
        raise CheckpointError(
            folder / "model.safetensors", f"missing tensors {missing}, unexpected tensors {unexpected}"
        )
    # a quantized model's codes, scales and zeros keep their types (its float tensors are cast already)
    model = model.to(device) if layers else model.to(device=device, dtype=dtype)
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
        raise CheckpointError(folder / "tokenizer.json", f"not a loadable tokenizer ({e})") from None
    if tokenizer.get_vocab_size() > config.vocab_size:  # embeddings may be padded past the vocabulary
        raise CheckpointError(
            folder / "tokenizer.json",
            f"vocabulary {tokenizer.get_vocab_size()} > config vocab_size {config.vocab_size}",
        )
    return model.eval(), tokenizer


def quantized_layers(f) -> dict[str, dict[str, torch.Tensor]]:
    """The file's group-quantized layers (models/quantize.py, GroupQuantLinear): module name -> its codes, scales,
    zeros and bias, as stored."""
    keys = set(f.keys())
    layers = {}
    for key in keys:
        if key.endswith(".codes"):
            module = key.removesuffix(".codes")
            parts = ("codes", "scales", "zeros", "bias", "width")
            layers[module] = {p: f.get_tensor(f"{module}.{p}") for p in parts if f"{module}.{p}" in keys}
    return layers


def load_mlm(folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Validate and load an EsperBERTo (RoBERTa or ModernBERT masked LM) checkpoint and its tokenizer, in eval mode.

    Importing models.esperberto registers softmax1, so a softmax1 checkpoint comes back as one.
    """
    from transformers import AutoModelForMaskedLM

    import models.esperberto  # noqa: F401  (registers the softmax1 attention function)

    return _load_transformers(folder, ("fill-mask",), AutoModelForMaskedLM, device, dtype)


def load_causal_lm(folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Validate and load a transformers causal LM checkpoint and its tokenizer, in eval mode, with eager
    attention (it returns attention weights for /attention): the slow path, for what our decoder does
    not map (and, for comparison, for what it does)."""
    from transformers import AutoModelForCausalLM

    return _load_transformers(
        folder, ("decoder", "transformers"), AutoModelForCausalLM, device, dtype, attn_implementation="eager"
    )


def _load_transformers(folder, runners: tuple[str, ...], auto_class, device, dtype, **kwargs):
    """A validated transformers checkpoint: safetensors weights only, never remote code."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    config = validate(folder)
    family = family_of(config)
    if family is None or family.runner not in runners or family.name == "gpt":
        name = config.get("architectures") or config.get("architecture")
        what = "masked LM" if runners == ("fill-mask",) else "causal LM"
        raise CheckpointError(folder / "config.json", f"{name!r} is not a transformers {what} checkpoint")
    try:
        model = auto_class.from_pretrained(folder, use_safetensors=True, dtype=dtype, trust_remote_code=False, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(folder, f"cannot be loaded by transformers ({e})") from None
    return model.to(device).eval(), tokenizer
