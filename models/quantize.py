"""Weight-only int8 linear layers (gpt-fast's int8 path): int8 weights with one scale per output
channel, activations in the model's dtype.

A decode step reads every weight once per token, so on a CPU its time is mostly bytes: int8 halves
bf16's. On the CPU, a product of few rows calls aten's `_weight_int8pack_mm` (int8 weights x bf16/fp32
activations; inductor lowers it to its C++ GEMM template or keeps aten's kernel); a product of more rows
dequantizes the weight into an ordinary linear product, which a compiler freezing the weights folds into
a constant and prepacks for oneDNN's GEMM (faster there than aten's int8 kernel: docs/BENCHMARKS.md, "Why these
paths"). Elsewhere the scales multiply the product (gpt-fast's form).

Without AVX-512, aten's int8 kernel is vectorized for bf16 activations only (its float32 path is
scalar: far slower than a float32 product there) and inductor's int8 GEMM template takes bf16
activations only; so a float32 model's int8 layers round their activations to bf16 for the kernel on
such CPUs (`kernel_dtype`), as a bf16 model's are everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import cpu

INT8_KERNEL_MAX_ROWS = 4  # products of more rows dequantize the weight (the module docstring says why)


class WeightOnlyInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # symmetric, per output channel
        self.register_buffer("weight", (w / scales.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8))
        dtype = linear.weight.dtype
        self.register_buffer("scales", scales.to(dtype))
        self.kernel_dtype = int8_kernel_dtype(dtype) if linear.weight.device.type == "cpu" else dtype
        # aten's kernel takes its scales in its activations' dtype; a bf16 -> float32 conversion of the
        # scales in `dequantized` would not be folded by a compiler, and would slow a many-row step
        kernel_scales = scales.to(self.kernel_dtype) if self.kernel_dtype != dtype else None
        self.register_buffer("kernel_scales", kernel_scales, persistent=False)
        self.register_buffer("bias", linear.bias.detach().clone() if linear.bias is not None else None)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if x.device.type != "cpu":
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        elif not self.kernel_serves(x):
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        else:
            rows = x.reshape(-1, self.in_features).to(self.kernel_dtype)  # (M, in)
            scales = self.kernel_scales if self.kernel_scales is not None else self.scales
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, scales).view(*x.shape[:-1], -1).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def kernel_serves(self, x: torch.Tensor) -> bool:
        """Whether aten's int8 kernel takes this product on the CPU: at most INT8_KERNEL_MAX_ROWS rows."""
        return x.numel() // self.in_features <= INT8_KERNEL_MAX_ROWS

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out, in) weight in dtype: each int8 row times its channel's scale, in float32. Inductor
        never folds an int8 -> bf16 conversion (it keeps it for its int8 kernels, and the product would
        dequantize at every call); int8 -> float32 it folds."""
        return (self.weight.float() * self.scales.float().unsqueeze(1)).to(dtype)


def int8_kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype aten's int8 kernel and inductor's int8 template get for a model in dtype:
    bf16 for a float32 model on a CPU without AVX-512 (the module docstring says why)."""
    if dtype == torch.float32 and not cpu.cpu_features().avx512:
        return torch.bfloat16
    return dtype


def replace_linears(module: nn.Module, make: Callable[[nn.Module], nn.Module], kind: type = nn.Linear) -> nn.Module:
    """Every layer of the given kind (nn.Linear) in the module becomes make(layer), in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, kind):
            setattr(module, name, make(child))
        else:
            replace_linears(child, make, kind)
    return module


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every nn.Linear of the model becomes a WeightOnlyInt8Linear, in place (a head tied to the
    embedding gets an int8 copy; the embedding keeps its weights)."""
    return replace_linears(model, WeightOnlyInt8Linear)
