"""A checkpoint's linear layers, every one once (a decode step's products), four ways: oneDNN's bf16 linear on
prepacked weights and on the plain ones (torch's F.linear), the skinny kernel (server/execution/skinny_gemm.py) on
the weights as loaded (4 KB pages), and on the weights moved to huge pages (server/execution/huge_pages.py); ms and
GB/s per pass.

    .venv/bin/python bench/bench_skinny_gemm.py FOLDER [--rows 1,2,4,8] [--repeats 5]

Needs a CPU with AVX-512 BF16. Each way is timed in turn, `--repeats` times, and the median kept: the memory's
speed varies on a shared machine, so compare figures of one run. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_store import load_gpt  # noqa: E402
from server.execution import skinny_gemm  # noqa: E402
from server.execution.huge_pages import on_huge_pages, thp_mode  # noqa: E402


def ms_per_pass(fn, calls: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not skinny_gemm.usable():  # builds and loads the kernel
        sys.exit("the skinny kernel does not run here: no AVX-512 BF16, or no compiler built it")
    model, _ = load_gpt(args.folder, dtype=torch.bfloat16)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1) for w in weights]
    small = [w.detach().clone() for w in weights]  # allocated as torch allocates: 4 KB pages
    on_huge_pages(model)
    huge = [w.detach() for w in weights]
    gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
    print(f"{len(weights)} layers, {gigabytes:.3f} GB in bf16; transparent huge pages: {thp_mode()}")
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in weights}

        def onednn(inputs: dict = inputs) -> None:
            for w, p in zip(weights, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise.default(inputs[w.shape[1]], p, None, "none", [], "")

        def plain(inputs: dict = inputs) -> None:  # no prepacked copy: oneDNN reorders the weight at every call
            for w in huge:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

        def skinny(on: list[torch.Tensor], inputs: dict = inputs):
            return lambda: [skinny_gemm.product(inputs[w.shape[1]], w, None) for w in on]

        ways = {
            "oneDNN prepacked": onednn,
            "oneDNN on the plain weights (huge pages)": plain,
            "skinny, 4 KB pages": skinny(small),
            "skinny, huge pages": skinny(huge),
        }
        times = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                times[name].append(ms_per_pass(fn))
        for name, ms in times.items():
            median = statistics.median(ms)
            print(f"{rows} rows, {name}: {median:.2f} ms, {gigabytes / median * 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
