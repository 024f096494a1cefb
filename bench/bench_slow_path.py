"""The transformers runner (architectures our decoder does not compute) at a small LM's shape: tokens/s
of the engine alone (no HTTP), 1 and 8 greedy streams, 64 new tokens after a 20-token prompt.

    .venv/bin/python bench/bench_slow_path.py [--kind opt] [--streams 1,8] [--dtype float32]

A random model at OPT-125M's shape (12 x 768, our 16k vocabulary) is saved, added to a scratch store and
served by `load_runner("transformers", ...)`. To compare two versions of the runner, run this file with
TINYSERVE_CHECKOUT=<another checkout> (a git worktree): it imports the server from there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(os.environ.get("TINYSERVE_CHECKOUT", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(REPO))

from model_store.ingest import add_checkpoint  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from server.engine.core import GenerationEngine  # noqa: E402
from server.execution.loader import load_runner  # noqa: E402

TOKENIZER = Path(__file__).resolve().parent.parent / "model_store" / "gpt-wikitext2" / "tokenizer.json"
SHAPES = {
    "opt": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072, word_embed_proj_dim=768,
                max_position_embeddings=2048),
    "phi": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                max_position_embeddings=2048, partial_rotary_factor=0.5),
}  # fmt: skip


def build(kind: str, folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(
        str(Path(__file__).resolve().parent.parent / "model_store/gpt-wikitext2/tokenizer.json")
    )
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = transformers.AutoConfig.for_model(kind, vocab_size=tokenizer.get_vocab_size(), bos_token_id=eos,
                                               eos_token_id=eos, pad_token_id=eos, **SHAPES[kind])  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)


def tokens_per_s(engine: GenerationEngine, streams: int, prompt: list[int], new: int) -> float:
    params = SamplingParams(max_new_tokens=new, temperature=0, eos_bias=float("-inf"))
    threads = [threading.Thread(target=engine.generate, args=(prompt, params)) for _ in range(streams)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return streams * new / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="opt", choices=list(SHAPES))
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        build(args.kind, Path(tmp) / "src")
        folder = add_checkpoint(Path(tmp) / "src", args.kind, Path(tmp) / "store")
        streams = [int(s) for s in args.streams.split(",")]
        runner = load_runner("transformers", folder, torch.device("cpu"), getattr(torch, args.dtype), max(streams))
        engine = GenerationEngine(runner, max_batch_size=max(streams))
        engine.start()
        try:
            prompt = list(range(100, 120))
            tokens_per_s(engine, 1, prompt, 8)  # warm
            for n in streams:
                rates = [tokens_per_s(engine, n, prompt, 64) for _ in range(args.rounds)]
                print(f"{args.kind} {args.dtype} {n} streams: {statistics.median(rates):.1f} tok/s "
                      f"(rounds {', '.join(f'{r:.1f}' for r in rates)}; checkout {REPO})", flush=True)  # fmt: skip
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
