"""Weight-only int8 linear layers (gpt-fast's int8 path): int8 weights with one scale per output
channel, activations in the model's dtype.

A decode step reads every weight once per token, so on a CPU its time is mostly bytes: int8 halves
bf16's. On the CPU the layer calls aten's `_weight_int8pack_mm` (int8 weights x bf16/fp32 activations,
traced by torch.compile like any aten op); elsewhere it dequantizes into the matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class WeightOnlyInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # symmetric, per output channel
        self.register_buffer("weight", (w / scales.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8))
        dtype = linear.weight.dtype
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", linear.bias.detach().clone() if linear.bias is not None else None)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return y + self.bias if self.bias is not None else y


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Every nn.Linear of the module becomes make(linear), in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            replace_linears(child, make)
    return module


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every nn.Linear of the model becomes a WeightOnlyInt8Linear, in place (a head tied to the
    embedding gets an int8 copy; the embedding keeps its weights)."""
    return replace_linears(model, WeightOnlyInt8Linear)
