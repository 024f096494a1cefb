"""A GGUF file into the store: the file's architecture (one of model_store/gguf_files.py's table) read
back into our decoder's config and weight names, tensors dequantized with gguf's own kernels, and the
tokenizer rebuilt from the file by transformers' GGUF builder (byte-level BPE or SentencePiece)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from model_store.families import GGUF_ARCHES, GGUFArch
from model_store.gguf_files import BLOCK_TENSORS, GGUF_TYPES, TOP_TENSORS, GGUFError
from model_store.store import write_checkpoint
from models.gpt import GPT, GPTConfig

READ_TYPES = tuple(t.upper() for t in GGUF_TYPES.values())  # the tensor types it reads: those we write


def import_gguf(file: Path, out: Path) -> Path:
    """A GGUF file of a family llama.cpp and our decoder both compute, as a store folder of ours (float32
    weights for f32 and q8_0 files, else the file's 16-bit type); the tokenizer is rebuilt from the file."""
    import gguf

    reader = gguf.GGUFReader(str(file))
    fields = {name: field.contents() for name, field in reader.fields.items() if name != "tokenizer.ggml.tokens"}
    arch_name = fields.get("general.architecture")
    if arch_name not in GGUF_ARCHES:
        raise GGUFError(f"{file}: architecture {arch_name!r} is not read (one of {', '.join(GGUF_ARCHES)})")
    odd = sorted({t.tensor_type.name for t in reader.tensors} - set(READ_TYPES))
    if odd:
        raise GGUFError(f"{file}: tensor types {odd} are not read (one of {', '.join(READ_TYPES)})")
    tensors = {t.name: t for t in reader.tensors}
    tokenizer, tokenizer_config = gguf_tokenizer(file)
    config = gguf_config(fields, tensors, GGUF_ARCHES[arch_name], tokenizer)
    model = GPT.from_state(config, decoder_tensors(tensors, config, GGUF_ARCHES[arch_name]))
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:  # what the file lacks stays on the meta device
        raise GGUFError(f"{file}: tensors for {missing[:4]} are missing")
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    dtype = torch.float32 if types & {"F32", "Q8_0"} else (torch.bfloat16 if "BF16" in types else torch.float16)
    source = f"`{file.name}` ({arch_name}, {'/'.join(sorted(types))})"
    card = f"# {out.name}\n\nImported from {source} with `tinyserve store add`.\n"
    write_checkpoint(out, model, tokenizer, card, {}, dtype=dtype, tokenizer_config=tokenizer_config)
    return out


def gguf_config(fields: dict, tensors: dict, arch: GGUFArch, tokenizer) -> GPTConfig:
    arch_name = fields["general.architecture"]

    def key(name: str, default=None):
        value = fields.get(f"{arch_name}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF key {arch_name}.{name} is missing")
        return value

    heads, d_model = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(fields.get(f"{arch_name}.attention.key_length", d_model // heads))
    scaling_kind = fields.get(f"{arch_name}.rope.scaling.type", "none")
    if scaling_kind not in ("none", "linear"):
        raise GGUFError(f"rope scaling {scaling_kind!r} is not read (none, linear)")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise GGUFError("tokenizer.ggml.eos_token_id is missing: the end of a completion cannot be told")
    rms = arch.settings["norm"] == "rmsnorm"
    config = GPTConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        context_length=int(key("context_length")),
        n_layer=int(key("block_count")),
        n_head=heads,
        n_kv_head=int(fields.get(f"{arch_name}.attention.head_count_kv", heads)),
        d_model=d_model,
        d_ff=int(key("feed_forward_length")),
        head_size=head_dim if head_dim * heads != d_model else None,
        dropout=0.0,
        eos_token_id=int(eos),
        tie_weights="output.weight" not in tensors,
        bias=not rms,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        out_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        norm_eps=float(key("attention.layer_norm_rms_epsilon" if rms else "attention.layer_norm_epsilon")),
        scale_embeddings=False,
        **arch.settings,
    )
    if config.positions == "rope":
        factor = fields.get(f"{arch_name}.rope.scaling.factor")
        scaling = {"rope_type": "linear", "factor": float(factor)} if scaling_kind == "linear" else None
        if "rope_freqs.weight" in tensors:  # per-frequency factors (llama3 scaling, as llama.cpp writes it)
            t = tensors["rope_freqs.weight"]
            scaling = {"rope_type": "factors", "factors": [float(x) for x in np.asarray(t.data, dtype=np.float32)]}
        config = replace(
            config,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_pairs=arch.rope_pairs,
            rotary_dim=int(key("rope.dimension_count", head_dim)),
            rope_scaling=scaling,
            parallel_residual=bool(fields.get(f"{arch_name}.use_parallel_residual", arch_name == "gptneox")),
        )
    return config


def decoder_tensors(tensors: dict, c: GPTConfig, arch: GGUFArch) -> dict[str, torch.Tensor]:
    """The file's tensors under our names, dequantized to float32."""
    import gguf

    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the fastest dimension first
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type))  # a copy: the file is mapped read-only
        return torch.from_numpy(values).float().reshape(shape)

    out = {}
    for ours, theirs in TOP_TENSORS.items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in tensors:
                out[f"{ours}.{kind}"] = read(f"{theirs}.{kind}")
    if "pos_emb.weight" in out:
        out["pos_emb.weight"] = out["pos_emb.weight"][: c.context_length]
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"blk.{i}."
        for kind in ("weight", "bias"):
            for name, gguf_name in BLOCK_TENSORS.items():
                if f"{theirs}{gguf_name}.{kind}" in tensors:
                    out[f"{ours}{name}.{kind}"] = read(f"{theirs}{gguf_name}.{kind}")
            parts = ["ffn_gate", "ffn_up"] if c.mlp == "swiglu" else ["ffn_up"]
            if f"{theirs}ffn_up.{kind}" in tensors:
                out[f"{ours}mlp.fc.{kind}"] = torch.cat([read(f"{theirs}{p}.{kind}") for p in parts])
            qkv = ["attn_qkv"] if arch.fused_qkv else ["attn_q", "attn_k", "attn_v"]
            if f"{theirs}{qkv[0]}.{kind}" in tensors:
                out[f"{ours}attn.qkv.{kind}"] = torch.cat([read(f"{theirs}{p}.{kind}") for p in qkv])
    return out


# tokenizer.ggml.model values read: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece's BPE with byte
# fallback (Llama 2, TinyLlama, Mistral), both built by transformers' GGUF tokenizer builder
TOKENIZER_TYPES = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}


def gguf_tokenizer(file: Path):
    """The tokenizer the file describes (transformers' GGUF builder), starting a text with BOS where it says so,
    and what tokenizer_config.json keeps of it (BOS, the chat template)."""
    from tokenizers import processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    arch_name, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(file))
    if (kind := tokenizer_dict.get("tokenizer_type")) not in TOKENIZER_TYPES:
        read = ", ".join(f"{k!r} ({v})" for k, v in TOKENIZER_TYPES.items())
        raise GGUFError(f"{file}: tokenizer {kind!r} is not read; these are: {read}")
    tokenizer, _ = convert_gguf_tokenizer(arch_name, tokenizer_dict)
    bos = tokenizer_config.get("bos_token")
    if tokenizer_config.get("add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    else:
        tokenizer.post_processor = None
    kept = {"bos_token": bos, "chat_template": tokenizer_config.get("chat_template")}
    return tokenizer, {k: v for k, v in kept.items() if v is not None}


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
