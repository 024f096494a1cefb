"""GGUF files both ways, with llama.cpp's own `gguf` package: a checkpoint our decoder serves leaves as
one .gguf that llama-server (or Ollama) runs, and a .gguf of those families enters the store.

Both directions go through our decoder's config and weight names (models/gpt.py), so one table of
llama.cpp architectures covers our GPT and every family model_store/families.py maps:
- `GGUF_ARCHES` (model_store/families.py, each family's `gguf`): what each llama.cpp architecture computes,
  as our decoder's settings;
- `BLOCK_TENSORS`: each block tensor's GGUF name (llama.cpp wants q, k and v apart where it has no
  fused `attn_qkv`; our fused rows are all queries, then all keys, then all values, as its own);
- rotary pairs: llama.cpp's llama rotates interleaved channel pairs, its qwen2, qwen3 and gptneox rotate
  halves (as transformers does): query and key rows are reordered within each head where ours differ,
  which leaves q . k unchanged;
- our GPT scales its token embedding by sqrt(d_model) inside the model: the file stores it scaled, and
  the unscaled copy as the output head.
Tokenizers are byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM), written with gguf's vocabulary readers and the
pre-tokenizer's llama.cpp name, or SentencePiece's BPE with byte fallback (Llama 2, TinyLlama, Mistral), written
as llama.cpp's 'llama' vocabulary. This file writes; model_store/gguf_import.py reads with the same table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_store.families import GGUF_ARCHES, GGUFArch
from model_store.store import load_gpt
from models.gpt import GPT, GPTConfig
from models.positions import inverse_frequencies

# the weights' type in a written file, by the dtype names of `tinyserve export` (norms and biases stay f32)
GGUF_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0"}


# the attention-lab options (models/gpt.py) llama.cpp has no equivalent for, at the value it computes
STANDARD = {"softmax": "softmax0", "score": "dot", "masking": "causal", "n_relational_head": 0, "qkv_sharing": "none"}
BLOCK_TENSORS = {  # ours (in blocks.{i}.) -> GGUF's (in blk.{i}.); attn.qkv is split or kept per GGUFArch.fused_qkv
    "ln_1": "attn_norm",
    "ln_2": "ffn_norm",
    "attn.q_norm": "attn_q_norm",
    "attn.k_norm": "attn_k_norm",
    "attn.proj": "attn_output",
    "mlp.proj": "ffn_down",
    "post_ln_1": "post_attention_norm",  # Gemma 3's norms after attention and the MLP
    "post_ln_2": "post_ffw_norm",
}
TOP_TENSORS = {"tok_emb": "token_embd", "pos_emb": "position_embd", "ln_f": "output_norm", "lm_head": "output"}


class GGUFError(ValueError):
    """A model or file GGUF's side cannot express or we cannot read; the message names the setting."""


# ---------------------------------------------------------------- shared: the architecture and rotary pairs


def gguf_architecture(c: GPTConfig) -> str:
    """The llama.cpp architecture that computes this config, or a GGUFError naming what none does."""
    odd = [f"{k}={getattr(c, k)!r}" for k, v in STANDARD.items() if getattr(c, k) != v]
    if odd:
        raise GGUFError("llama.cpp has no equivalent of " + ", ".join(odd))
    if c.norm == "rmsnorm" and c.mlp == "swiglu" and c.positions == "rope" and not c.parallel_residual:
        if c.qk_norm and not c.has_bias("qkv"):
            return "qwen3"
        if not c.qk_norm:
            return "qwen2" if c.has_bias("qkv") and not c.has_bias("out") else "llama"
    if c.norm == "layernorm" and c.mlp in ("gelu", "gelu_tanh") and not c.qk_norm and c.kv_heads == c.n_head:
        if c.positions == "learned" and not c.parallel_residual and c.bias:
            return "gpt2"
        if c.positions == "rope" and c.has_bias("qkv") and c.has_bias("out") and c.has_bias("mlp"):
            return "gptneox"
    raise GGUFError(
        f"no llama.cpp architecture computes norm={c.norm}, mlp={c.mlp}, positions={c.positions}, "
        f"qk_norm={c.qk_norm}, parallel_residual={c.parallel_residual}, biases={c.bias}"
    )


def pair_order(head_dim: int, rotated: int, to: str) -> torch.Tensor:
    """Rows of one head reordered from the other pairing to `to`: interleaved (2i, 2i+1) or half (i, i+r/2)."""
    halves = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2), torch.arange(rotated, head_dim)])
    return halves if to == "half" else torch.argsort(halves)


def reorder_heads(w: torch.Tensor, heads: int, order: torch.Tensor) -> torch.Tensor:
    """Rows (heads * D, ...) with each head's rows in `order`."""
    return w.reshape(heads, len(order), *w.shape[1:])[:, order].reshape(w.shape)


def qkv_sizes(c: GPTConfig) -> tuple[int, int, int]:
    return c.n_head * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim


# ---------------------------------------------------------------- writing


def export_gguf(folder: Path, out: Path, out_type: str = "f32") -> Path:
    """Write the store checkpoint in `folder` (ours or a mapped family) as one GGUF file llama.cpp runs."""
    import gguf

    if out_type not in GGUF_TYPES.values():
        raise GGUFError(f"out_type {out_type!r}: choose one of {', '.join(GGUF_TYPES.values())}")
    model, _ = load_gpt(folder)
    c = model.config
    arch_name = gguf_architecture(c)
    arch = GGUF_ARCHES[arch_name]
    vocab = vocabulary(folder, c.vocab_size, c.eos_token_id)
    part = out.with_name(out.name + ".part")  # a failed export leaves no file llama.cpp would half-read
    writer = gguf.GGUFWriter(str(part), arch_name)
    try:
        writer.add_name(folder.name)
        file_type = "ALL_F32" if out_type == "f32" else f"MOSTLY_{out_type.upper()}"
        writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
        write_hyperparameters(writer, c, arch_name)
        vocab.write(writer)
        for name, tensor in gguf_tensors(model, arch).items():
            write_tensor(writer, name, tensor, out_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise
    writer.close()
    return part.replace(out)


def write_hyperparameters(writer, c: GPTConfig, arch_name: str) -> None:
    import gguf

    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_head)
    if arch_name in ("llama", "qwen2", "qwen3"):
        writer.add_head_count_kv(c.kv_heads)
        writer.add_layer_norm_rms_eps(c.norm_eps)
    else:
        writer.add_layer_norm_eps(c.norm_eps)
    if c.head_dim * c.n_head != c.d_model:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if c.positions == "rope":
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_rope_dimension_count(c.rotated_channels)
        if (c.rope_scaling or {}).get("rope_type") == "linear":  # llama3's and others' are the rope_freqs tensor
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(c.rope_scaling["factor"])
    if arch_name == "gptneox":
        writer.add_parallel_residual(c.parallel_residual)


def gguf_tensors(model: GPT, arch: GGUFArch) -> dict[str, torch.Tensor]:
    """Our weights under GGUF's names, in its layout (float32)."""
    c = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {}
    for k, v in sd.items():
        module, kind = k.rsplit(".", 1)
        if module in TOP_TENSORS:
            out[f"{TOP_TENSORS[module]}.{kind}"] = v
    head = sd.get("lm_head.weight", sd["tok_emb.weight"])
    if c.scale_embeddings:  # llama.cpp adds no scale: the stored embedding carries it
        out["token_embd.weight"] = sd["tok_emb.weight"] * math.sqrt(c.d_model)
    out["output.weight"] = head  # written even when tied: not every llama.cpp architecture falls back
    if (c.rope_scaling or {}).get("rope_type") in ("llama3", "factors"):  # llama.cpp divides each frequency by one
        plain = inverse_frequencies(c.rotated_channels, c.rope_theta)
        out["rope_freqs.weight"] = plain / inverse_frequencies(c.rotated_channels, c.rope_theta, c.rope_scaling)
    order = pair_order(c.head_dim, c.rotated_channels, arch.rope_pairs) if arch.rope_pairs else None
    sizes = qkv_sizes(c)
    reordered = order is not None and c.rope_pairs != arch.rope_pairs
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"blk.{i}."
        for k, v in sd.items():
            if not k.startswith(ours):
                continue
            name, kind = k[len(ours) :].rsplit(".", 1)
            if name in ("attn.q_norm", "attn.k_norm") and reordered:  # per channel, before the rotation
                out[f"{theirs}{BLOCK_TENSORS[name]}.{kind}"] = v[order]
            elif name in BLOCK_TENSORS:
                out[f"{theirs}{BLOCK_TENSORS[name]}.{kind}"] = v
            elif name == "mlp.fc" and c.gated:  # ours is cat(gate, up)
                out[f"{theirs}ffn_gate.{kind}"], out[f"{theirs}ffn_up.{kind}"] = v.chunk(2)
            elif name == "mlp.fc":
                out[f"{theirs}ffn_up.{kind}"] = v
            elif name == "attn.qkv":
                q, k_, v_ = v.split(sizes)
                if reordered:
                    q, k_ = reorder_heads(q, c.n_head, order), reorder_heads(k_, c.kv_heads, order)
                if arch.fused_qkv:
                    out[f"{theirs}attn_qkv.{kind}"] = torch.cat([q, k_, v_])
                else:
                    for part, w in zip(("attn_q", "attn_k", "attn_v"), (q, k_, v_), strict=True):
                        out[f"{theirs}{part}.{kind}"] = w
            else:
                raise GGUFError(f"tensor {k} has no GGUF name")
    return out


def write_tensor(writer, name: str, tensor: torch.Tensor, out_type: str) -> None:
    """Matrices in out_type (q8_0 needs rows of whole 32-blocks, else f16, as llama.cpp's converter does);
    norms, biases and the rope factors in f32."""
    import gguf

    data = tensor.contiguous().numpy()
    kind = out_type if data.ndim == 2 and not name.startswith("rope_freqs") else "f32"
    if kind == "q8_0" and data.shape[-1] % 32:
        kind = "f16"
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    if kind == "f32":
        writer.add_tensor(name, data.astype(np.float32))
    elif kind == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (its regex split decides how text is cut)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        names = [name for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items() if regex == pattern]
        if names:
            return "llama-bpe" if "llama-bpe" in names else names[0]
    raise GGUFError(f"pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp name")


@dataclass
class Vocabulary:
    """A tokenizer as llama.cpp's fields: its model ('gpt2' or 'llama'), pieces in id order with their types
    (and scores), the special tokens (gguf.SpecialVocab), and the pre-tokenizer's name."""

    model: str
    tokens: list[str]
    types: list
    specials: Any
    scores: list[float] | None = None
    pre: str | None = None

    def write(self, writer) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        self.specials.add_to_gguf(writer, quiet=True)


def vocabulary(folder: Path, vocab_size: int, eos: int) -> Vocabulary:
    """The folder's tokenizer as llama.cpp's fields (checked before any write): SentencePiece's BPE
    (byte fallback: Llama 2, TinyLlama, Mistral) as llama.cpp's 'llama' vocabulary, else byte-level BPE ('gpt2')."""
    model = json.loads((folder / "tokenizer.json").read_text()).get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return sentencepiece_vocabulary(folder, vocab_size, eos)
    return byte_level_vocabulary(folder, vocab_size, eos)


def sentencepiece_vocabulary(folder: Path, vocab_size: int, eos: int) -> Vocabulary:
    """The folder's SentencePiece BPE as llama.cpp's 'llama' vocabulary. A piece's score is minus the rank of the
    merge that makes it: SentencePiece and llama.cpp merge the best-scored pair first, as BPE takes merges in order
    (transformers' GGUF reader recovers the merges from these scores)."""
    import gguf
    from tokenizers import Tokenizer

    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    model = tokenizer_json["model"]
    pieces = {i: text for text, i in model["vocab"].items()} | {
        t["id"]: t["content"] for t in tokenizer_json["added_tokens"]
    }
    if sorted(pieces) != list(range(len(pieces))) or len(pieces) > vocab_size:
        raise GGUFError(f"{folder / 'tokenizer.json'}: ids are not 0..n-1 within the model's vocab_size {vocab_size}")
    made_by = {}
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        made_by.setdefault(left + right, rank)
    special = {t["id"] for t in tokenizer_json["added_tokens"] if t.get("special")}
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        text = pieces.get(i, f"[PAD{i}]")  # embedding rows past the vocabulary
        tokens.append(text)
        scores.append(-float(made_by.get(text, 0)))
        if i not in pieces:
            types.append(gguf.TokenType.UNUSED)
        elif text == model.get("unk_token"):
            types.append(gguf.TokenType.UNKNOWN)
        elif i in special:
            types.append(gguf.TokenType.CONTROL)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    specials = gguf.SpecialVocab(folder, load_merges=False, n_vocab=vocab_size)
    specials.special_token_ids["eos"] = eos  # the model's own end of text, whatever the tokenizer files say
    bos = specials.special_token_ids.get("bos")
    starts = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("a").ids[:1]
    specials.add_special_token["bos"] = bos is not None and starts == [bos]  # the tokenizer starts a text with BOS
    return Vocabulary("llama", tokens, types, specials, scores=scores)


def byte_level_vocabulary(folder: Path, vocab_size: int, eos: int) -> Vocabulary:
    """The folder's byte-level BPE tokenizer as llama.cpp's 'gpt2' vocabulary."""
    import gguf

    try:
        bpe = gguf.vocab.BpeVocab(folder)
    except (FileNotFoundError, ValueError) as e:
        raise GGUFError(f"{folder / 'tokenizer.json'}: only byte-level BPE tokenizers are written ({e})") from None
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    pre = pre_tokenizer_name(tokenizer_json)
    special = {t["id"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    tokens, types = [], []
    for i, (text, _, kind) in enumerate(bpe.all_tokens()):
        tokens.append(text)
        types.append(gguf.TokenType.CONTROL if i in special else kind)
    if len(tokens) > vocab_size:
        raise GGUFError(f"tokenizer has {len(tokens)} tokens > the model's vocab_size {vocab_size}")
    for i in range(len(tokens), vocab_size):  # embedding rows past the vocabulary
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    specials = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    specials.special_token_ids["eos"] = eos  # the model's own end of text, whatever the tokenizer files say
    return Vocabulary("gpt2", tokens, types, specials, pre=pre)
