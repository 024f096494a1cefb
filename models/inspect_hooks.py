"""Looking inside the decoder: the logit lens, head ablation and activation patching.

Forward hooks at the decoder's named points, which every family mapped onto it has (TransformerLens's
names in brackets):
- the residual stream before block l: block l's input (`blocks.{l}.hook_resid_pre`); after the last
  block: the final norm's input (`blocks.{L-1}.hook_resid_post`);
- the heads' outputs before the output projection: `attn.proj`'s input, head h in columns
  h*D..(h+1)*D (`blocks.{l}.attn.hook_z`).
The model's own code runs unchanged: what is computed here is what it computes, with one stream
read, zeroed or replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from models.gpt import GPT
from models.kv_cache import StaticKVCache

PreHook = Callable[[nn.Module, tuple], tuple | None]
PostHook = Callable[[nn.Module, tuple, object], object]


@contextlib.contextmanager
def hooked(pre: dict[nn.Module, PreHook], post: dict[nn.Module, PostHook] | None = None) -> Iterator[None]:
    """Forward hooks on these modules (before and after their forward) for the duration of the block."""
    handles = [module.register_forward_pre_hook(hook) for module, hook in pre.items()]
    handles += [module.register_forward_hook(hook) for module, hook in (post or {}).items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def residual_streams(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """(1, T) ids -> (n_layer + 1, T, C): the residual stream after the embedding (block 0's input),
    then after each block (the last block's output is what the final norm reads)."""
    seen: list[torch.Tensor] = []

    def before(module: nn.Module, args: tuple) -> None:
        seen.append(args[0][0])

    def after(module: nn.Module, args: tuple, output: tuple) -> None:
        seen.append(output[0][0])

    with hooked({block: before for block in model.blocks}, {model.blocks[-1]: after}):
        model(ids, logits_at=torch.tensor([ids.shape[1] - 1], device=ids.device))
    return torch.stack(seen)


def unembed(model: GPT, resid: torch.Tensor) -> torch.Tensor:
    """(..., C) residual streams -> (..., V) logits: the model's own final norm and LM head."""
    return model.lm_head(model.ln_f(resid))


def logit_lens(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """(1, T) ids -> (n_layer + 1, T, V) log-probabilities: what each layer's residual stream would
    predict; the last entry is the model's own prediction."""
    return torch.log_softmax(unembed(model, residual_streams(model, ids)).float(), dim=-1)


def heads_z(model: GPT) -> tuple[int, int]:
    """(heads, head width) of every block's output projection input."""
    attn = model.blocks[0].attn
    width = attn.head_dim
    return attn.proj.in_features // width, width


def ablated(model: GPT, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The last position's log-probabilities with heads zeroed before their output projection.

    ids (1, T); keep (R, n_layer, H), 1 keeps a head, 0 ablates it: one batched pass of R rows ->
    (R, V) log-probabilities, in float64 (a KL between two of them is a small difference of large terms)."""
    R, T = keep.shape[0], ids.shape[1]
    H, D = heads_z(model)
    keep = keep.to(device=ids.device)

    def zeroing(layer: int) -> PreHook:
        def hook(module: nn.Module, args: tuple) -> tuple:
            z = args[0]  # (R, T, H * D)
            mask = keep[:, layer].to(z.dtype).repeat_interleave(D, dim=-1)  # (R, H * D)
            return (z * mask[:, None, :],)

        return hook

    with hooked({block.attn.proj: zeroing(i) for i, block in enumerate(model.blocks)}):
        out = model(ids.expand(R, T), logits_at=torch.full((R,), T - 1, device=ids.device))
    return torch.log_softmax(out.logits[:, 0].double(), dim=-1)


def corrupt_run(model: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, StaticKVCache]:
    """(1, T) ids -> their residual streams (n_layer + 1, T, C) and the KV cache they wrote: what patched
    runs start from."""
    cache = model.new_cache(1, ids.shape[1])
    seen: list[torch.Tensor] = []

    def before(module: nn.Module, args: tuple) -> None:
        seen.append(args[0][0])

    def after(module: nn.Module, args: tuple, output: tuple) -> None:
        seen.append(output[0][0])

    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    with hooked({block: before for block in model.blocks}, {model.blocks[-1]: after}):
        model(ids, input_pos=positions, cache=cache, logits_at=torch.tensor([ids.shape[1] - 1], device=ids.device))
    return torch.stack(seen), cache


def patched(
    model: GPT,
    ids: torch.Tensor,
    layer: int,
    positions: list[int],
    clean_resid: torch.Tensor,
    corrupt: tuple[torch.Tensor, StaticKVCache],
) -> torch.Tensor:
    """The corrupt run `ids` (1, T) once per position, each with its position's residual stream before
    block `layer` replaced by the clean run's there (clean_resid (T, C)) -> (len(positions), V) logits at
    the last position.

    A run starts at block `layer` from the corrupt residual stream (corrupt_run), and at the first
    patched position: the positions before it, and every block before `layer`, compute what the corrupt
    run computed, whose keys and values the cache holds (causal masking only; else every position)."""
    resid, cache = corrupt
    R, T = len(positions), ids.shape[1]
    start = min(positions) if model.config.masking == "causal" else 0
    x = resid[layer, start:].expand(R, T - start, -1).clone()  # (R, T - start, C)
    at = torch.tensor(positions, device=ids.device)
    x[torch.arange(R, device=ids.device), at - start] = clean_resid[at].to(x.dtype)
    rows = StaticKVCache([[b.expand(R, *b.shape[1:]).clone() for b in layer_bufs] for layer_bufs in cache.buffers])
    out = model(
        ids[:, start:].expand(R, T - start),
        input_pos=torch.arange(start, T, device=ids.device).expand(R, T - start),
        cache=rows,
        logits_at=torch.full((R,), T - start - 1, device=ids.device),
        resid_pre=(layer, x),
    )
    return out.logits[:, 0].float()


def mlm_unembed(model: nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """A ModernBERT masked LM's residual streams (..., C) -> (..., V) logits: its final norm and MLM head."""
    return model.decoder(model.head(model.model.final_norm(resid)))


def mlm_residual_streams(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A ModernBERT masked LM (EsperBERTo): (1, T) -> (n_layer + 1, T, C), each layer's input and what
    its final norm reads."""
    encoder = model.model
    seen: list[torch.Tensor] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"])[0])

    handles = [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in encoder.layers]
    handles.append(encoder.final_norm.register_forward_pre_hook(before, with_kwargs=True))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(seen)  # (n_layer + 1, T, C)


def mlm_logit_lens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(1, T) -> (n_layer + 1, T, V) log-probabilities of a ModernBERT masked LM's logit lens."""
    streams = mlm_residual_streams(model, input_ids, attention_mask)
    return torch.log_softmax(mlm_unembed(model, streams).float(), dim=-1)


def top_predictions(unembedding, resid: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """(N, C) residual streams -> each one's k most likely tokens (probabilities, ids), through an
    unembedding (unembed or mlm_unembed): what a lens answers, without keeping an (N, V) table."""
    values, ids = torch.log_softmax(unembedding(resid).float(), dim=-1).topk(k, dim=-1)
    return values.exp().tolist(), ids.tolist()
