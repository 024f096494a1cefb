"""Looking inside the models: token scores, attention maps (JSON or PNG) and fill-mask.

Single forward passes, directly on the model (not through the generation engine); the routers run
them on the compute thread.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch

from server.errors import APIError
from server.execution.runner import token_logprobs
from server.serving.registry import ServedModel

MAX_MASKS = 20
MAX_PNG_PANELS = 96


def gpt_ids(m: ServedModel, text: str, field: str) -> list[int]:
    ids = m.runner.tokenizer.encode(text)
    limit = m.facts.context_length
    if not ids:
        raise APIError(422, f"{field}: text must not be empty", field)
    if len(ids) > limit:
        raise APIError(422, f"{field}: text is {len(ids)} tokens; model {m.id} takes at most {limit}", field)
    return ids


def mlm_encoding(m: ServedModel, text: str, field: str) -> dict[str, torch.Tensor]:
    enc = m.tokenizer(text, return_tensors="pt")
    limit = m.facts.context_length
    if enc["input_ids"].shape[1] > limit:
        raise APIError(
            422, f"{field}: text is {enc['input_ids'].shape[1]} tokens; model {m.id} takes at most {limit}", field
        )
    return enc


@torch.inference_mode()
def score(m: ServedModel, text: str, top_n: int) -> dict:
    """Log-probability of every token of the text read as a new document: after the checkpoint's
    start-of-sequence tokens where its tokenizer adds them (Llama's BOS), else after the end-of-text token."""
    ids = gpt_ids(m, text, "text")
    prefix = m.runner.tokenizer.prefix
    if prefix and ids[: len(prefix)] == prefix:
        start, ids = prefix, ids[len(prefix) :]
    else:
        start = [m.runner.facts.eos_id]
    ids = ids[: m.facts.context_length - len(start)]
    if not ids:
        raise APIError(422, "text: text must not be empty", "text")
    scored = token_logprobs(m.runner, [*start, *ids], top_n)
    skip = len(start) - 1  # the start's own tokens after its first are not the text's
    scored.logprobs, scored.top = scored.logprobs[skip:], scored.top[skip:]
    tokens = [
        {
            "id": tid,
            "text": m.tokenizer.decode([tid]),
            "logprob": lp,
            "top_tokens": [(m.tokenizer.decode([a]), v) for a, v in alts],
        }
        for tid, lp, alts in zip(ids, scored.logprobs, scored.top, strict=True)
    ]
    loss = -sum(scored.logprobs) / len(ids)
    return {"model": m.id, "tokens": tokens, "loss": loss, "perplexity": math.exp(loss), "scored_tokens": len(ids)}


@torch.inference_mode()
def attention(m: ServedModel, text: str, layers: list[int] | None, heads: list[int] | None) -> dict:
    """Attention weights of the selected layers and heads: (L, H, T, T) as nested lists, plus tokens."""
    if m.runner is not None:
        ids = gpt_ids(m, text, "text")
        weights, tokens = m.runner.attention(ids), [m.tokenizer.decode([i]) for i in ids]  # per layer (H, T, T)
    else:
        enc = mlm_encoding(m, text, "text").to(next(m.model.parameters()).device)
        weights = [a[0] for a in m.model(**enc, output_attentions=True).attentions]
        tokens = [m.tokenizer.decode([i]) for i in enc["input_ids"][0].tolist()]
    layers = list(range(m.facts.layers)) if layers is None else layers
    heads = list(range(m.facts.heads)) if heads is None else heads
    for name, sel, n in (("layers", layers, m.facts.layers), ("heads", heads, m.facts.heads)):
        if any(not 0 <= i < n for i in sel):
            raise APIError(422, f"{name}: indices must be in [0, {n}) for model {m.id}", name)
    w = torch.stack([weights[i][heads].float().cpu() for i in layers])  # (L, H, T, T)
    return {
        "model": m.id,
        "attention_variant": m.facts.normaliser,
        "tokens": tokens,
        "layers": layers,
        "heads": heads,
        "weights": w,
    }


def attention_png(result: dict) -> bytes:
    """The selected heads as one heatmap mosaic (rows: layers, columns: heads).

    One image on one Axes, not an Axes per head: a 6 x 8 grid of Axes with tick labels took seconds
    to lay out and draw (found by the API fuzz run). Tokens label the axes when one head is shown.
    Figures are built with the object API (no pyplot state), so concurrent requests are safe.
    """
    import matplotlib  # slow to import: at the first PNG, not at start-up (docs/BENCHMARKS.md, "Start-up")
    from matplotlib.figure import Figure

    w, tokens = result["weights"].float().numpy(), result["tokens"]  # (L, H, T, T)
    L, H, T = w.shape[0], w.shape[1], w.shape[-1]
    if L * H > MAX_PNG_PANELS:
        raise APIError(422, f"layers x heads = {L * H} panels; select at most {MAX_PNG_PANELS} for a PNG", "layers")
    gap = max(1, T // 8)
    step = T + gap
    mosaic = np.full((L * step, H * step), np.nan, dtype=np.float32)
    mosaic.reshape(L, step, H, step)[:, :T, :, :T] = w.transpose(0, 2, 1, 3)
    mosaic = mosaic[:-gap, :-gap]

    single = L * H == 1
    width = 1.6 + 0.12 * T if single else min(16.0, max(4.0, 0.06 * mosaic.shape[1]))
    height = width * mosaic.shape[0] / mosaic.shape[1]
    fig = Figure(figsize=(width + 1.2, height + 0.9), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(
        mosaic, cmap=matplotlib.colormaps["viridis"].with_extremes(bad="white"), vmin=0.0, vmax=1.0,
        interpolation="nearest",
    )  # fmt: skip
    if single:
        labels = [t.replace("$", r"\$") for t in tokens]  # no mathtext from client text
        ax.set_xticks(range(T), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(T), labels, fontsize=6)
        ax.set_xlabel(f"layer {result['layers'][0]} head {result['heads'][0]}: attended-to token")
    else:
        centres = np.arange(max(L, H)) * step + (T - 1) / 2
        ax.set_xticks(centres[:H], [f"head {h}" for h in result["heads"]], fontsize=7)
        ax.set_yticks(centres[:L], [f"layer {n}" for n in result["layers"]], fontsize=7)
        ax.set_xlabel(f"{T} tokens per panel; rows: query, columns: key")
    fig.colorbar(image, ax=ax, shrink=0.6)
    fig.suptitle(f"{result['model']} ({result['attention_variant']})", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def fill_mask(m: ServedModel, text: str, top_k: int, targets: list[str] | None) -> list:
    """Validate a fill-mask request, then fill it (training/esperberto/fill_mask.py); pipeline format."""
    from models.esperberto.fill_mask import fill_mask as esperberto_fill_mask  # imported with the first MLM
    from models.esperberto.fill_mask import target_ids

    tok = m.tokenizer
    ids = mlm_encoding(m, text, "inputs")["input_ids"][0]
    n_masks = int((ids == tok.mask_token_id).sum())
    if not n_masks:
        raise APIError(422, f"inputs: no {tok.mask_token} token in the text", "inputs")
    if n_masks > MAX_MASKS:
        raise APIError(422, f"inputs: {n_masks} {tok.mask_token} tokens; at most {MAX_MASKS}", "inputs")
    try:
        candidates = target_ids(tok, targets) if targets else None
    except ValueError as e:
        raise APIError(422, f"targets: {e}", "targets") from None
    results = esperberto_fill_mask(m.model, tok, ids, top_k, candidates, encode=m.encoder_step)
    return results[0] if len(results) == 1 else results
