"""Which product serves group-quantized weights (GGUF's blocks) fastest on this CPU, at 1, 8 and 32 rows.

    .venv/bin/python bench/bench_group_quant.py [--shape 1024x3072 --shape 3072x1024]

Per (in x out) weight: bf16 F.linear (the float path today), aten's int4 kernel `_weight_int4pack_mm_for_cpu`
(groups of 32, scale and zero per group: Q4_0, Q4_1 and Q4_K exactly), and and GroupQuantLinear's codes (4 bits two a
byte, or a byte each, with a scale and a zero per group of 32: every GGUF type exactly)
through our kernel (server/execution/group_gemm.py) for 4-bit and byte codes. Prints ms per call and bytes of
weight read per call.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from models.quantize import GroupQuantLinear, pack_nibbles
from server.execution.group_gemm import product, usable


def timed(fn, x, repeat: int = 50) -> float:
    for _ in range(5):
        fn(x)
    t = time.perf_counter()
    for _ in range(repeat):
        fn(x)
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="IN x OUT, e.g. 1024x3072 (default: Qwen3-0.6B's MLP)")
    parser.add_argument("--rows", default="1,8,16,17,32,128")
    args = parser.parse_args()
    if not usable():  # builds and loads the kernel, which registers its op
        raise SystemExit("our group kernel does not run here: no AVX-512 VNNI and BF16, or no compiler built it")
    torch.manual_seed(0)
    for shape in args.shape or ["1024x3072", "3072x1024"]:
        k, n = (int(v) for v in shape.split("x"))
        linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        w = linear.weight.detach().float()
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales, zeros = (torch.rand(n, k // 32) * 0.01).half(), (torch.randn(n, k // 32) * 0.01).half()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], -1).to(torch.bfloat16).contiguous()
        q4 = GroupQuantLinear(pack_nibbles(codes), scales, zeros, None, bits=4)
        q8 = GroupQuantLinear(codes.to(torch.int8), scales, zeros, None, bits=8)
        q4.product = q8.product = product
        sides = {
            "bf16 linear": (linear, w.numel() * 2),
            "aten int4": (partial(torch.ops.aten._weight_int4pack_mm_for_cpu, mat2=packed, qGroupSize=32,
                                  qScaleAndZeros=scales_and_zeros), w.numel() // 2 + scales.numel() * 4),
            "ours 4-bit": (q4, w.numel() // 2 + scales.numel() * 4),
            "ours 8-bit": (q8, w.numel() + scales.numel() * 4),
        }  # fmt: skip
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            with torch.no_grad():
                line = "  ".join(f"{name} {timed(fn, x):.3f} ms" for name, (fn, _) in sides.items())
            print(f"{shape} rows={rows}: {line}")
        print("  bytes read:", {name: b for name, (_, b) in sides.items()})


if __name__ == "__main__":
    main()
