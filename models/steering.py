"""Activation steering: vectors added to the residual stream after blocks, at every position (activation addition;
llama.cpp's control vectors, whose `direction.N` is added after block N).

A request's steer is one (n_layer, C) float32 tensor, row l added after block l (zeros where nothing is added):
the form every pass takes (models/gpt.py, `forward(steer=...)`). Its digest names it where keys and values are
reused (the prefix cache: a steered prompt's blocks are its own).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class Steer:
    vectors: torch.Tensor  # (n_layer, C) float32, on the CPU
    key: str  # its digest

    @classmethod
    def of(cls, vectors: torch.Tensor) -> Steer:
        vectors = vectors.detach().to("cpu", torch.float32).contiguous()
        return cls(vectors, hashlib.blake2b(vectors.numpy().tobytes(), digest_size=16).hexdigest())

    @classmethod
    def added(cls, layers: int, width: int, parts: list[tuple[int, torch.Tensor, float]]) -> Steer:
        """The sum of scale x vector (C,) after each given block (0-based; several at one block add up)."""
        vectors = torch.zeros(layers, width)
        for layer, vector, scale in parts:
            vectors[layer] += scale * vector.float()
        return cls.of(vectors)


@contextlib.contextmanager
def steering_hooks(blocks: nn.ModuleList, vectors: torch.Tensor) -> Iterator[None]:
    """The same addition as forward hooks on the blocks (the first element of a block's output is its residual
    stream): what the served passes are tested against, and how a model without the `steer` input is steered."""

    def hook(layer: int):
        def add(module: nn.Module, args: tuple, output):
            if isinstance(output, tuple):
                return (output[0] + vectors[layer].to(output[0].dtype), *output[1:])
            return output + vectors[layer].to(output.dtype)

        return add

    handles = [block.register_forward_hook(hook(n)) for n, block in enumerate(blocks) if vectors[n].any()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
