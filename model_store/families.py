"""Which checkpoints the store accepts, what loads each, which runner serves it and which llama.cpp
architecture computes it: the one table (`FAMILIES`); loading, GGUF files both ways, export and the
runner choice all read it.

Our decoder (models/gpt.py) serves our own GPT and the transformers families mapped onto it here, as
gpt-fast and llama.cpp do: the checkpoint's config becomes a GPTConfig and its weights are renamed,
transposed (GPT-2's Conv1D) or regrouped (GPT-NeoX's per-head fused QKV) into ours; the files stay as
given. Any other transformers causal LM is served by transformers itself (the slow path); EsperBERTo's
masked LMs by transformers for fill-mask. A config value the decoder cannot compute exactly (a rope_scaling kind it
lacks, logit soft-capping, Mistral's one sliding window over every layer) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.config import GPTConfig


class UnsupportedConfig(ValueError):
    """A config value the decoder cannot serve exactly, named."""


class MissingTensor(LookupError):
    """A tensor the family's weights need is not in the file."""


@dataclass(frozen=True)
class GGUFArch:
    """A llama.cpp architecture as our decoder's settings (model_store/gguf_files.py reads and writes it)."""

    settings: dict  # GPTConfig fields it fixes
    rope_pairs: str | None  # the channel pairs it rotates; None: learned positions
    fused_qkv: bool  # one attn_qkv tensor, or attn_q, attn_k, attn_v
    sliding_pattern: int = 0  # with a sliding window, every layer but each n-th slides (llama.cpp's default); 0: none


@dataclass(frozen=True)
class Family:
    """A kind of checkpoint: what serves it, the transformers classes it answers to, how its config and weights
    become our decoder's, and the llama.cpp architecture of the same name (GGUF files in and out)."""

    name: str  # our GPT: "gpt"; a mapped family: its llama.cpp architecture's name
    runner: str  # "decoder": our decoder (GPTRunner); "transformers": transformers' causal LM; "fill-mask"
    architectures: tuple[str, ...] = ()  # the names in a transformers config.json's `architectures`
    config: Callable[[dict, int | None], GPTConfig] | None = None  # transformers config -> ours
    weights: Callable[[dict[str, torch.Tensor], GPTConfig], dict[str, torch.Tensor]] | None = None
    gguf: GGUFArch | None = None  # what llama.cpp's architecture `name` computes

    @property
    def kind(self) -> str:
        """What a served model of this family does: "causal" (completion, score, attention) or "mlm" (fill-mask)."""
        return "mlm" if self.runner == "fill-mask" else "causal"


def rope_settings(cfg: dict, partial_default: float = 1.0) -> tuple[float, dict | None, float]:
    """(theta, static scaling or None, fraction of a head rotated), from transformers 5's `rope_parameters`
    or the older `rope_theta` + `rope_scaling` (GPT-NeoX: `rotary_emb_base`, `rotary_pct`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0)))
    partial = params.get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct", partial_default))
    )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedConfig(f"rope_scaling kind {kind!r} is not served (default, linear, llama3)")
    scaling = None
    if kind == "linear":
        scaling = {"rope_type": kind, "factor": params["factor"]}
    elif kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": kind, **{k: params[k] for k in keys}}
    return float(theta), scaling, float(partial)


def context_of(cfg: dict, key: str, max_context: int | None) -> int:
    """The positions served: the checkpoint's, capped (the static cache holds this many per slot)."""
    return min(cfg[key], max_context) if max_context else cfg[key]


def eos_of(cfg: dict) -> int:
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise UnsupportedConfig("eos_token_id is not set: the end of a completion cannot be told")
    return int(eos)


def served_config(cfg: dict, **options) -> GPTConfig:
    """Our decoder's config for a transformers checkpoint: what every family shares (no dropout, the
    embedding as stored, the checkpoint's end-of-text token) and its own options."""
    return GPTConfig(**{"dropout": 0.0, "scale_embeddings": False, "eos_token_id": eos_of(cfg)} | options)


def llama_config(cfg: dict, max_context: int | None) -> GPTConfig:
    """Llama, Mistral, Qwen2 and Qwen3: RMSNorm, SwiGLU, grouped-query attention, rotate-half RoPE."""
    arch = cfg["architectures"][0]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(f"hidden_act {cfg['hidden_act']!r} is not served for {arch} (silu)")
    context = context_of(cfg, "max_position_embeddings", max_context)
    # Mistral's window applies whenever set; Qwen's only with use_sliding_window (default false)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None
    if window is not None and window < context:
        raise UnsupportedConfig(
            f"sliding_window {window} < the served context {context} is not served (a smaller max_context is)"
        )
    theta, scaling, _ = rope_settings(cfg)
    heads = cfg["num_attention_heads"]
    qwen2 = arch == "Qwen2ForCausalLM"
    return served_config(
        cfg,
        vocab_size=cfg["vocab_size"],
        context_length=context,
        n_layer=cfg["num_hidden_layers"],
        n_head=heads,
        n_kv_head=cfg.get("num_key_value_heads") or heads,
        d_model=cfg["hidden_size"],
        d_ff=cfg["intermediate_size"],
        head_size=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        tie_weights=bool(cfg.get("tie_word_embeddings", False)),
        bias=False,
        qkv_bias=qwen2 or bool(cfg.get("attention_bias", False)),
        out_bias=bool(cfg.get("attention_bias", False)) and not qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        positions="rope",
        norm="rmsnorm",
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        qk_norm=arch == "Qwen3ForCausalLM",
        rope_theta=theta,
        rope_pairs="half",
        rope_scaling=scaling,
    )


def llama_weights(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    out = {"tok_emb.weight": state["model.embed_tokens.weight"], "ln_f.weight": state["model.norm.weight"]}
    for i in range(config.n_layer):  # q/k/v, gate/up popped as joined: a load holds each layer's weights once
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in state:
                out[dst + f"attn.qkv.{kind}"] = torch.cat([state.pop(attn + f"{p}_proj.{kind}") for p in "qkv"])
            if attn + f"o_proj.{kind}" in state:
                out[dst + f"attn.proj.{kind}"] = state[attn + f"o_proj.{kind}"]
            if src + f"mlp.gate_proj.{kind}" in state:  # gate then up: one product (models/gpt.py, MLP)
                out[f"{dst}mlp.fc.{kind}"] = torch.cat([state.pop(f"{src}mlp.{p}_proj.{kind}") for p in ("gate", "up")])
                out[dst + f"mlp.proj.{kind}"] = state[src + f"mlp.down_proj.{kind}"]
        for norm in ("q_norm", "k_norm"):
            if attn + f"{norm}.weight" in state:
                out[dst + f"attn.{norm}.weight"] = state[attn + f"{norm}.weight"]
        out[dst + "ln_1.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "ln_2.weight"] = state[src + "post_attention_layernorm.weight"]
    return with_head(out, state, config, "lm_head.weight")


LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}  # transformers' names -> ours


def gemma3_config(cfg: dict, max_context: int | None) -> GPTConfig:
    """Gemma 3 (text): GeGLU, q/k RMSNorm, norms before and after attention and the MLP, the embedding x sqrt(hidden),
    scores x query_pre_attn_scalar^-0.5, and sliding-window layers (their own RoPE base) between full ones."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise UnsupportedConfig(f"{key}={cfg[key]!r} is not served for Gemma 3")
    if activation(cfg.get("hidden_activation", "gelu_pytorch_tanh")) != "gelu_tanh":
        raise UnsupportedConfig(f"hidden_activation {cfg['hidden_activation']!r} is not served for Gemma 3")
    n_layer, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)
    ]
    if set(types) - set(LAYER_TYPES):
        raise UnsupportedConfig(f"layer_types {sorted(set(types) - set(LAYER_TYPES))} are not served")
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type:  # transformers 5: one rope_parameters per layer type
        theta, scaling, _ = rope_settings({"rope_parameters": per_type["full_attention"]})
        local, local_scaling, _ = rope_settings({"rope_parameters": per_type["sliding_attention"]})
    else:
        theta, scaling, _ = rope_settings(cfg)
        local, local_scaling = float(cfg.get("rope_local_base_freq", 10000.0)), None
    if local_scaling is not None:
        raise UnsupportedConfig("rope scaling of the sliding layers is not served")
    return served_config(
        cfg,
        vocab_size=cfg["vocab_size"],
        context_length=context_of(cfg, "max_position_embeddings", max_context),
        n_layer=n_layer,
        n_head=heads,
        n_kv_head=cfg.get("num_key_value_heads") or heads,
        d_model=cfg["hidden_size"],
        d_ff=cfg["intermediate_size"],
        head_size=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        tie_weights=bool(cfg.get("tie_word_embeddings", True)),
        bias=False,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        out_bias=bool(cfg.get("attention_bias", False)),
        **GEMMA3,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        attn_scale=float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256))) ** -0.5,
        layer_types=[LAYER_TYPES[t] for t in types],
        sliding_window=int(cfg["sliding_window"]),
        rope_theta=theta,
        rope_local_theta=local,
        rope_pairs="half",
        rope_scaling=scaling,
    )


def gemma3_weights(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Llama's names, but Gemma's post_attention_layernorm is attention's output norm, pre_feedforward_layernorm
    the MLP's input norm; and a Gemma RMSNorm scales by (1 + w): every norm's weight is stored with the 1 added
    (in float32, as Gemma computes it; llama.cpp's converter does the same)."""
    out = llama_weights(state, config)
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        out[dst + "ln_2.weight"] = state[src + "pre_feedforward_layernorm.weight"]
        out[dst + "post_ln_1.weight"] = state[src + "post_attention_layernorm.weight"]
        out[dst + "post_ln_2.weight"] = state[src + "post_feedforward_layernorm.weight"]
    return {
        k: 1 + v.float() if k.rsplit(".", 2)[-2].endswith(("ln_1", "ln_2", "ln_f", "_norm")) else v
        for k, v in out.items()
    }


def gpt2_config(cfg: dict, max_context: int | None) -> GPTConfig:
    """GPT-2: learned positions, LayerNorm, GELU (tanh approximation by default), fused QKV."""
    if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedConfig("GPT-2 attention scaled other than by 1/sqrt(head_dim) is not served")
    return served_config(
        cfg,
        vocab_size=cfg["vocab_size"],
        context_length=context_of(cfg, "n_positions", max_context),
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        d_model=cfg["n_embd"],
        d_ff=cfg.get("n_inner") or 4 * cfg["n_embd"],
        tie_weights=bool(cfg.get("tie_word_embeddings", True)),
        bias=True,
        positions="learned",
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        mlp=activation(cfg.get("activation_function", "gelu_new")),
    )


def gpt2_weights(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    out = {
        "tok_emb.weight": state["wte.weight"],
        "pos_emb.weight": state["wpe.weight"][: config.context_length],
        "ln_f.weight": state["ln_f.weight"],
        "ln_f.bias": state["ln_f.bias"],
    }
    names = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
    for i in range(config.n_layer):
        src, dst = f"h.{i}.", f"blocks.{i}."
        for theirs, ours in names.items():  # Conv1D keeps (in, out): ours is (out, in)
            out[dst + ours + ".weight"] = state[src + theirs + ".weight"].t().contiguous()
            out[dst + ours + ".bias"] = state[src + theirs + ".bias"]
        for norm in ("ln_1", "ln_2"):
            out[dst + norm + ".weight"], out[dst + norm + ".bias"] = (
                state[src + norm + ".weight"],
                state[src + norm + ".bias"],
            )
    return with_head(out, state, config, "lm_head.weight")


def neox_config(cfg: dict, max_context: int | None) -> GPTConfig:
    """GPT-NeoX (Pythia): LayerNorm, GELU, a per-head fused QKV, RoPE on part of each head, parallel residual."""
    theta, scaling, partial = rope_settings(cfg, partial_default=0.25)
    heads, d_model = cfg["num_attention_heads"], cfg["hidden_size"]
    bias = bool(cfg.get("attention_bias", True))
    return served_config(
        cfg,
        vocab_size=cfg["vocab_size"],
        context_length=context_of(cfg, "max_position_embeddings", max_context),
        n_layer=cfg["num_hidden_layers"],
        n_head=heads,
        d_model=d_model,
        d_ff=cfg["intermediate_size"],
        tie_weights=bool(cfg.get("tie_word_embeddings", False)),
        bias=True,
        qkv_bias=bias,
        out_bias=bias,
        positions="rope",
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        mlp=activation(cfg.get("hidden_act", "gelu")),
        rope_theta=theta,
        rope_pairs="half",
        rotary_dim=int(d_model // heads * partial),
        rope_scaling=scaling,
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
    )


def neox_weights(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    H, D, C = config.n_head, config.head_dim, config.d_model
    out = {
        "tok_emb.weight": state["gpt_neox.embed_in.weight"],
        "ln_f.weight": state["gpt_neox.final_layer_norm.weight"],
        "ln_f.bias": state["gpt_neox.final_layer_norm.bias"],
    }
    names = {
        "input_layernorm": "ln_1",
        "post_attention_layernorm": "ln_2",
        "attention.dense": "attn.proj",
        "mlp.dense_h_to_4h": "mlp.fc",
        "mlp.dense_4h_to_h": "mlp.proj",
    }
    for i in range(config.n_layer):
        src, dst = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        for theirs, ours in names.items():
            for kind in ("weight", "bias"):
                if src + f"{theirs}.{kind}" in state:
                    out[dst + f"{ours}.{kind}"] = state[src + f"{theirs}.{kind}"]
        qkv = src + "attention.query_key_value."
        # rows ordered (head, q/k/v, channel): ours are all queries, then all keys, then all values
        out[dst + "attn.qkv.weight"] = state[qkv + "weight"].view(H, 3, D, C).transpose(0, 1).reshape(3 * H * D, C)
        if qkv + "bias" in state:
            out[dst + "attn.qkv.bias"] = state[qkv + "bias"].view(H, 3, D).transpose(0, 1).reshape(3 * H * D)
    return with_head(out, state, config, "embed_out.weight", "lm_head.weight")


def activation(name: str) -> str:
    """transformers' activation name -> our MLP kind."""
    kinds = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    if name not in kinds:
        raise UnsupportedConfig(f"activation {name!r} is not served ({', '.join(kinds)})")
    return kinds[name]


def with_head(out: dict, state: dict, config: GPTConfig, *names: str) -> dict[str, torch.Tensor]:
    """The LM head from the first of `names` the file has; none: the head is the tied embedding."""
    head = next((state[n] for n in names if n in state), None)
    if head is not None:
        out["lm_head.weight"] = head
    elif not config.tie_weights:
        raise UnsupportedConfig(f"no LM head ({' or '.join(names)}) and tie_word_embeddings is false")
    return out


ROPE = dict(positions="rope", parallel_residual=False)
SWIGLU = dict(ROPE, norm="rmsnorm", mlp="swiglu")
GEMMA3 = dict(ROPE, norm="rmsnorm", mlp="geglu", qk_norm=True, post_norms=True, scale_embeddings=True)
FAMILIES: tuple[Family, ...] = (
    Family("gpt", "decoder"),  # ours: config.json says "architecture": "gpt"; GGUF: gguf_architecture(config)
    Family("llama", "decoder", ("LlamaForCausalLM", "MistralForCausalLM"), llama_config, llama_weights,
           GGUFArch(dict(SWIGLU, qk_norm=False), "interleaved", False)),
    Family("qwen2", "decoder", ("Qwen2ForCausalLM",), llama_config, llama_weights,
           GGUFArch(dict(SWIGLU, qk_norm=False), "half", False)),  # q, k, v biases
    Family("qwen3", "decoder", ("Qwen3ForCausalLM",), llama_config, llama_weights,
           GGUFArch(dict(SWIGLU, qk_norm=True), "half", False)),
    Family("gemma3", "decoder", ("Gemma3ForCausalLM",), gemma3_config, gemma3_weights,
           GGUFArch(GEMMA3, "half", False, sliding_pattern=6)),
    Family("gpt2", "decoder", ("GPT2LMHeadModel",), gpt2_config, gpt2_weights,
           GGUFArch(dict(positions="learned", norm="layernorm", mlp="gelu_tanh", parallel_residual=False), None, True)),
    Family("gptneox", "decoder", ("GPTNeoXForCausalLM",), neox_config, neox_weights,
           GGUFArch(dict(positions="rope", norm="layernorm", mlp="gelu"), "half", True)),
    Family("transformers", "transformers"),  # any other *ForCausalLM / *LMHeadModel: transformers, slow
    Family("mlm", "fill-mask", ("RobertaForMaskedLM", "ModernBertForMaskedLM")),  # EsperBERTo
)  # fmt: skip
BY_NAME = {f.name: f for f in FAMILIES}
BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
GGUF_ARCHES = {f.name: f.gguf for f in FAMILIES if f.gguf is not None}


def family_of(config: dict) -> Family | None:
    """The family of a checkpoint's config.json: ours, a mapped transformers family, another transformers
    causal LM (served by transformers), or None (not served)."""
    if config.get("architecture") == "gpt":
        return BY_NAME["gpt"]
    for name in config.get("architectures") or []:
        if name in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[name]
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return BY_NAME["transformers"]
    return None


def served_names() -> str:
    """The architectures the store accepts, for a refusal's message."""
    return f"ours, {', '.join(BY_ARCHITECTURE)}, or another transformers *ForCausalLM"


def decoder_checkpoint(
    config: dict, state: dict[str, torch.Tensor], max_context: int | None = None
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A mapped family's config and weights as our decoder's."""
    family = family_of(config)
    if family is None or family.config is None:
        raise UnsupportedConfig(f"architecture {config.get('architectures')!r} has no mapping onto the decoder")
    ours = family.config(config, max_context)
    try:
        return ours, family.weights(state, ours)
    except KeyError as e:
        raise MissingTensor(str(e)) from None
