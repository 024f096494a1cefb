"""Where and how the models run: device, dtype, the weights' form and the kernels, each with the reason
(the setting or the CPU feature that chose it). Decided once at start-up, logged, and shown by /info."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models import cpu
from models.device import resolve_device
from models.quantize import INT8_KERNEL_MAX_ROWS, int8_kernel_dtype
from server.execution import skinny_gemm

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    weights: str  # "native" or "int8" (completion models' linear layers)
    kernels: str  # what computes the linear layers
    why: str  # the setting or CPU feature behind each choice
    cpu: cpu.CPUFeatures | None  # None on CUDA

    def describe(self) -> dict:
        """/info's `placement`."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.weights,
            "kernels": self.kernels,
            "why": self.why,
            "cpu": self.cpu.as_dict() if self.cpu is not None else None,
        }


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: half precision where the hardware computes it natively. A decode step reads every weight
    for one token, so bytes are time: bf16 runs a stream much faster than float32 where the CPU computes it
    (AVX512-BF16), with the same test perplexity. Without native bf16, a compiled bf16 step is faster at one row
    (half the bytes) but slower at many (docs/BENCHMARKS.md, "Why these paths")."""
    if name == "auto":
        if device.type == "cuda":
            return torch.float16
        return torch.bfloat16 if cpu.cpu_features().native_bf16 else torch.float32
    return DTYPES[name]


def plan(device_name: str, dtype_name: str, weights: str) -> Placement:
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    if device.type != "cpu":
        return Placement(device, dtype, weights, "inductor's Triton kernels, CUDA graphs", "device", None)
    f = cpu.cpu_features()
    native = "native bf16" if f.native_bf16 else "no AVX512-BF16 or AMX"
    why = [f"dtype={dtype_name}" + (f" ({native})" if dtype_name == "auto" else "")]
    compiled = "C++ GEMM template " + ("up to 4 rows, prepacked layers above" if f.avx512 else "at every row count")
    if dtype == torch.bfloat16 and skinny_gemm.usable():  # kernel_choice.template_serves: no frozen graph
        compiled = f"regional graphs: our AVX-512 BF16 kernel up to {skinny_gemm.max_rows()} rows, oneDNN above"
        uncompiled = f"our kernel up to {skinny_gemm.max_rows()} rows, oneDNN bf16 above"
        why.append("avx512_bf16: the skinny kernel")
    elif dtype == torch.bfloat16:
        uncompiled = "prepacked oneDNN bf16" if f.onednn_bf16 else "aten's bf16 fallback"
        why.append(f"oneDNN bf16 {'available' if f.onednn_bf16 else 'needs AVX-512'}")
    else:
        uncompiled = "aten (MKL)" if f.avx512 else "prepacked oneDNN float32"
    kernels = f"compiled steps: inductor's {compiled}; uncompiled: {uncompiled}"
    if weights == "int8":
        kernels = f"int8 few-row products: {int8_kernel_name(dtype)}; {kernels}"
        why.append("weights=int8")
    cpu_class = f.name if f.name.upper() == f.isa else f"{f.name} ({f.isa})"  # e.g. "amx (AVX512)"
    return Placement(device, dtype, weights, kernels, "; ".join(why) + f"; cpu {cpu_class}", f)


def int8_kernel_name(dtype: torch.dtype) -> str:
    """What computes a few-row int8 product for a model in dtype (for logs and /info)."""
    kernel_dtype = int8_kernel_dtype(dtype)
    activations = str(kernel_dtype).removeprefix("torch.") + " activations"
    if kernel_dtype != dtype:
        activations += " (aten's float32 int8 path is scalar without AVX-512)"
    few = f"aten's int8 kernel / inductor's int8 GEMM template (<= {INT8_KERNEL_MAX_ROWS} rows), {activations}"
    return f"{few}; more rows: the dequantized weight in {str(dtype).removeprefix('torch.')} (int8 is no faster there)"
