"""The linear layers of what runs uncompiled (prefills, decode steps not yet compiled), prepacked for
oneDNN on the CPU (bf16 where oneDNN computes it; float32 without AVX-512).

Until a row bucket's compiled step is ready (its build takes a while: docs/BENCHMARKS.md, "Compiling"), its
requests run the eager step, and an eager bf16 `F.linear` reorders its weight for oneDNN at every call, which
slows the step, the more so on a machine busy compiling, as it is then.
Freezing prepacks the compiled graphs' layers; this does the same for eager, on a copy of the model
that shares every other tensor, so the compiler still traces the plain model. An int8 layer keeps
aten's int8 kernel for the few-row products it serves faster (models/quantize.py) and gets its
dequantized weight prepacked for the rest (a prompt's prefill). A bf16 layer where the skinny kernel runs
(server/execution/skinny_gemm.py) reads the plain weight, the kernel a decode step's rows and oneDNN (through
`F.linear`) a prefill's: then nothing is prepacked and the model holds its weights once.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
import torch.nn as nn

from models import cpu
from models.quantize import WeightOnlyInt8Linear, replace_linears
from server.execution import skinny_gemm

# oneDNN's linear on a prepacked weight (or, where the skinny kernel is built, its op tinyserve::skinny_linear: the
# kernel for few rows, oneDNN for more), an opaque call to inductor: its own lowering of oneDNN's op takes frozen
# constants only, and a graph that takes the weights as inputs (compiler.py's regional builds) calls this. The
# kernel is chosen by the rows at each call, so one graph serves every row count (compiler.py, `shared_graph`).
# Registered on the dispatcher directly: torch.library.custom_op's wrappers cost more a call than the op itself.
LIBRARY = torch.library.Library("tinyserve", "DEF")
LIBRARY.define("prepacked_linear(Tensor x, Tensor? weight, Tensor? packed, Tensor? bias) -> Tensor")


def prepacked_linear(
    x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """Where the skinny kernel is not built (with it, its own op: PrepackedLinear.forward)."""
    if packed is None:  # one copy of the weights: oneDNN on the plain one
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


LIBRARY.impl("prepacked_linear", prepacked_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyserve::prepacked_linear", lib=LIBRARY)
def _(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None, bias: torch.Tensor | None):
    return x.new_empty((*x.shape[:-1], (weight if weight is not None else packed).shape[0]))


# oneDNN lays a weight out for the rows it expects. float32 laid out for one row made the eager step slower at more
# rows and one row no faster than laid out for 32; bf16 laid out for one row made the one-row head's product faster
# and more rows no slower.
PACKED_FOR_ROWS = {torch.float32: 32, torch.bfloat16: 1}
# A model whose linear layers hold at most this much keeps a prepacked copy beside the plain weights where the skinny
# kernel runs: the kernel serves up to its fastest rows (skinny_gemm.FASTEST_ROWS), oneDNN's prepacked linear the
# steps of more rows, 14-21 % faster at 16 and 32 (skinny_gemm.py). Above, the copy would cost more memory than it
# saves time: the kernel serves every decode bucket over the one copy.
BOTH_COPIES_MAX_BYTES = 256 * 2**20


class PrepackedLinear(nn.Module):
    """An nn.Linear whose weight is held in oneDNN's blocked layout (what inductor's freezing makes), or in bf16 where
    the skinny kernel runs as it is (the plain model's tensor), for the kernel and oneDNN alike."""

    def __init__(self, linear: nn.Linear | WeightOnlyInt8Linear, both_copies: bool = False) -> None:
        super().__init__()
        weight = linear.weight if isinstance(linear, nn.Linear) else linear.dequantized(linear.scales.dtype)
        bf16 = weight.dtype == torch.bfloat16 and (linear.bias is None or linear.bias.dtype == torch.bfloat16)
        plain = isinstance(linear, nn.Linear) and bf16 and skinny_gemm.usable()
        self.bias = linear.bias
        self.weight = weight.detach().contiguous() if plain else None  # the kernel's: the plain model's tensor
        # the kernel serves a decode step's rows, oneDNN a prefill's over the plain weight: one copy (skinny_gemm.py);
        # with both copies (a small model's: BOTH_COPIES_MAX_BYTES) the kernel its fastest rows, oneDNN's prepacked
        # linear the rest
        both_copies = plain and both_copies and skinny_gemm.max_rows() > skinny_gemm.FASTEST_ROWS
        self.kernel_rows = skinny_gemm.FASTEST_ROWS if both_copies else skinny_gemm.max_rows()
        rows = PACKED_FOR_ROWS.get(weight.dtype, 1)
        packs = not plain or both_copies
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows) if packs else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.weight is not None:  # the skinny kernel's op (C++): it, or oneDNN, by the rows at each call
            skinny = torch.ops.tinyserve.skinny_linear.default
            return skinny(x, self.weight, self.packed, self.bias, self.kernel_rows)
        # dynamo's own flag: is_compiling() is process-wide, true on the compute thread while another thread exports
        traced = torch.compiler.is_dynamo_compiling()
        linear = torch.ops.tinyserve.prepacked_linear.default if traced else prepacked_linear
        return linear(x, self.weight, self.packed, self.bias)


class PrepackedInt8Linear(nn.Module):
    """An int8 layer as it is for few rows, its dequantized weight prepacked for more."""

    def __init__(self, linear: WeightOnlyInt8Linear) -> None:
        super().__init__()
        self.int8, self.prepacked = linear, PrepackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return self.int8(x) if self.int8.kernel_serves(x) else self.prepacked(x)


def prepacks(model: nn.Module) -> bool:
    """Whether prepacking applies: bf16 weights where oneDNN computes bf16 (without AVX-512 its bf16
    reorder raises), float32 weights on a CPU without AVX-512 (aten's float32 products go to MKL, whose
    generic path there is slower than the prepacked layers, for a step and a prefill alike; with AVX-512 MKL's
    GEMM runs as it is). CUDA has no reorder."""
    p = next(model.parameters())
    if p.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    features = cpu.cpu_features()
    if p.dtype == torch.bfloat16:
        return features.onednn_bf16
    return p.dtype == torch.float32 and not features.avx512


def linear_bytes(model: nn.Module) -> int:
    """What the model's nn.Linear weights hold (a prepacked or frozen copy's size)."""
    return sum(m.weight.nbytes for m in model.modules() if isinstance(m, nn.Linear))


def prepacked_copy(model: nn.Module) -> nn.Module:
    """The model with every linear layer prepacked, sharing all its other parameters and buffers; the
    model itself where prepacking does not apply or finds no linear layer."""
    kinds = (nn.Linear, WeightOnlyInt8Linear)
    if not prepacks(model) or not any(isinstance(m, kinds) for m in model.modules()):
        return model
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    both = functools.partial(PrepackedLinear, both_copies=linear_bytes(model) <= BOTH_COPIES_MAX_BYTES)
    packed = replace_linears(copy.deepcopy(model, shared), both)
    return replace_linears(packed, PrepackedInt8Linear, kind=WeightOnlyInt8Linear)


def adopt_prepacked(model: nn.Module, prepacked: nn.Module) -> None:
    """The model's nn.Linear layers become `prepacked_copy(model)`'s layers in their place: the model then runs as
    its copy does, and its plain weights, read by nothing else once the compiler is done, are freed."""
    plain = dict(model.named_modules())
    for name, layer in prepacked.named_modules():
        if isinstance(layer, PrepackedLinear) and isinstance(plain.get(name), nn.Linear):
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, layer)
