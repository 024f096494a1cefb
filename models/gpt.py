"""A from-scratch decoder-only transformer (GPT) for next-token completion.

Written out nanoGPT-style: token embedding scaled by sqrt(d_model), positions (rotary on queries and
keys in the shipped model; an added sinusoidal or learned table as options), pre-LayerNorm blocks of
multi-head causal self-attention (heads concatenated, then projected) and a GELU MLP, and an
(optionally tied) language-model head. The configuration is models/config.py.

One forward path, as in gpt-fast: `forward(idx)` runs causal attention over the tokens given (training,
scoring, attention maps); `forward(idx, input_pos=..., cache=...)` also writes their keys and values
into a static KV cache at those positions and attends over it (prompts, then one token per step). The
caller owns the cache (`new_cache`, or views of one) and says which attention kernel it wants: the
model holds no serving state and makes no serving choice.

The same decoder serves the small-LM families people use (model_store/families.py maps their
checkpoints in): RMSNorm or LayerNorm, GELU (erf or tanh) or SwiGLU MLP, grouped-query attention
(n_kv_head < n_head), RoPE on all or part of each head with interleaved or rotate-half pairs, its theta
and static scaling, QK-norm, biases per projection, parallel or sequential residual, learned positions, and Gemma
3's GeGLU, norms after attention and the MLP, attention scale, sliding-window layers (their own RoPE base).

The attention variants of the experiments (docs/experiments/) are options of this one file: score
function (dot product or additive), shared Q/K or Q/K/V projections, masking (-inf before the
normaliser, or the naive zeroing after it, which leaks the future and is kept as a demonstration),
normaliser (softmax or softmax1), positions, and dual attention: standard heads plus relational heads
(Altabaa et al., models/relational.py).

Shapes: B batch, T new tokens, S = cached + new tokens (keys), C = d_model, H heads (self-attention
plus relational), KV key/value heads, G = H / KV, D head width (C // H unless set), R relations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.additive import AdditiveScore
from models.config import GPTConfig
from models.kv_cache import PagedKVCache, StaticKVCache, write_layer
from models.positions import inverse_frequencies, rope, rope_rotation, sinusoidal_encoding
from models.relational import RelationalAttention
from models.sampling import SamplingParams
from models.softmax import get_softmax


class CausalSelfAttention(nn.Module):
    """n_head self-attention heads (+ n_relational_head relational heads): concatenated, projected."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.sharing = config.qkv_sharing
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        width = {"none": (H + 2 * KV) * D, "qk": 2 * H * D, "qkv": H * D}[config.qkv_sharing]
        self.qkv = nn.Linear(config.d_model, width, bias=config.has_bias("qkv"))
        self.q_norm = RMSNorm(D, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.norm_eps) if config.qk_norm else None
        self.rope_pairs = config.rope_pairs
        self.additive = AdditiveScore(self.n_head, self.head_dim) if config.score == "additive" else None
        self.relational = RelationalAttention(config) if config.n_relational_head else None
        heads = (H + config.n_relational_head) * D
        self.proj = nn.Linear(heads, config.d_model, bias=config.has_bias("out"))  # after concatenating heads
        self.attn_dropout = config.attn_dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.softmax = get_softmax(config.softmax)
        self.masking = config.masking
        self.fused = config.softmax == "softmax0" and config.score == "dot" and config.masking == "causal"
        self.scale = config.attn_scale  # None: 1/sqrt(D)

    def cache_shapes(self) -> list[tuple[int, int]]:
        """(heads, head width) of each tensor this layer keeps per token: keys, values (and relational ones)."""
        own = [(self.n_kv_head, self.head_dim)] * 2
        return own + (self.relational.cache_shapes() if self.relational is not None else [])

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        mask: torch.Tensor | None,  # (B, 1, T, S) bool, True = may attend; None = causal over the T tokens
        positions: torch.Tensor,  # (B, T) positions of the tokens
        rotation: tuple[torch.Tensor, torch.Tensor] | None,  # RoPE's (cos, sin) at those positions
        cache: list[torch.Tensor] | None,  # this layer's buffers of the KV cache, each (B, *, context, *)
        return_attention: bool,
        fused_attention: bool,  # SDPA's one op where this layer's options allow it, else the explicit product
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, C = x.shape
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        heads = self.qkv(x).view(B, T, -1, D).transpose(1, 2)  # (B, H + 2 KV, T, D)
        if self.sharing == "qkv":
            q = k = v = heads
        elif self.sharing == "qk":
            q, v = heads.split(H, dim=1)
            k = q
        else:
            q, k, v = heads.split([H, KV, KV], dim=1)  # (B, H, T, D), (B, KV, T, D), (B, KV, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotation is not None:
            q, k = rope(q, rotation, self.rope_pairs), rope(k, rotation, self.rope_pairs)
        cached = [k, v]
        if self.relational is not None:
            rel_queries, rel_cached = self.relational.project(x, rotation)
            cached += rel_cached
        if cache is not None:
            cached = write_layer(cache, positions, *cached)  # each (B, *, S, *)
        k, v = cached[:2]
        dropout_p = self.attn_dropout if self.training else 0.0
        weights = None
        grouped = KV != H  # each key/value head serves G = H / KV query heads
        if self.fused and fused_attention and not return_attention:
            causal = mask is None and T > 1
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.scale, enable_gqa=grouped
            )
        else:
            if self.additive is not None:
                scores = self.additive(q, k)  # (B, H, T, S)
            elif grouped:  # a group's heads broadcast over its key head: compiled, one token is one reduction
                q5 = q.reshape(B, KV, H // KV, T, D)  # (B, KV, G, T, D)
                scores = self._scaled(q5 @ k.unsqueeze(2).transpose(-2, -1)).view(B, H, T, -1)  # (B, H, T, S)
            else:
                scores = self._scaled(q @ k.transpose(-2, -1))  # (B, H, T, S)
            weights = self._weights(scores, mask)
            weights = F.dropout(weights, dropout_p, self.training)
            if grouped:
                y = (weights.view(B, KV, H // KV, T, -1) @ v.unsqueeze(2)).view(B, H, T, D)  # (B, H, T, D)
            else:
                y = weights @ v  # (B, H, T, D)
        if self.relational is not None:
            normalise = partial(self._weights, mask=mask)
            query_columns = positions if cache is not None else None  # column = position
            y_rel, alpha = self.relational(rel_queries, cached[2:], normalise, dropout_p, query_columns)
            y = torch.cat([y, y_rel], dim=1)  # (B, H + H_rel, T, D)
            weights = torch.cat([weights, alpha], dim=1) if weights is not None else None
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # concatenate the heads
        return self.resid_dropout(self.proj(y)), weights

    def _scaled(self, products: torch.Tensor) -> torch.Tensor:
        return products / math.sqrt(self.head_dim) if self.scale is None else products * self.scale

    def _weights(self, scores: torch.Tensor, mask: torch.Tensor | None):
        """(B, H, T, S) scores -> attention weights under the configured masking."""
        T, S = scores.shape[-2:]
        if mask is None:  # causal over the T == S tokens given
            mask = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril(S - T)
        if self.masking == "causal":
            return self.softmax(scores.masked_fill(~mask, float("-inf")), -1)  # -inf *before* the normaliser
        # "zero_after", the naive mask: normalise over every key, future ones included, then zero the
        # future weights. Their scores already shaped the denominator, so the future leaks into the
        # present: training loss looks great, generation (which has no future) is garbage. Over a
        # cache, the keys that exist are those up to the last query (the rest are not written yet).
        scores = scores.masked_fill(~mask[..., -1:, :], float("-inf"))
        return self.softmax(scores, -1) * mask


class MLP(nn.Module):
    """proj(gelu(fc(x))), or a gated unit, proj(act(gate(x)) * up(x)) with gate and up as one product (fc):
    SwiGLU (act = silu), GeGLU (act = GELU's tanh approximation)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind, self.gated = config.mlp, config.gated
        width = 2 * config.d_ff if config.gated else config.d_ff
        self.fc = nn.Linear(config.d_model, width, bias=config.has_bias("mlp"))
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.has_bias("mlp"))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        h = self.fc(x)  # (B, T, d_ff) or, gated, (B, T, 2 d_ff): gate then up
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")) * up
        else:
            h = F.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.dropout(self.proj(h))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast to the weight's dtype before the weight (as Llama's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.weight.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm of the float32 residual stream, in the weight's dtype (what the next layer's products take)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def norm_layer(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, eps=config.norm_eps)


class Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); parallel_residual: x + attn(ln_1(x)) + mlp(ln_2(x))
    (GPT-NeoX); post_norms: each branch normed before its add, x + post_ln_1(attn(ln_1(x))) (Gemma 3)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm_layer(config)
        self.mlp = MLP(config)
        self.parallel = config.parallel_residual
        self.post_ln_1 = norm_layer(config) if config.post_norms else None
        self.post_ln_2 = norm_layer(config) if config.post_norms else None

    def forward(self, x, mask, positions, rotation, cache, return_attention, fused_attention, steer=None):
        """steer (B, C): added to every position of the block's output (activation steering). Here, so that a
        block's compiled region holds the add: outside it, each layer's slice of the table is a kernel of its own."""
        a, weights = self.attn(self.ln_1(x), mask, positions, rotation, cache, return_attention, fused_attention)
        if self.post_ln_1 is not None:
            a = self.post_ln_1(a)
        if self.parallel:
            x = x + a + self.mlp(self.ln_2(x))
        else:
            x = x + a
            m = self.mlp(self.ln_2(x))
            x = x + (self.post_ln_2(m) if self.post_ln_2 is not None else m)
        return (x if steer is None else x + steer.unsqueeze(1)), weights


@dataclass
class GPTOutput:
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None = None
    attentions: list[torch.Tensor] | None = None  # per layer, (B, H, T, S)


def sliding_mask(mask: torch.Tensor | None, positions: torch.Tensor, window: int) -> torch.Tensor | None:
    """`mask` (B, 1, T, S) narrowed to keys less than `window` positions before each query (column = position); None
    (causal over the T tokens given) stays None while no query can see past the window."""
    T = positions.shape[1]
    if mask is None:
        if T <= window:
            return None
        mask = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril().expand(positions.shape[0], 1, T, T)
    keys = torch.arange(mask.shape[-1], device=positions.device)
    return mask & (keys > positions.unsqueeze(-1) - window).unsqueeze(1)


def position_table(config: GPTConfig) -> torch.Tensor:
    """The sinusoidal encoding of positions 0..context_length-1, (context_length, C)."""
    return sinusoidal_encoding(torch.arange(config.context_length, device="cpu").unsqueeze(0), config.d_model)[0]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.pos_emb = nn.Embedding(config.context_length, config.d_model)
        if config.positions == "sinusoidal":  # a lookup per decode step instead of sin and cos of every angle
            self.register_buffer("pe_table", position_table(config), persistent=False)  # (context_length, C)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm_layer(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def from_state(cls, config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
        """The model with a checkpoint's tensors as its parameters: built on the meta device, so nothing is
        initialised at random or held twice. A tensor the state lacks stays on meta."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_weights:  # assigning tok_emb's tensor untied it
            model.lm_head.weight = model.tok_emb.weight
        if config.positions == "sinusoidal":
            model.pe_table = position_table(config).to(model.tok_emb.weight.dtype)
        return model

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, rows: int, columns: int | None = None, zeroed: int | None = None) -> StaticKVCache:
        """A KV cache of `rows` slots of `columns` positions (default context_length), in the weights'
        dtype and device (zeroed: StaticKVCache.empty)."""
        p = next(self.parameters())
        shapes = [block.attn.cache_shapes() for block in self.blocks]
        return StaticKVCache.empty(shapes, rows, columns or self.config.context_length, p.dtype, p.device, zeroed)

    def forward(
        self,
        idx: torch.Tensor,  # (B, T) token ids
        targets: torch.Tensor | None = None,  # (B, T), -100 = ignore
        *,
        input_pos: torch.Tensor | None = None,  # (B, T) positions: write to `cache` and attend over it
        cache: StaticKVCache | PagedKVCache | None = None,  # with input_pos
        return_attention: bool = False,
        logits_at: torch.Tensor | None = None,  # (B,) one index per row: only its logits, (B, 1, vocab)
        fused_attention: bool = True,  # False: the explicit product, which a compiler fuses into a one-token step
        resid_pre: tuple[int, torch.Tensor] | None = None,  # (l, (B, T, C)): start at block l from this residual
        steer: torch.Tensor | None = None,  # (B, n_layer, C): steer[:, l] added to every position after block l
    ) -> GPTOutput:
        B, T = idx.shape
        if input_pos is None:  # the tokens alone, at positions 0..T-1, causal
            positions, mask, cache = torch.arange(T, device=idx.device).expand(B, T), None, None
        elif cache is None:
            raise ValueError("input_pos needs the cache to write to (GPT.new_cache)")
        else:
            positions, cache = input_pos, cache.at(input_pos)
            mask = cache.visible(input_pos)  # (B, 1, T, S): keys at positions <= each query's
        args = positions, mask, cache, return_attention, fused_attention
        return self._blocks(idx, *args, targets, logits_at, resid_pre, steer)

    def _blocks(
        self, idx, position_ids, mask, kv_cache, return_attention, fused_attention, targets, logits_at, resid_pre, steer
    ) -> GPTOutput:
        """Embeddings (or the residual stream given before a block), the blocks, the LM head (and the loss
        when targets are given)."""
        first, x = resid_pre if resid_pre is not None else (0, self._embed(idx, position_ids, kv_cache))
        # the residual stream in float32 whatever the weights' dtype (as llama.cpp keeps its activations): half
        # precision then rounds each block's output once, not the running sum of 30 blocks, which moved a real
        # bf16 model's logits by up to 0.35 from float32's and parted its greedy tokens where float32's were clear
        x = x.float()
        c, kinds = self.config, list(dict.fromkeys(self.config.layer_types or ["full"]))  # in order: one traced graph
        masks = {kind: mask if kind == "full" else sliding_mask(mask, position_ids, c.sliding_window) for kind in kinds}
        rotations = dict.fromkeys(kinds)
        for kind in kinds if c.positions == "rope" else ():  # sliding layers: their own base, unscaled
            base = (c.rope_local_theta or c.rope_theta, None) if kind == "sliding" else (c.rope_theta, c.rope_scaling)
            inv_freq = inverse_frequencies(c.rotated_channels, *base, idx.device)
            rotations[kind] = rope_rotation(position_ids, c.rotated_channels, self.ln_f.weight.dtype, inv_freq)
        attentions = [] if return_attention else None
        for layer, block in enumerate(self.blocks[first:], start=first):
            cache = kv_cache.layer(layer) if kv_cache is not None else None
            kind = c.layer_type(layer)
            steered = () if steer is None else (steer[:, layer],)  # llama.cpp's control vectors: a plain row adds 0
            args = masks[kind], position_ids, rotations[kind], cache, return_attention, fused_attention, *steered
            x, weights = block(x, *args)
            if attentions is not None:
                attentions.append(weights)
        if logits_at is not None:  # a prefill needs each prompt's last position only: the head is the largest matmul
            x = x[torch.arange(x.shape[0], device=x.device), logits_at].unsqueeze(1)  # (B, 1, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)

        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return GPTOutput(logits=logits, loss=loss, attentions=attentions)

    def _embed(
        self, idx: torch.Tensor, position_ids: torch.Tensor, kv_cache: StaticKVCache | PagedKVCache | None
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T, C): the residual stream before the first block."""
        x = self.tok_emb(idx)  # (B, T, C)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)  # as in the paper
        if self.config.positions == "sinusoidal":
            if kv_cache is not None or idx.shape[1] <= self.pe_table.shape[0]:  # cached positions < context
                x = x + self.pe_table[position_ids].to(x.dtype)
            else:  # past the training context: computed on the fly
                x = x + sinusoidal_encoding(position_ids, self.config.d_model).to(x.dtype)
        elif self.config.positions == "learned":
            x = x + self.pos_emb(position_ids)
        return self.drop(x)  # "rope" rotates queries and keys inside attention instead

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # (1, T) -> (1, N)
        """Sample one continuation with the serving engine's sampler (models/sampling.py).

        Same prompt, params and seed give the same tokens as the server. The prompt is cut to the last
        context_length tokens; generation stops at the context limit or at the end-of-text token.
        Stop sequences are matched on text, which is the detokenizer's job: the server's, not this.
        """
        from models.generation import continuations  # which runs this model

        return idx.new_tensor([continuations(self, idx, [params])[0]])
