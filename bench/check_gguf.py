"""Our GGUF export run by llama-server: its greedy tokens against ours in float32, per store model.

    .venv/bin/python bench/check_gguf.py --llama ~/.cache/tinyserve-peers gpt-wikitext2 [MODEL ...]
        [--store DIR] [--type f32] [--tokens 64] [--families]

Each model is exported with `tinyserve export MODEL OUT --format gguf`, served by llama-server (1 slot,
2 threads, prompts as token ids so no tokenizer is involved), and for each prompt its 64 greedy tokens
(EOS ignored) are compared with our decoder's (the engine in float32, EOS masked), and its token ids for a
few texts (llama-server's /tokenize) with the server's encoding of them (BOS included). It also reads the
file back (`tinyserve store add FILE.gguf`) and compares that copy's greedy tokens. A tool run by hand
(it needs llama.cpp's build: `bash ../shared/peers/setup.sh`), not a test. --families adds small random
transformers checkpoints of each family with our tokenizer (weights spread as the tests spread them, so
greedy tokens are not near-ties).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_families import readable_by_converter, to_gguf  # noqa: E402
from model_store.gguf_files import export_gguf  # noqa: E402
from model_store.gguf_import import import_gguf  # noqa: E402
from model_store.store import STORE_ROOT, load_gpt  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from server.engine.core import GenerationEngine  # noqa: E402
from server.execution.decoder.runner import GPTRunner  # noqa: E402
from server.execution.runner import TextCodec  # noqa: E402

PROMPTS = ["The history of the city begins in the early Middle Ages , when", "In 1998 , the band released", "He"]
TEXTS = [*PROMPTS, "Ünïcode ☃ and  two spaces", " a leading space"]  # tokenized by llama-server and by us


def ours(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    model, tokenizer = load_gpt(folder)
    engine = GenerationEngine(GPTRunner(model, tokenizer, 1), max_batch_size=1)
    params = SamplingParams(max_new_tokens=new, temperature=0, eos_bias=float("-inf"))
    engine.start()
    try:
        return [[e.id for e in engine.generate(p, params)[0]] for p in prompts]
    finally:
        engine.stop()


def llama(
    bin_dir: Path, gguf: Path, prompts: list[list[int]], new: int, port: int = 8941, texts: list[str] = ()
) -> list[list[int]]:
    """llama-server's greedy tokens after each prompt; with texts, then its token ids for each text (the file's
    tokenizer, BOS as the file says)."""
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--port", str(port), "-t", "2", "-np", "1", "-c", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {
            "n_predict": new,
            "ignore_eos": True,
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
        }

        def tokens(route: str, request: dict) -> list[int]:
            return httpx.post(base + route, json=request, timeout=300).json()["tokens"]

        return [tokens("/completion", {**body, "prompt": p}) for p in prompts] + [
            tokens("/tokenize", {"content": t, "add_special": True}) for t in texts
        ]
    finally:
        proc.terminate()
        proc.wait()


FAMILIES = {  # transformers model type -> config, small, our 16k vocabulary
    "llama": dict(num_key_value_heads=2),
    "llama-llama3rope": dict(num_key_value_heads=2, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
    "llama-biases": dict(attention_bias=True, tie_word_embeddings=True),
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, head_dim=48),
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4, n_positions=512),
    "gpt_neox": dict(rotary_pct=0.25),
}  # fmt: skip


def add_families(store: Path) -> list[str]:
    """Each family's small random checkpoint in the store (`tinyserve store add`)."""
    import transformers

    from model_store.ingest import add_checkpoint

    tokenizer = REPO / "model_store" / "gpt-wikitext2" / "tokenizer.json"
    names = []
    for name, kwargs in FAMILIES.items():
        kind = name.split("-")[0]
        common = dict(vocab_size=16384, bos_token_id=0, eos_token_id=0)
        if kind != "gpt2":
            common.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=512)  # fmt: skip
        config = transformers.AutoConfig.for_model(kind, **common, **kwargs)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        src = store / "src" / name
        model.save_pretrained(src)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), eos_token="<|endoftext|>")
        fast.save_pretrained(src)
        readable_by_converter(src)
        add_checkpoint(src, name, store)
        names.append(name)
    return names


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None if they are equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def differences(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [first_difference(x, y) for x, y in zip(a, b, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--families", action="store_true", help="also small random checkpoints of each family")
    ap.add_argument("--llama", type=Path, required=True, help="the peers' work folder (llama.cpp-build/bin inside)")
    ap.add_argument("--store", type=Path, default=STORE_ROOT)
    ap.add_argument("--type", default="f32")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    bin_dir = args.llama / "llama.cpp-build" / "bin"
    converter = (str(args.llama / "venv-peers" / "bin" / "python"), args.llama / "src" / "llama_cpp_python-0.3.36"
                 / "vendor" / "llama.cpp")  # fmt: skip
    scratch = Path(tempfile.mkdtemp())
    models = [(args.store, name) for name in args.models]
    if args.families:
        models += [(scratch, name) for name in add_families(scratch)]
    for store, name in models:
        folder = store / name
        _, tokenizer = load_gpt(folder)
        prompts = [tokenizer.encode(p).ids for p in PROMPTS]
        want = ours(folder, prompts, args.tokens)
        gguf = export_gguf(folder, scratch / f"{name}.gguf", args.type)
        theirs = llama(bin_dir, gguf, prompts, args.tokens, texts=TEXTS)
        codec = TextCodec(tokenizer)
        # first differing token (null: all equal), llama-server and the file read back against ours
        report = {
            "exported": args.type,
            "llama_server": differences(theirs[: len(prompts)], want),
            "llama_server_tokenize": differences(theirs[len(prompts) :], [codec.encode(t) for t in TEXTS]),
            "read_back": differences(ours(import_gguf(gguf, scratch / f"{name}-read"), prompts, args.tokens), want),
        }
        if (store / "src" / name).is_dir():  # files llama.cpp's own converter makes, read by us
            for kind in ("f32", "q8_0"):
                converted = scratch / f"{name}-converted-{kind}.gguf"
                to_gguf(converter[0], converter[1], store / "src" / name, kind, converted)
                read = ours(import_gguf(converted, scratch / f"{name}-converted-{kind}"), prompts, args.tokens)
                report[f"converted_{kind}_read"] = differences(read, want)
                if kind == "q8_0":  # the same dequantized weights, in llama.cpp's q8_0 kernels and our float32
                    report["converted_q8_0_llama_server_vs_read"] = differences(
                        llama(bin_dir, converted, prompts, args.tokens), read
                    )
        print(json.dumps({name: report}), flush=True)


if __name__ == "__main__":
    main()
