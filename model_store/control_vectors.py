"""llama.cpp's control-vector files: GGUF with architecture `controlvector` and one 1-D F32 tensor `direction.N` a
block, added to the residual stream after block N (0-based; llama.cpp rejects N = 0), the keys
`controlvector.model_hint` and `controlvector.layer_count`: what llama.cpp's cvector-generator and repeng write,
and what `llama-server --control-vector` reads. A store model's named vectors live in its folder as
vectors/NAME.gguf (`tinyserve store add-vector`)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

ARCHITECTURE = "controlvector"
VECTORS = "vectors"  # the folder of a store model's named vectors
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a vector's name: a file name in that folder, nothing more


class ControlVectorError(ValueError):
    """A file that is not a control vector, or not one for this model."""


def read_control_vector(path: Path) -> dict[int, torch.Tensor]:
    """block -> its direction (C,) float32, from a control-vector file."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # not GGUF at all
        raise ControlVectorError(f"{path.name}: not a GGUF file ({e})") from None
    arch = reader.fields.get("general.architecture")
    found = bytes(arch.parts[-1]).decode() if arch is not None else None
    if found != ARCHITECTURE:
        raise ControlVectorError(f"{path.name}: general.architecture is {found!r}, not {ARCHITECTURE!r}")
    directions = {}
    for t in reader.tensors:
        match = re.fullmatch(r"direction\.(\d+)", t.name)
        if match is None:
            continue
        block = int(match.group(1))
        if block < 1:
            raise ControlVectorError(f"{path.name}: {t.name}: blocks count from 1 (llama.cpp rejects 0)")
        if t.tensor_type != gguf.GGMLQuantizationType.F32 or len(t.shape) != 1:
            raise ControlVectorError(f"{path.name}: {t.name} is not a 1-D F32 tensor")
        directions[block] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    if not directions:
        raise ControlVectorError(f"{path.name}: no direction.N tensor")
    if len({v.numel() for v in directions.values()}) > 1:
        raise ControlVectorError(f"{path.name}: its directions differ in width")
    return dict(sorted(directions.items()))


def write_control_vector(path: Path, directions: dict[int, torch.Tensor], model_hint: str, layers: int) -> Path:
    """The directions as llama.cpp's file (layer_count: the model's blocks)."""
    writer = gguf.GGUFWriter(str(path), ARCHITECTURE)
    writer.add_string(f"{ARCHITECTURE}.model_hint", model_hint)
    writer.add_uint32(f"{ARCHITECTURE}.layer_count", layers)
    for block, vector in sorted(directions.items()):
        writer.add_tensor(f"direction.{block}", vector.detach().float().cpu().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_fits(directions: dict[int, torch.Tensor], layers: int, width: int, what: str) -> None:
    """ControlVectorError unless every direction is `width` wide and after a block 1..layers-1."""
    for block, vector in directions.items():
        if not 1 <= block < layers:
            raise ControlVectorError(f"{what}: direction.{block}: the model's blocks are 1..{layers - 1} here")
        if vector.numel() != width:
            raise ControlVectorError(f"{what}: direction.{block} is {vector.numel()} wide; the model's is {width}")


def model_shape(config: dict) -> tuple[int, int]:
    """(blocks, width) of a store model's config (ours or transformers')."""
    layers = config.get("n_layer", config.get("num_hidden_layers"))
    width = config.get("d_model", config.get("hidden_size"))
    if layers is None or width is None:
        raise ControlVectorError("the model's config names no layer count and width")
    return int(layers), int(width)


def add_vector(src: Path, name: str, folder: Path, config: dict) -> Path:
    """A control-vector file into a store model's folder as vectors/NAME.gguf, checked against its config."""
    if NAME.fullmatch(name) is None:
        raise ControlVectorError(
            f"name {name!r}: letters, digits, '_', '.', '-' (at most 64), not starting with a symbol"
        )
    directions = read_control_vector(src)
    check_fits(directions, *model_shape(config), src.name)
    (folder / VECTORS).mkdir(exist_ok=True)
    return write_control_vector(folder / VECTORS / f"{name}.gguf", directions, folder.name, model_shape(config)[0])
