"""How close a quantized GGUF file served in its own bits stays to the same file's float32 values, on trained weights.

    .venv/bin/python bench/bench_quant_quality.py --llama ~/.cache/tinyserve-peers [--types Q4_K_M,Q8_0,...]
        [--gguf REAL.gguf ...] [--positions 256]

Our shipped GPT (model_store/gpt-wikitext2) is exported to GGUF (f32) and quantized by llama.cpp's `llama-quantize`
to each type; each file (and any real file given) is added to a scratch store as a user would. For WikiText-2's
validation text (../shared/data), teacher-forced over --positions positions, it reports the top-1 agreement of the
served path (bf16, quantized layers through our kernel where it runs, else widened) with the file's dequantized
weights in float32, and the float32 perplexity of each side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TYPES = "Q8_0,Q6_K,Q5_K_M,Q5_0,Q4_K_M,Q4_0,Q4_1,IQ4_NL,Q3_K_M,Q2_K"


def wikitext_ids(tokenizer, positions: int) -> list[int]:
    text = (REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt").read_text()
    return tokenizer.encode(text[: positions * 12]).ids[: positions + 1]


def agreement(folder: Path, positions: int) -> dict:
    from model_store.store import load_gpt
    from models.quantize import widen_groups
    from server.execution import group_gemm

    served, tokenizer = load_gpt(folder, dtype=torch.bfloat16)
    path = "our kernel" if group_gemm.use_kernel(served) else "widened to bf16"
    if path != "our kernel":
        widen_groups(served, torch.bfloat16)
    reference, _ = load_gpt(folder, dtype=torch.float32)
    widen_groups(reference, torch.float32)
    ids = wikitext_ids(tokenizer, positions)
    context = served.config.context_length
    x, y = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
    with torch.no_grad():
        got = torch.cat([served(x[:, i : i + context]).logits.float() for i in range(0, x.shape[1], context)], 1)[0]
        want = torch.cat([reference(x[:, i : i + context]).logits for i in range(0, x.shape[1], context)], 1)[0]
    nll = lambda logits: torch.nn.functional.cross_entropy(logits, y).exp().item()  # noqa: E731
    return {
        "top1_agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4),
        "positions": len(y),
        "perplexity_served": round(nll(got), 2),
        "perplexity_float32": round(nll(want), 2),
        "path": path,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama", type=Path, required=True, help="the peers' work folder (llama-quantize)")
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="a real file too")
    parser.add_argument("--positions", type=int, default=256)
    args = parser.parse_args()
    from model_store.gguf_files import export_gguf
    from model_store.ingest import add_checkpoint

    quantize = next(args.llama.glob("**/bin/llama-quantize"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        f32 = export_gguf(REPO / "model_store" / "gpt-wikitext2", work / "gpt-f32.gguf", "f32")
        files = []
        for t in args.types.split(","):
            out = work / f"gpt-{t.lower()}.gguf"
            subprocess.run([quantize, f32, out, t], check=True, capture_output=True)
            files.append((f"gpt-wikitext2 {t}", out))
        files += [(f.name, f) for f in args.gguf]
        for name, file in files:
            folder = add_checkpoint(file, Path(file).stem.replace("_", "-").lower(), work / "store")
            print(json.dumps({"file": name, **agreement(folder, args.positions)}), flush=True)


if __name__ == "__main__":
    main()
