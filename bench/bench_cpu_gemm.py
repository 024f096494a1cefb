"""Which compiled GEMM a CPU step should use: the prepacked layers freezing makes (MKL's for float32 of fixed rows,
oneDNN's for dynamic rows) against inductor's C++ GEMM template, and int8 weights, on a chain of gpt-wikitext2's 17
linear layers.

    .venv/bin/python bench/bench_cpu_gemm.py [--rows 1,8,32] [--rounds 5]

What server/execution/kernel_choice.py's `template_serves` rests on (on an AVX2 EPYC, MKL's float32 GEMM took 1.7-2.9x
the template's time at 8-32 rows). Each variant is compiled once, then the rounds alternate between them;
prints the median ms per chain call and each round's figure. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.cpu import cpu_features  # noqa: E402
from models.quantize import quantize_int8  # noqa: E402

TEMPLATE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
VARIANTS = {  # name -> (int8 weights, inductor config, rows compiled dynamic)
    "float32, prepacked (freezing)": (False, {"freezing": True}, False),
    # freezing packs float32 layers of dynamic rows for oneDNN, not MKL (inductor's mkldnn_fusion)
    "float32, prepacked, dynamic rows": (False, {"freezing": True}, True),
    "float32, C++ GEMM template": (False, TEMPLATE, False),
    "int8, C++ GEMM template": (True, TEMPLATE, False),
}


class Chain(nn.Module):
    """gpt-wikitext2's linear layers in order (4 blocks of qkv, proj, fc, out; the head), with the block's
    residual adds and GELU, none of the attention."""

    def __init__(self, d: int = 384, layers: int = 4, vocab: int = 16384) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)])
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, d) -> (rows, vocab)
        for qkv, proj, fc, out in self.blocks:
            x = x + proj(qkv(x)[:, : x.shape[1]])
            x = x + out(F.gelu(fc(x)))
        return self.head(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_features().as_dict()}")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, 384)
        compiled = {}
        for name, (int8, config, dynamic) in VARIANTS.items():
            chain = Chain().eval()
            chain = quantize_int8(chain) if int8 else chain
            with torch._inductor.config.patch(config), torch.inference_mode():
                compiled[name] = torch.compile(chain, fullgraph=True, dynamic=dynamic)
                compiled[name](x)
        times: dict[str, list[float]] = {name: [] for name in compiled}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, fn in compiled.items():
                    fn(x)
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        fn(x)
                    times[name].append((time.perf_counter() - t) / args.calls * 1e3)
        for name, ms in times.items():
            rounds = " ".join(f"{m:.2f}" for m in ms)
            print(f"{rows:3d} rows  {name:32s} {statistics.median(ms):7.2f} ms  ({rounds})")


if __name__ == "__main__":
    main()
