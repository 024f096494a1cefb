"""What the compiler builds (compiler.py): a target's protocol, one pass of it, and the bucket sizes targets use."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, Protocol

import torch


class Compilable(Protocol):
    device: torch.device
    dtype: torch.dtype  # the coarsest its products round to: chooses the kernels
    check_rounding: torch.dtype  # the coarsest rounding on its path (int8: quantized layers'): the check's tolerance
    weights_bytes: int | None  # what its model's weights hold (what a step reads; kernel_choice.py)
    model: torch.nn.Module  # what `traced` reads
    traced: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]  # compiled whole; run eagerly, the reference
    # the decode step and the prompts' pass also have `regional`: the same function over `regional_model`, a copy
    # of the model whose blocks are one compile region (decoder/regional.py), traced with the weights as graph inputs
    # bucket -> compiled, written by BackgroundCompiler.run when built and checked; read by the target's own call
    compiled: dict[Hashable, Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]]

    def example(self, bucket: Hashable) -> tuple[torch.Tensor, ...]:
        """Scratch inputs of the bucket's shapes, the same values at every call (the function may write to them)."""
        ...

    def real_inputs(self, bucket: Hashable) -> tuple[torch.Tensor, ...]:
        """Inputs a real request gives the bucket (text's tokens, a cache its prompts filled), new at every call."""
        ...

    def logits(self, output) -> torch.Tensor:
        """The next-token logits (..., vocab) in what the function returned: what the check compares."""
        ...

    def matmul_rows(self, bucket: Hashable) -> int | None:
        """The rows of the bucket's matrix products (what picks their kernel); None: any (a dynamic dimension)."""
        ...


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Sizes with their own shapes: smallest, doubling while below limit, then limit."""
    sizes = [smallest]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    return [size for size in sizes if size < limit] + [limit]


class Pass(NamedTuple):
    """One graph to build: a target's bucket, whole (frozen on the CPU) or regional (the target's `regional`
    function, its blocks one region, the weights graph inputs: quick to build)."""

    target: Compilable
    bucket: Hashable
    regional: bool = False
