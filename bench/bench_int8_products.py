"""Integer products for int8 models at many rows, measured and not built: each row of activations quantized to
int8 by its absolute maximum, multiplied with the int8 weight by `torch._int_mm` (oneDNN), against the float32
products the server runs there (inductor's C++ GEMM template, frozen), for the GPT's 17 products.

    .venv/bin/python bench/bench_int8_products.py [--rows 8,32] [--weight-max 127]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/bench_int8_products.py  # AVX2

Prints per row count: whether oneDNN's products equal exact integer arithmetic (its AVX2 kernel without VNNI
adds byte pairs into saturating 16-bit sums: --weight-max 63 keeps them exact), the float32 and integer
products' ms eagerly and compiled (frozen; the integer one an opaque op), each between pointwise neighbours (as a
norm's scale and a residual sum are in a block), and whether the compiled integer graph gives the eager one's
numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = [(1152, 384), (384, 384), (1536, 384), (384, 1536)] * 4 + [(16384, 384)]  # gpt-wikitext2's (out, in)

LIBRARY = torch.library.Library("bench_int8", "DEF")
LIBRARY.define("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor")


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(M, in) float32 x (out, in) int8 -> (M, out) float32: x quantized per row, integer products."""
    row_scales = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    q = torch.round(x / row_scales).to(torch.int8)
    return torch._int_mm(q, weight.t()).float() * row_scales * scales


LIBRARY.impl("int8_linear", int8_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("bench_int8::int8_linear", lib=LIBRARY)
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class Float32Products(nn.Module):
    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in weights])

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [F.linear(x * 1.5, w) + 1 for x, w in zip(xs, self.weights, strict=True)]


class IntegerProducts(nn.Module):
    def __init__(self, weights: list[torch.Tensor], weight_max: int) -> None:
        super().__init__()
        self.scales = [w.abs().amax(1) / weight_max for w in weights]
        self.weights = [(w / s[:, None]).round().to(torch.int8) for w, s in zip(weights, self.scales, strict=True)]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        ops = torch.ops.bench_int8.int8_linear
        return [ops(x * 1.5, w, s) + 1 for x, w, s in zip(xs, self.weights, self.scales, strict=True)]


def ms(fn, blocks: int = 7, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(times)


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--weight-max", type=int, default=127, help="127: 8-bit weights; 63: 7-bit")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) * 0.05 for out, inp in SHAPES]
    fp32, integer = Float32Products(weights).eval(), IntegerProducts(weights, args.weight_max)
    x, w = torch.randn(32, 1536), integer.weights[3]
    q = torch.round(x / (x.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
    exact = (q.double() @ w.double().t()).to(torch.int32)
    print(f"{torch.__version__}, weights within +-{args.weight_max}: oneDNN's integer products off exact by "
          f"{int((torch._int_mm(q, w.t()) - exact).abs().max())}")  # fmt: skip
    for rows in [int(r) for r in args.rows.split(",")]:
        report(rows, fp32, integer)


def report(rows: int, fp32: Float32Products, integer: IntegerProducts) -> None:
    xs = [torch.randn(rows, inp) for _, inp in SHAPES]
    template = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    with torch._inductor.config.patch(template):
        fp32_compiled = torch.compile(fp32, dynamic=False)
        fp32_compiled(xs)
    with torch._inductor.config.patch({"freezing": True}):
        integer_compiled = torch.compile(integer, dynamic=False)
        integer_compiled(xs)
    wrong = largest_difference(integer_compiled(xs), integer(xs))
    times = [ms(lambda fn=fn: fn(xs)) for fn in (fp32, fp32_compiled, integer, integer_compiled)]
    print(f"{rows} rows: float32 {times[0]:.2f} ms eager, {times[1]:.2f} compiled (template); integer "
          f"{times[2]:.2f} eager, {times[3]:.2f} compiled, compiled off eager by {wrong:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
