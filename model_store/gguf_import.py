"""A GGUF file into the store: the file's architecture (one of model_store/gguf_files.py's table) read
back into our decoder's config and weight names, quantized matrices kept as their blocks' codes, scales and zeros
(model_store/gguf_blocks.py: every type llama.cpp's quantizer writes for these families, READ_TYPES), other tensors
read with gguf's own kernels, and the tokenizer rebuilt from the file by transformers' GGUF builder (byte-level BPE
or SentencePiece). A file that cannot be read whole is refused in
one line naming it, and nothing reaches the store."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from model_store.families import GGUF_ARCHES, GGUFArch
from model_store.gguf_blocks import GROUPED_TYPES, Groups, dense, join, unpack
from model_store.gguf_files import BLOCK_TENSORS, TOP_TENSORS, GGUFError
from model_store.store import write_checkpoint
from models.gpt import GPT, GPTConfig
from models.quantize import NIBBLE_CHUNK, attach_groups, pack_codes

# the tensor types read: the float ones, the legacy and K quants, and IQ4_NL (which llama-quantize writes into
# Q2_K and Q3_K mixes for rows not a multiple of 256 wide); a quantized type's matrices are kept exactly
FLOAT_TYPES = ("F32", "F16", "BF16")
READ_TYPES = (*FLOAT_TYPES, "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
# tokens that end an assistant's turn in the chat templates of the families read (as llama.cpp's end-of-generation
# list): written to generation_config.json beside the file's own end-of-text, so that a chat stops at the turn's end
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>")


def import_gguf(file: Path, out: Path) -> Path:
    """A GGUF file of a family llama.cpp and our decoder both compute, as a store folder of ours (quantized matrices
    as their codes, float tensors in float32, or in the file's 16-bit type where it has only those); the tokenizer is
    rebuilt from the file."""
    reader = read_file(file)
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
    try:
        floats, layers = decoder_tensors(tensors, config, GGUF_ARCHES[arch_name])
        model = GPT.from_state(config, floats)
        attach_groups(model, layers, torch.float32)
    except (ValueError, RuntimeError) as e:  # a tensor whose bytes or shape are not what its header says
        raise GGUFError(f"{file}: a tensor cannot be read ({str(e).splitlines()[0][:200]})") from None
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:  # what the file lacks stays on the meta device
        raise GGUFError(f"{file}: tensors for {missing[:4]} are missing")
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    # exact: a quantized type's values are float32 (no 16-bit type holds them); a float file keeps its own type
    exact = types - {"F16", "BF16"}
    dtype = torch.float32 if exact else (torch.bfloat16 if "BF16" in types else torch.float16)
    source = f"`{file.name}` ({arch_name}, {'/'.join(sorted(types))})"
    card = f"# {out.name}\n\nImported from {source} with `tinyserve store add`.\n"
    generation = {"eos_token_id": end_of_turn(fields, reader, config.eos_token_id)}
    write_checkpoint(
        out, model, tokenizer, card, {}, dtype=dtype, tokenizer_config=tokenizer_config, generation=generation
    )
    return out


def read_file(file: Path):
    """gguf's reader over the file, or a GGUFError in one line: a truncated or corrupt file fails in its header or
    in a tensor's extent (the reader maps every tensor's bytes)."""
    import gguf

    try:
        return gguf.GGUFReader(str(file))
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError) as e:
        raise GGUFError(
            f"{file}: not a readable GGUF file ({str(e).splitlines()[0][:200] or type(e).__name__})"
        ) from None


def end_of_turn(fields: dict, reader, eos: int) -> list[int]:
    """The file's end-of-text id, its end-of-turn ids (tokenizer.ggml.eot_token_id, eom_token_id) and the ids of the
    END_OF_TURN tokens its vocabulary has."""
    ids = [
        eos,
        *(int(fields[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields),
    ]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for i, token in enumerate(tokens.contents()):
            if token in END_OF_TURN:
                ids.append(i)
    return list(dict.fromkeys(ids))


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
    if fields.get(f"{arch_name}.final_logit_softcapping"):
        raise GGUFError(f"{arch_name}.final_logit_softcapping is not served")
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
        **{"scale_embeddings": False} | arch.settings,
        **sliding_layers(fields, arch_name, arch),
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


def sliding_layers(fields: dict, arch_name: str, arch: GGUFArch) -> dict:
    """The sliding-window settings of an architecture that has them (Gemma 3), as llama.cpp reads them: the window,
    which layers slide (a per-layer array, or every layer but each n-th: the pattern, default the architecture's),
    and their RoPE base (default 10,000)."""
    window = fields.get(f"{arch_name}.attention.sliding_window")
    if not arch.sliding_pattern or not window:
        return {}
    n_layer = int(fields[f"{arch_name}.block_count"])
    pattern = fields.get(f"{arch_name}.attention.sliding_window_pattern", arch.sliding_pattern)
    slides = list(pattern) if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(n_layer)]
    return {
        "layer_types": ["sliding" if s else "full" for s in slides],
        "sliding_window": int(window),
        "rope_local_theta": float(fields.get(f"{arch_name}.rope.freq_base_swa", 10000.0)),
    }


def decoder_tensors(tensors: dict, c: GPTConfig, arch: GGUFArch) -> tuple[dict, dict]:
    """The file's tensors under our names: float ones (float32), and the linear layers (and token embedding) of a
    quantized type as their blocks' codes, scales and zeros (model_store/gguf_blocks.py), by module name."""
    import gguf

    def read(name: str, keep_blocks: bool = True) -> torch.Tensor | Groups:
        t = tensors[name]
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the fastest dimension first
        if keep_blocks and len(shape) == 2 and t.tensor_type.name in GROUPED_TYPES:
            return unpack(t.data, t.tensor_type.name, tuple(shape))
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type))  # a copy: the file is mapped read-only
        if not np.isfinite(values).all():
            raise ValueError(f"tensor {name} holds values that are not finite")
        return torch.from_numpy(values).float().reshape(shape)

    out = {}
    for ours, theirs in TOP_TENSORS.items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in tensors:
                out[f"{ours}.{kind}"] = read(f"{theirs}.{kind}", keep_blocks=ours != "pos_emb")
    if "pos_emb.weight" in out:
        out["pos_emb.weight"] = out["pos_emb.weight"][: c.context_length]
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"blk.{i}."
        for kind in ("weight", "bias"):
            for name, gguf_name in BLOCK_TENSORS.items():
                if f"{theirs}{gguf_name}.{kind}" in tensors:
                    out[f"{ours}{name}.{kind}"] = read(f"{theirs}{gguf_name}.{kind}")
            parts = ["ffn_gate", "ffn_up"] if c.gated else ["ffn_up"]
            if f"{theirs}ffn_up.{kind}" in tensors:
                out[f"{ours}mlp.fc.{kind}"] = joined([read(f"{theirs}{p}.{kind}") for p in parts])
            qkv = ["attn_qkv"] if arch.fused_qkv else ["attn_q", "attn_k", "attn_v"]
            if f"{theirs}{qkv[0]}.{kind}" in tensors:
                out[f"{ours}attn.qkv.{kind}"] = joined([read(f"{theirs}{p}.{kind}") for p in qkv])
    floats = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    layers = {}
    for k, v in out.items():
        if isinstance(v, Groups):
            module = k.removesuffix(".weight")
            module = "tok_emb.table" if module == "tok_emb" else module
            layers[module] = as_tensors(v)
            if f"{k.removesuffix('.weight')}.bias" in floats:
                layers[module]["bias"] = floats.pop(f"{k.removesuffix('.weight')}.bias")
    return floats, layers


def joined(parts: list) -> torch.Tensor | Groups:
    """Tensors fused along their rows (q, k, v; gate, up): float parts as one float tensor; quantized parts as one
    Groups, in the narrowest form that holds every part exactly (model_store/gguf_blocks.py: `join`)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if any(isinstance(p, torch.Tensor) for p in parts):  # a float part beside quantized ones: all as floats
        return torch.cat([p if isinstance(p, torch.Tensor) else torch.from_numpy(dense(p)) for p in parts])
    return join(parts)


def as_tensors(g: Groups) -> dict[str, torch.Tensor]:
    """A Groups as GroupQuantLinear's buffers: unsigned codes of up to 6 bits in 4, 5 or 6 bits a code where the width
    allows (pack_codes), others a byte each."""
    codes = torch.from_numpy(np.ascontiguousarray(g.codes))
    bits = 8
    if codes.dtype == torch.uint8 and g.bits <= 6 and not codes.shape[1] % NIBBLE_CHUNK:
        bits = max(g.bits, 4)
    out = {"codes": pack_codes(codes, bits), "scales": torch.from_numpy(g.scales.astype(np.float32))}
    out["width"] = torch.tensor(bits, dtype=torch.int8)
    if g.zeros is not None:
        out["zeros"] = torch.from_numpy(g.zeros.astype(np.float32))
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
