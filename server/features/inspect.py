"""Looking inside a served model: the logit lens, head ablation and activation patching.

Declarative requests (never code) over the decoder's named points (models/inspect_hooks.py), so every family
on the project's decoder has them; masked LMs get the logit lens. Each runs in float32 from the
checkpoint's weights, on the compute thread, in slices of at most SLICE_TOKENS tokens queued one by one
from the caller's thread (a worker thread for the routes): decode steps run between two slices, so
completions keep streaming meanwhile. A request's cost is its forward passes (an unembedding of every
position counts as one) times its tokens, capped by `max_inspect_tokens`, and is checked before anything
is computed or loaded.

Hooks go on a private copy of the model that shares its weights, never on the served module: the
background compiler traces and runs that one on its own thread.
"""

from __future__ import annotations

import copy
import functools
import itertools
from pathlib import Path

import torch

from model_store import GPT, load_gpt
from models import inspect_hooks
from server.config import Settings
from server.errors import APIError
from server.execution.compute_thread import ComputeThread
from server.features.readouts import gpt_ids, mlm_encoding
from server.serving.registry import ServedModel

SLICE_TOKENS = 512  # tokens per forward pass between two decode steps: short enough that streams keep going
MAX_HEADS = 256  # [layer, head] pairs ablated together


LENS_ELEMENTS = 2**22  # logits unembedded per slice (rows x vocabulary): 16 MB of float32


@functools.lru_cache(maxsize=2)
def float32_decoder(folder: Path, context_length: int) -> GPT:
    """The checkpoint's weights in float32 on the CPU (the served copy may be bf16, int8 or on a GPU)."""
    return load_gpt(folder, "cpu", torch.float32, context_length)[0]


@functools.lru_cache(maxsize=8)
def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The module again, its parameters and buffers shared (no tensor copied): hooks go on this one."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, shared)


def check_decoder(m: ServedModel) -> None:
    if not isinstance(m.model, GPT):
        rule = f"{m.id} is served by transformers' own code; looking inside needs a model on the project's decoder"
        raise APIError(422, f"model: {rule}", "model")


def decoder_of(m: ServedModel) -> GPT:
    """What these passes read (on the compute thread): the served weights where they are float32 on the
    CPU, else a float32 copy of the checkpoint; never the served module itself."""
    check_decoder(m)
    plain = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.model.parameters())
    plain = plain and all(type(b.attn.proj) is torch.nn.Linear for b in m.model.blocks)
    return sharing_copy(m.model) if plain else float32_decoder(m.folder, m.facts.context_length)


def check_cost(passes: int, tokens: int, settings: Settings, field: str) -> None:
    cost = passes * tokens
    if cost > settings.max_inspect_tokens:
        raise APIError(
            422,
            f"{field}: {passes} forward passes x {tokens} tokens = {cost:,} tokens; the limit is "
            f"{settings.max_inspect_tokens:,} (TINYSERVE_MAX_INSPECT_TOKENS): a shorter text or fewer passes",
            field,
        )


def top_tokens(m: ServedModel, logprobs: torch.Tensor, k: int) -> list[dict]:
    """(V,) log-probabilities -> the k most likely tokens with their probabilities."""
    values, ids = logprobs.topk(k)
    return [
        {"id": i, "token": m.tokenizer.decode([i]), "prob": p}
        for i, p in zip(ids.tolist(), values.exp().tolist(), strict=True)
    ]


def single_token(m: ServedModel, text: str, field: str) -> int:
    """A word that must be one token of the model's vocabulary (its start-of-sequence tokens not counted)."""
    ids = m.tokenizer.encode(text)[len(m.tokenizer.prefix) :]
    if len(ids) != 1:
        raise APIError(422, f"{field}: {text!r} is {len(ids)} tokens {ids}; it must be exactly one", field)
    return ids[0]


def logit_lens(compute: ComputeThread, m: ServedModel, text: str, top_k: int, settings: Settings) -> dict:
    """Each layer's residual stream read by the model's own final norm and unembedding, in slices."""
    run = slices(compute)
    if m.kind == "mlm":
        enc = mlm_encoding(m, text, "text")
        ids = enc["input_ids"][0].tolist()
        check_cost(m.facts.layers + 1, len(ids), settings, "text")
        model = run(lambda: float32_mlm(m))
        streams = run(lambda: inspect_hooks.mlm_residual_streams(model, enc["input_ids"], enc["attention_mask"]))
        unembedding = functools.partial(inspect_hooks.mlm_unembed, model)
    else:
        check_decoder(m)
        ids = gpt_ids(m, text, "text")
        check_cost(m.facts.layers + 1, len(ids), settings, "text")
        model = run(lambda: decoder_of(m))
        streams = run(lambda: inspect_hooks.residual_streams(model, torch.tensor([ids])))
        unembedding = functools.partial(inspect_hooks.unembed, model)
    rows = streams.flatten(0, 1)  # (layers x positions, C)
    n = max(1, LENS_ELEMENTS // model_vocab(m))
    probs, top = [], []
    for start in range(0, len(rows), n):
        p, t = run(lambda s=start: inspect_hooks.top_predictions(unembedding, rows[s : s + n], top_k))
        probs += p
        top += t
    T = len(ids)
    predictions = [
        [{"id": i, "token": m.tokenizer.decode([i]), "prob": q} for i, q in zip(t, p, strict=True)]
        for t, p in zip(top, probs, strict=True)
    ]
    layers = [predictions[layer * T : (layer + 1) * T] for layer in range(len(rows) // T)]
    return {"model": m.id, "tokens": [m.tokenizer.decode([i]) for i in ids], "layers": layers}


def model_vocab(m: ServedModel) -> int:
    return m.runner.facts.vocab_size if m.runner is not None else m.model.config.vocab_size


def ablate(
    compute: ComputeThread, m: ServedModel, text: str, heads: list[list[int]] | str, top_k: int, settings: Settings
) -> dict:
    """The next-token distribution at the last position with heads zeroed before the output projection."""
    run = slices(compute)
    check_decoder(m)
    ids = gpt_ids(m, text, "text")
    L, H = m.facts.layers, m.facts.heads
    if heads == "each":
        ablated = [[(layer, head)] for layer in range(L) for head in range(H)]
    else:
        if not 1 <= len(heads) <= MAX_HEADS:
            raise APIError(422, f'heads: give 1 to {MAX_HEADS} [layer, head] pairs, or "each"', "heads")
        for i, pair in enumerate(heads):
            if len(pair) != 2 or not (0 <= pair[0] < L and 0 <= pair[1] < H):
                rule = f"{pair} is not a [layer, head] of model {m.id} (layers 0-{L - 1}, heads 0-{H - 1})"
                raise APIError(422, f"heads[{i}]: {rule}", f"heads[{i}]")
        ablated = [[tuple(pair) for pair in heads]]
    rows = [[], *ablated]  # row 0: nothing ablated
    check_cost(len(rows), len(ids), settings, "heads")
    model = run(lambda: decoder_of(m))  # after every check: a refused request loads nothing

    def batch(part: list[list[tuple[int, int]]]) -> torch.Tensor:
        keep = torch.ones(len(part), L, H)
        for r, pairs in enumerate(part):
            for layer, head in pairs:
                keep[r, layer, head] = 0
        return inspect_hooks.ablated(model, torch.tensor([ids]), keep)

    n = max(1, SLICE_TOKENS // len(ids))
    logp = [run(lambda p=rows[i : i + n]: batch(p)) for i in range(0, len(rows), n)]

    def summary() -> tuple[list[dict], list[float], list[dict] | None]:
        every = torch.cat(logp)  # (R, V)
        kl = (every[0].exp() * (every[0] - every[1:])).sum(-1).clamp(min=0)  # KL(base || each ablated row)
        first = top_tokens(m, every[1], top_k) if heads != "each" else None
        return top_tokens(m, every[0], top_k), kl.tolist(), first

    base, kl, first = run(summary)
    out = {"model": m.id, "tokens": [m.tokenizer.decode([i]) for i in ids], "base": base}
    if heads == "each":
        return {**out, "each": [kl[layer * H : (layer + 1) * H] for layer in range(L)]}
    return {**out, "ablated": first, "kl": kl[0]}


def patch(
    compute: ComputeThread, m: ServedModel, clean: str, corrupt: str, answer: str, foil: str, settings: Settings
) -> dict:
    """logit(answer) - logit(foil) at the last position of the corrupt run, with the residual stream
    before each block at each position replaced by the clean run's there."""
    run = slices(compute)
    check_decoder(m)
    clean_ids, corrupt_ids = gpt_ids(m, clean, "clean"), gpt_ids(m, corrupt, "corrupt")
    if len(clean_ids) != len(corrupt_ids):
        rule = f"{len(corrupt_ids)} tokens, clean {len(clean_ids)}; they must be the same number of tokens"
        raise APIError(422, f"corrupt: {rule}", "corrupt")
    a, f = single_token(m, answer, "answer"), single_token(m, foil, "foil")
    L, T = m.facts.layers, len(clean_ids)
    check_cost(2 + L * T, T, settings, "clean")
    model = run(lambda: decoder_of(m))  # after every check: a refused request loads nothing
    x = torch.tensor([corrupt_ids])

    def metric(logits: torch.Tensor) -> list[float]:
        return (logits[..., a] - logits[..., f]).tolist()

    def ends() -> tuple[list[float], torch.Tensor, tuple]:
        clean_resid = inspect_hooks.residual_streams(model, torch.tensor([clean_ids]))
        corrupt = inspect_hooks.corrupt_run(model, x)
        both = inspect_hooks.unembed(model, torch.stack([clean_resid[-1, -1], corrupt[0][-1, -1]]))
        return metric(both.float()), clean_resid, corrupt

    (clean_m, corrupt_m), clean_resid, corrupt = run(ends)
    n = max(1, SLICE_TOKENS // T)
    grid = []
    for layer in range(L):
        row: list[float] = []
        for start in range(0, T, n):
            p = list(range(start, min(T, start + n)))
            row += run(lambda p=p, li=layer: metric(inspect_hooks.patched(model, x, li, p, clean_resid[li], corrupt)))
        grid.append(row)
    tokens = [m.tokenizer.decode([i]) for i in corrupt_ids]
    return {"model": m.id, "tokens": tokens, "clean": clean_m, "corrupt": corrupt_m, "grid": grid}


def float32_mlm(m: ServedModel) -> torch.nn.Module:
    """The served masked LM's weights where they are float32 on the CPU (shared, on a copy of the module),
    else a float32 copy of its checkpoint. The lens reads ModernBERT's layers (EsperBERTo)."""
    if type(m.model).__name__ != "ModernBertForMaskedLM":
        rule = f"the logit lens of a masked LM reads ModernBERT's layers; {m.id} is {type(m.model).__name__}"
        raise APIError(422, f"model: {rule}", "model")
    if all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.model.parameters()):
        return sharing_copy(m.model)
    return mlm_copy(m.folder)


@functools.lru_cache(maxsize=2)
def mlm_copy(folder: Path) -> torch.nn.Module:
    from model_store import load_mlm

    return load_mlm(folder, "cpu", torch.float32)[0].eval()


def slices(compute: ComputeThread):
    """Run one slice on the compute thread, under inference mode, and wait for it (from a worker thread:
    decode steps run between two slices)."""

    def run(fn):
        def inside():
            with torch.inference_mode():
                return fn()

        return compute.call(inside)

    return run


def steering_vector(
    compute: ComputeThread,
    m: ServedModel,
    pairs: list[tuple[str, str]],
    blocks: tuple[int, int] | None,
    method: str,
    settings: Settings,
) -> dict[int, torch.Tensor]:
    """Contrastive activation addition: per block (llama.cpp's N, after 0-based block N), the residual stream at each
    positive prompt's last token less its negative's, averaged over the pairs ("mean"); or ("pca", repeng's
    pca_diff) the differences' first principal component, signed and scaled by the mean difference along it."""
    check_decoder(m)
    first, last = blocks or (1, m.facts.layers - 1)
    if not 1 <= first <= last < m.facts.layers:
        rule = f"from 1 to {m.facts.layers - 1} (llama.cpp's direction.N), first <= last"
        raise APIError(422, f"layers: [{first}, {last}] is out of range; model {m.id}'s blocks run {rule}", "layers")
    ids = [
        (gpt_ids(m, pos, f"pairs[{i}].positive"), gpt_ids(m, neg, f"pairs[{i}].negative"))
        for i, (pos, neg) in enumerate(pairs)
    ]
    check_cost(1, sum(len(p) + len(n) for p, n in ids), settings, "pairs")
    run = slices(compute)
    model = run(lambda: decoder_of(m))

    def last_token(tokens: list[int]) -> torch.Tensor:  # (n_layer + 1, C): entry l + 1 is after block l
        return run(lambda: inspect_hooks.residual_streams(model, torch.tensor([tokens]))[:, -1])

    differences = torch.stack([last_token(p) - last_token(n) for p, n in ids])  # (pairs, n_layer + 1, C)
    directions = {}
    for block in range(first, last + 1):
        d = differences[:, block + 1].double()  # (pairs, C)
        mean = d.mean(0)
        if method == "pca" and len(d) > 1:
            component = torch.linalg.svd(d - mean, full_matrices=False).Vh[0]  # unit, its sign arbitrary
            mean = component * (mean @ component)  # towards the positives, as long as the mean along it
        directions[block] = mean.float()
    return directions
