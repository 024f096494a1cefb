"""Our GPT as a Hugging Face GPT-NeoX checkpoint: `AutoModelForCausalLM.from_pretrained(OUT)` loads it
with no code of ours, so the model leaves the project (vLLM, llama.cpp's converter, lm-eval's `hf`).

The shipped GPT is a GPT-NeoX exactly: sequential residuals (`use_parallel_residual: false`), rotary
positions over the whole head, exact GELU, LayerNorm eps 1e-5. Three things differ in layout only:
- our token embedding is scaled by sqrt(d_model) inside the model: NeoX's `embed_in` stores it scaled,
  so its output head (`embed_out`) is the unscaled embedding, untied;
- our fused QKV projection stores all query heads, then all key heads, then all value heads; NeoX
  stores [q, k, v] per head;
- our rotary embedding rotates interleaved channel pairs (0, 1), (2, 3), ...; NeoX rotates (i, i + D/2):
  query and key rows are permuted within each head (even channels first), which leaves q . k unchanged.
Variants with no NeoX equivalent are refused by name.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from model_store.store import load_gpt, write_tokenizer
from models.gpt import GPT, GPTConfig

# setting -> the value NeoX can express
NEOX_SETTINGS = {
    "positions": "rope",
    "softmax": "softmax0",
    "score": "dot",
    "masking": "causal",
    "n_relational_head": 0,
    # the options of the transformers families (model_store/families.py): a store folder of theirs is
    # already a transformers checkpoint
    "norm": "layernorm",
    "mlp": "gelu",
    "n_kv_head": None,
    "head_size": None,
    "qk_norm": False,
    "rope_theta": 10000.0,
    "rope_pairs": "interleaved",
    "rotary_dim": None,
    "rope_scaling": None,
    "scale_embeddings": True,
    "parallel_residual": False,
    "qkv_bias": None,
    "out_bias": None,
    "mlp_bias": None,
}


class ExportError(ValueError):
    """The checkpoint has a setting GPT-NeoX cannot express; the message names it."""


def check_exportable(config: GPTConfig) -> None:
    refused = [
        f"{name}={getattr(config, name)!r} (NeoX needs {want!r})"
        for name, want in NEOX_SETTINGS.items()
        if getattr(config, name) != want
    ]
    if refused:
        raise ExportError("GPT-NeoX cannot express " + ", ".join(refused))


def neox_config(config: GPTConfig):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        intermediate_size=config.d_ff,
        hidden_act="gelu",  # exact (erf) GELU, as F.gelu
        max_position_embeddings=config.context_length,
        layer_norm_eps=1e-5,
        use_parallel_residual=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        attention_bias=True,
        tie_word_embeddings=False,
        bos_token_id=config.eos_token_id,
        eos_token_id=config.eos_token_id,
        architectures=["GPTNeoXForCausalLM"],
    )


def neox_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights renamed and rearranged into GPT-NeoX's layout (float32)."""
    c = model.config
    H, D, C = c.n_head, c.head_dim, c.d_model
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    zeros = torch.zeros
    rotate_half_order = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])  # interleaved -> halves

    def bias(name: str, size: int) -> torch.Tensor:
        return sd.get(name, zeros(size))  # bias=False models: NeoX's biases are zero

    out = {
        "gpt_neox.embed_in.weight": sd["tok_emb.weight"] * math.sqrt(C),
        "embed_out.weight": sd["lm_head.weight"] if "lm_head.weight" in sd else sd["tok_emb.weight"],
        "gpt_neox.final_layer_norm.weight": sd["ln_f.weight"],
        "gpt_neox.final_layer_norm.bias": sd["ln_f.bias"],
    }
    n_proj = {"none": 3, "qk": 2, "qkv": 1}[c.qkv_sharing]
    for i in range(c.n_layer):
        ours, neox = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        w = sd[ours + "attn.qkv.weight"].view(n_proj, H, D, C)
        b = bias(ours + "attn.qkv.bias", n_proj * H * D).view(n_proj, H, D)
        # shared projections are written out: q = k (qk) or q = k = v (qkv)
        q, k, v = {"none": (0, 1, 2), "qk": (0, 0, 1), "qkv": (0, 0, 0)}[c.qkv_sharing]
        wq, wk, wv = w[q][:, rotate_half_order], w[k][:, rotate_half_order], w[v]
        bq, bk, bv = b[q][:, rotate_half_order], b[k][:, rotate_half_order], b[v]
        out[neox + "attention.query_key_value.weight"] = torch.stack([wq, wk, wv], dim=1).reshape(3 * C, C)
        out[neox + "attention.query_key_value.bias"] = torch.stack([bq, bk, bv], dim=1).reshape(3 * C)
        out[neox + "attention.dense.weight"] = sd[ours + "attn.proj.weight"]
        out[neox + "attention.dense.bias"] = bias(ours + "attn.proj.bias", C)
        out[neox + "mlp.dense_h_to_4h.weight"] = sd[ours + "mlp.fc.weight"]
        out[neox + "mlp.dense_h_to_4h.bias"] = bias(ours + "mlp.fc.bias", c.d_ff)
        out[neox + "mlp.dense_4h_to_h.weight"] = sd[ours + "mlp.proj.weight"]
        out[neox + "mlp.dense_4h_to_h.bias"] = bias(ours + "mlp.proj.bias", C)
        for norm, theirs in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[neox + f"{theirs}.weight"] = sd[ours + f"{norm}.weight"]
            out[neox + f"{theirs}.bias"] = sd[ours + f"{norm}.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(folder: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GPT checkpoint in `folder` as a GPT-NeoX folder (config, safetensors, tokenizer, card)."""
    from transformers import GPTNeoXForCausalLM

    model, tokenizer = load_gpt(folder)
    check_exportable(model.config)
    with torch.device("meta"):
        neox = GPTNeoXForCausalLM(neox_config(model.config))
    state = neox_state_dict(model)
    if "lm_head.weight" in neox.state_dict():  # transformers 5 names NeoX's output head lm_head
        state["lm_head.weight"] = state.pop("embed_out.weight")
    neox.load_state_dict(state, strict=True, assign=True)
    out.mkdir(parents=True, exist_ok=True)
    neox.to(dtype).save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, tokenizer, model.config.context_length)
    card = folder / "README.md"
    if card.exists():
        note = f"GPT-NeoX export of `{folder.name}` (tinyserve export --format hf): loads with transformers alone.\n\n"
        (out / "README.md").write_text(note + card.read_text())
    return out
