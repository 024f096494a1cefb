"""Decode attention at 32 rows: the served explicit product against flex_attention over each row's length.

    .venv/bin/python bench/bench_decode_attention.py

One query a row, 6 heads of 64 in bf16 over a (rows, heads, 256, 64) cache, as gpt-wikitext2 decodes.
"explicit" is the served form (models/gpt.py: scores, mask, softmax in float32, product with the values)
compiled over the longest row's columns rounded up to 16 (server/execution/decoder/step.py); "flex" is
flex_attention with a block mask of 16-column blocks from each row's own length, built outside the
graph (built inside, torch 2.13's C++ codegen fails on the mask). Run it on an idle machine.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

ROWS, HEADS, HEAD_DIM, CONTEXT, BLOCK = 32, 6, 64, 256, 16


def softmax(x: torch.Tensor) -> torch.Tensor:  # models/softmax.py's, inlined: this file stands alone
    xf = x.float()
    m = xf.amax(-1, keepdim=True)
    e = torch.exp(xf - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    s = e.sum(-1, keepdim=True)
    return (e / torch.where(s > 0, s, torch.ones_like(s))).to(x.dtype)


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    visible = (torch.arange(k.shape[2]) <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, 1, S)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)  # (B, H, 1, S)
    return softmax(scores.masked_fill(~visible, float("-inf"))) @ v


def block_mask(lengths: torch.Tensor) -> BlockMask:
    """Each row reads ceil(length / BLOCK) blocks; the partial last one is masked by position."""
    blocks = CONTEXT // BLOCK
    counts = ((lengths + BLOCK - 1) // BLOCK).view(ROWS, 1, 1).expand(ROWS, HEADS, 1).to(torch.int32).contiguous()
    order = torch.arange(blocks, dtype=torch.int32).view(1, 1, 1, blocks).expand(ROWS, HEADS, 1, blocks).contiguous()

    def within(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=(1, BLOCK), mask_mod=within, seq_lengths=(1, CONTEXT))


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    return flex_attention(q, k, v, block_mask=mask)


def ms_per_call(fn, *args, calls: int = 200) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, HEADS, 1, HEAD_DIM, generator=g).bfloat16()
    # one spare column, as the served cache has: every view of the first S columns is strided alike
    k, v = (torch.randn(ROWS, HEADS, CONTEXT + 1, HEAD_DIM, generator=g).bfloat16()[:, :, :CONTEXT] for _ in "kv")
    cases = {"all 20": [20] * ROWS, "one 250, 31 of 20": [250] + [20] * (ROWS - 1), "all 250": [250] * ROWS}
    with torch.inference_mode():
        for label, lengths in cases.items():
            lengths = torch.tensor(lengths)
            positions = (lengths - 1).view(ROWS, 1)
            columns = min(CONTEXT, -(-int(lengths.max()) // 16) * 16)
            served = torch.compile(explicit, fullgraph=True, dynamic=False)
            kc, vc = k[:, :, :columns], v[:, :, :columns]
            mask = block_mask(lengths)
            per_row = torch.compile(flex, fullgraph=True, dynamic=False)
            diff = (per_row(q, k, v, mask).float() - served(q, kc, vc, positions).float()).abs().max().item()
            print(
                f"{label}: explicit over {columns} columns {ms_per_call(served, q, kc, vc, positions):.3f} ms; "
                f"flex over each row's blocks {ms_per_call(per_row, q, k, v, mask):.3f} ms (max difference "
                f"{diff:.1e}); building the block mask {ms_per_call(block_mask, lengths):.3f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
