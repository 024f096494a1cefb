"""Make the GGUF test fixtures (tests/fixtures/gguf/) with llama.cpp's own converter and quantizer.

    .venv/bin/python scripts/make_gguf_fixtures.py --llama ~/.cache/tinyserve-peers

Tiny random transformers models (the tests' 400-token BPE vocabulary) are saved as HF folders, converted by
llama.cpp's `convert_hf_to_gguf.py` (run by the peers' Python, which has its requirements) to F32, then
quantized by `llama-quantize` to each type tests/test_gguf_types.py reads. The Llama model is 256 wide, so K-quant
rows are whole 256-blocks and each file holds the type it is named for; the Gemma 3 model is 64 wide, so its
Q4_K_M file holds the 5- and 8-bit fallbacks llama-quantize writes for such rows, as real small Gemma files do.
CI has no llama.cpp: the files are committed, and the tests assert which tensor types each holds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.bench_families import readable_by_converter, to_gguf  # noqa: E402  (the converter, run as the bench runs it)

OUT = ROOT / "tests" / "fixtures" / "gguf"
LLAMA_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL")
GEMMA_TYPES = ("Q4_K_M",)
MODELS = {
    "llama": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                        max_position_embeddings=128),
}  # fmt: skip


def tokenizer():
    from training.data import read_split, split_documents
    from training.tokenizer import train_bpe

    return train_bpe(split_documents(read_split(str(ROOT / "tests/fixtures/tiny_wiki"), "train")), vocab_size=400)


def save_model(folder: Path, kind: str, tok) -> None:
    import transformers
    from transformers import PreTrainedTokenizerFast

    from models.tokenizer import eos_id

    eos = eos_id(tok)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        kind, vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos, **MODELS[kind]
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # spread the logits; norms that are not all ones (or zeros, Gemma's)
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(eos)).save_pretrained(folder)
    readable_by_converter(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama", type=Path, required=True, help="the peers' work folder (setup.sh built it)")
    args = parser.parse_args()
    python = str(args.llama / "venv-peers" / "bin" / "python")
    source = next(args.llama.glob("src/*/vendor/llama.cpp"))
    quantize = next(args.llama.glob("**/bin/llama-quantize"))
    OUT.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        for kind, types in (("llama", LLAMA_TYPES), ("gemma3_text", GEMMA_TYPES)):
            name = kind.removesuffix("_text")
            folder, f32 = Path(tmp) / name, Path(tmp) / f"{name}-f32.gguf"
            save_model(folder, kind, tok)
            to_gguf(python, source, folder, "f32", f32)
            if kind == "gemma3_text":  # the float file too: Gemma 3's own layout, exactly
                (OUT / f32.name).write_bytes(f32.read_bytes())
            for t in types:
                out = OUT / f"{name}-{t.lower()}.gguf"
                subprocess.run([quantize, f32, out, t], check=True, capture_output=True)
                print(out.relative_to(ROOT), out.stat().st_size, file=sys.stderr)


if __name__ == "__main__":
    main()
