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


# ---------------------------------------------------------------- group-quantized weights (GGUF's blocks)


NIBBLE_CHUNK = 64  # columns whose codes share 32 bytes (K a multiple of it)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K / 2) bytes: a 64-column chunk's byte j holds code j low and code 32 + j high
    (what our kernel unpacks with one shift: server/execution/group_gemm.cpp)."""
    n, k = codes.shape
    chunks = codes.to(torch.uint8).view(n, k // NIBBLE_CHUNK, 2, NIBBLE_CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: (N, K / 2) bytes -> (N, K) codes 0..15."""
    n, half = packed.shape
    chunks = packed.view(n, half * 2 // NIBBLE_CHUNK, 1, NIBBLE_CHUNK // 2)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, half * 2)


BYTES_PER_CODE = {4: 1 / 2, 5: 5 / 8, 6: 3 / 4, 8: 1}  # a row's bytes per weight, by code width


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) codes as a layer holds them: 4 bits two a byte (pack_nibbles); 5 and 6 bits the same nibbles, then a
    plane a bit above them, 8 codes a byte (bit t of byte b: code 8b + t); 8 bits as signed bytes."""
    if bits == 8:
        return codes.to(torch.int8)
    n, k = codes.shape
    parts = [pack_nibbles(codes & 0x0F)]
    for bit in range(4, bits):
        plane = ((codes >> bit) & 1).to(torch.uint8).view(n, k // 8, 8) << torch.arange(8, dtype=torch.uint8)
        parts.append(plane.sum(-1, dtype=torch.uint8))
    return torch.cat(parts, dim=1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes' inverse: (N, K) codes (int8 for bits 8, else uint8)."""
    if bits == 8:
        return packed
    n = packed.shape[0]
    k = round(packed.shape[1] / BYTES_PER_CODE[bits])
    codes = unpack_nibbles(packed[:, : k // 2])
    for bit in range(4, bits):
        start = k // 2 + (bit - 4) * k // 8
        plane = (packed[:, start : start + k // 8].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        codes = codes | (plane.reshape(n, k) << bit)
    return codes


class GroupQuantLinear(nn.Module):
    """A linear layer whose weight is integer codes with a float32 scale (and zero) per group of 16 or 32 columns,
    w = code * scale + zero: GGUF's quantized types exactly (model_store/gguf_blocks.py), and float weights quantized
    on request (`quantize_int4`). Codes of up to 4 bits are held two a byte, of 5 and 6 bits as those and a plane a
    bit above (pack_codes; K a multiple of 64), others one signed byte each.

    `product`, when the server sets it, computes x @ w.T from the codes (server/execution/group_gemm.py: our kernel,
    which reads the codes once); without it the weight is dequantized into the activations' dtype for F.linear."""

    def __init__(
        self,
        codes: torch.Tensor,  # (N, K x BYTES_PER_CODE[bits]): pack_codes
        scales: torch.Tensor,  # (N, K / group) float32
        zeros: torch.Tensor | None,  # (N, K / group) float32, or None (0)
        bias: torch.Tensor | None,  # (N,)
        bits: int,
    ) -> None:
        super().__init__()
        self.bits = bits
        self.out_features, self.in_features = codes.shape[0], round(codes.shape[1] / BYTES_PER_CODE[bits])
        self.group = self.in_features // scales.shape[1]
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", bias)
        # the code width, kept beside the codes in the store (4 and 5 bits are both bytes)
        self.register_buffer("width", torch.tensor(bits, dtype=torch.int8))
        self.product: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        if self.product is not None:
            return self.product(x, self.codes, self.bits, self.scales, self.zeros, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) weight, computed in float32 (exact for GGUF's types), in dtype."""
        codes = unpack_codes(self.codes, self.bits)
        n, k = codes.shape
        w = codes.float().view(n, -1, self.group) * self.scales.unsqueeze(-1)
        if self.zeros is not None:
            w = w + self.zeros.unsqueeze(-1)
        return w.view(n, k).to(dtype)


def quantize_int4(model: nn.Module) -> nn.Module:
    """Every nn.Linear whose input width is a multiple of 64 becomes a GroupQuantLinear of 4-bit codes, groups of 32
    columns with a scale and a zero each (Q4_1's form: the group's minimum and (max - min) / 15), in place."""

    def int4(linear: nn.Linear) -> nn.Module:
        n, k = linear.weight.shape
        if k % NIBBLE_CHUNK:
            return linear
        w = linear.weight.detach().float().view(n, k // 32, 32)
        low, high = w.amin(-1), w.amax(-1)
        scales = ((high - low) / 15).clamp_min(1e-12)
        codes = ((w - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15).view(n, k)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return GroupQuantLinear(pack_nibbles(codes), scales, low, bias, bits=4)

    return replace_linears(model, int4)


class GroupQuantEmbedding(nn.Module):
    """A token embedding held as GroupQuantLinear's codes (a tied LM head is a GroupQuantLinear over the same
    buffers): a lookup dequantizes the rows it reads, in float32, then casts them to `dtype`."""

    def __init__(self, table: GroupQuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        t = self.table
        rows = t.codes[idx.flatten()]
        codes = unpack_codes(rows, t.bits)
        w = codes.float().view(rows.shape[0], -1, t.group) * t.scales[idx.flatten()].float().unsqueeze(-1)
        if t.zeros is not None:
            w = w + t.zeros[idx.flatten()].float().unsqueeze(-1)
        return w.view(*idx.shape, -1).to(self.dtype)


def attach_groups(model: nn.Module, layers: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """The model's linear layers (and token embedding) named in `layers` become GroupQuantLinear over the given
    codes, scales, zeros (and bias); a head tied to a quantized embedding is a GroupQuantLinear over its buffers."""
    for name, t in layers.items():
        bits = int(t["width"]) if "width" in t else 4 if t["codes"].dtype == torch.uint8 else 8
        layer = GroupQuantLinear(t["codes"], t["scales"], t.get("zeros"), t.get("bias"), bits)
        module_name = name.removesuffix(".table")
        parent, _, attribute = module_name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(getattr(owner, attribute), nn.Embedding):
            setattr(owner, attribute, GroupQuantEmbedding(layer, dtype))
            if getattr(getattr(model, "config", None), "tie_weights", False) and module_name == "tok_emb":
                model.lm_head = layer
        else:
            setattr(owner, attribute, layer)


def widen_groups(model: nn.Module, dtype: torch.dtype) -> None:
    """Every GroupQuantLinear becomes an nn.Linear of its dequantized weight in dtype (and a quantized embedding an
    nn.Embedding, the tied head sharing it), in place: where no kernel reads the codes, a float product is faster
    than dequantizing at every call."""
    for name, module in list(model.named_modules()):
        parent, _, attribute = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(module, GroupQuantEmbedding):
            table = module.table.dequantized(dtype)
            embedding = nn.Embedding(*table.shape, _weight=table, _freeze=True)
            setattr(owner, attribute, embedding)
            if isinstance(getattr(model, "lm_head", None), GroupQuantLinear) and model.lm_head is module.table:
                head = nn.Linear(table.shape[1], table.shape[0], bias=False)
                head.weight = embedding.weight
                model.lm_head = head
        elif isinstance(module, GroupQuantLinear) and getattr(owner, attribute, None) is module:
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight = nn.Parameter(module.dequantized(dtype), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.to(dtype), requires_grad=False)
            setattr(owner, attribute, linear)
