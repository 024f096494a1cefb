"""What int8 weights cost in quality: test perplexity and greedy-token agreement with float32.

    .venv/bin/python bench/bench_int8.py [--model gpt-wikitext2] [--data ../shared/data/wikitext-2-raw]

For each form (float32; bfloat16; int8 weights with bfloat16 activations; int8 weights with float32
activations): word- and token-level perplexity of the test split (strict definition, as `python -m
training eval`), and for the 5 prompts of ../shared/peers' check, the first position where 64
greedy tokens leave float32's. Speed is bench/../shared/peers' job (TINYSERVE_WEIGHTS=int8).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_store import STORE_ROOT, load_gpt  # noqa: E402
from models.quantize import quantize_int8  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from training.data import read_split  # noqa: E402
from training.evaluate import corpus_perplexity  # noqa: E402

PROMPTS = [
    "The history of the city begins in the early Middle Ages , when",
    "The castle was built in",
    "In 1998, the band",
    "The game was released in Japan in 2011, and later in North America.",
    "He said",
]
FORMS = {
    "float32": (torch.float32, False),
    "bfloat16": (torch.bfloat16, False),
    "int8, bf16 activations": (torch.bfloat16, True),
    "int8, fp32 activations": (torch.float32, True),
}


def divergence(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-wikitext2")
    ap.add_argument("--data", default=str(REPO.parent / "shared/data/wikitext-2-raw"))
    args = ap.parse_args()
    folder = STORE_ROOT / args.model
    meta = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").exists() else {}
    detokenize, doc_mode = meta.get("detokenize", True), meta.get("doc_mode", "wikitext-paragraph")
    raw = read_split(args.data, "test")
    greedy = SamplingParams(max_new_tokens=64, temperature=0, eos_bias=float("-inf"))
    reference = None
    print("| form | test word ppl | test token ppl | greedy tokens equal to float32's (first divergence, 5 prompts) |")
    print("|---|---|---|---|")
    for name, (dtype, int8) in FORMS.items():
        model, tok = load_gpt(folder, torch.device("cpu"), dtype)
        if int8:
            quantize_int8(model)
        model.eval()
        with torch.inference_mode():
            ppl = corpus_perplexity(model, tok, raw, doc_mode, detokenize=detokenize)
            outs = [model.generate(torch.tensor([tok.encode(p).ids]), greedy)[0].tolist() for p in PROMPTS]
        reference = reference or outs
        first = [divergence(o, r) for o, r in zip(outs, reference, strict=True)]
        print(f"| {name} | {ppl.word_ppl:.2f} | {ppl.token_ppl:.2f} | {first} |", flush=True)


if __name__ == "__main__":
    main()
