"""The GPT with its blocks one nested compile region: what the compiler builds regionally (compiler.py)."""

from __future__ import annotations

import copy
import types

import torch


def regional_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model, sharing every tensor, its blocks one nested compile region, traced and built for the first block
    and stamped out for the others (much quicker to build than one whole graph, the step as fast:
    bench/bench_compile.py). The weights are graph inputs (under freezing dynamo cannot lift them into the region:
    the model itself is left for whole, frozen graphs). Eager calls are unchanged."""

    def shallow(module: torch.nn.Module) -> torch.nn.Module:
        clone = copy.copy(module)  # its own attributes, the same tensors
        clone._modules = {name: shallow(child) for name, child in module._modules.items()}
        if type(module) is torch.nn.Linear:
            clone.forward = types.MethodType(rows_linear, clone)
        return clone

    regional, forward = shallow(model), type(model.blocks[0]).forward

    def residual(block: torch.nn.Module, *args) -> torch.Tensor:
        return forward(block, *args)[0]

    region = torch.compiler.nested_compile_region(residual)  # tensors only: dynamo stamps out no region with a None

    def block_forward(block: torch.nn.Module, *args) -> tuple:  # args[5]: return_attention; args[7], if given: steer
        return forward(block, *args) if args[5] else (region(block, *args), None)

    for block in regional.blocks:
        block.forward = types.MethodType(block_forward, block)
    return regional


def rows_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
    """nn.Linear over x's rows, as a 2-D product: the same sums as aten's linear, whose C++ decomposition of a
    3-D input reads its sizes as integers when a region's cache writes are functionalized: every prompts' pass over
    plain layers (float32 on AVX-512) specialised its dynamic group and length and failed, as did the decode graph
    its buckets of 2+ rows share."""
    return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias).view(*x.shape[:-1], -1)
