"""Fill-mask on an EsperBERTo model: the encoder runs once, the LM head only at the mask positions.

Output is transformers' `pipeline("fill-mask")` format (a list of candidates per mask, each with
score, token, token_str and sequence), so clients written for the pipeline read it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.esperberto.model import MaskedLM, encoder, lm_logits


def target_ids(tokenizer, targets: list[str]) -> torch.Tensor:
    """Vocabulary ids of candidate words: a token itself, else the first token of the word."""
    ids = []
    for t in targets:
        if t in tokenizer.get_vocab():
            ids.append(tokenizer.convert_tokens_to_ids(t))
            continue
        pieces = tokenizer(t, add_special_tokens=False)["input_ids"]
        if not pieces:
            raise ValueError(f"{t!r} has no tokens")
        ids.append(pieces[0])
    return torch.tensor(sorted(set(ids)))


@torch.inference_mode()
def fill_mask(
    model: MaskedLM,
    tokenizer,
    input_ids: torch.Tensor,  # (T,) one encoded text with at least one mask token
    top_k: int,
    targets: torch.Tensor | None = None,  # (N,) restrict candidates to these ids
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None,  # (T,) ids -> (T, C); default: the encoder
) -> list[list[dict]]:
    """Candidates for each mask, in text order; each mask is filled on its own."""
    positions = (input_ids == tokenizer.mask_token_id).nonzero().flatten().tolist()
    if encode is None:
        device = next(model.parameters()).device
        encode = lambda ids: encoder(model)(input_ids=ids[None].to(device)).last_hidden_state[0]  # noqa: E731
    hidden = encode(input_ids)[positions]  # (M, C)
    probs = torch.softmax(lm_logits(model, hidden).float().cpu(), dim=-1)  # (M, V)
    results = []
    for i, pos in enumerate(positions):
        if targets is not None:
            cand_probs, order = probs[i, targets].topk(min(top_k, len(targets)))
            cand_ids = targets[order]
        else:
            cand_probs, cand_ids = probs[i].topk(top_k)
        row = []
        for p, cid in zip(cand_probs.tolist(), cand_ids.tolist(), strict=True):
            filled = input_ids.clone()
            filled[pos] = cid
            row.append(
                {
                    "score": p,
                    "token": cid,
                    "token_str": tokenizer.decode([cid]),
                    # as the pipeline: with several masks the others (and <s>, </s>) stay visible
                    "sequence": tokenizer.decode(filled, skip_special_tokens=len(positions) == 1),
                }
            )
        results.append(row)
    return results
