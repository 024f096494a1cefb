"""Sampling continuations of one prompt with our decoder and the serving engine's sampler (models/sampling.py):
`GPT.generate` (one) and the EOS study (one per seed, as one batch)."""

from __future__ import annotations

import torch

from models.sampling import SamplingParams, SequenceState, sample


@torch.no_grad()
def continuations(model: torch.nn.Module, idx: torch.Tensor, params: list[SamplingParams]) -> list[list[int]]:
    """A continuation of one prompt, idx (1, T), by `model` (models/gpt.py's GPT) for each of `params` (e.g. seeds),
    decoded together as one batch: each row samples as `generate` would alone (its own generator), and runs until
    every row has ended."""
    idx = idx[:, -model.config.context_length :].to(model.ln_f.weight.device)  # a prompt from the CPU
    B, T = len(params), idx.shape[1]
    states = [
        SequenceState(p, idx[0].tolist(), 0, torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
        for p in params
    ]
    cache = model.new_cache(B)
    prompt = idx.expand(B, T)
    logits = model(prompt, input_pos=torch.arange(T, device=idx.device).expand(B, T), cache=cache).logits[:, -1]
    outs: list[list[int]] = [[] for _ in params]
    limits = [min(p.max_new_tokens, model.config.context_length - T) for p in params]
    running = [limit > 0 for limit in limits]
    for pos in range(T, T + max(limits, default=0)):
        # on the CPU, as the server samples, with the CPU generator: the same tokens on every device
        live = [i for i in range(B) if running[i]]
        if not live:
            break
        draws = sample(logits[live].cpu(), [states[i] for i in live], model.config.eos_token_id)
        tokens = [0] * B  # an ended row's input: computed, never read
        for i, draw in zip(live, draws, strict=True):
            if draw.token == model.config.eos_token_id:
                running[i] = False
                continue
            outs[i].append(draw.token)
            states[i].advance(draw.token)
            tokens[i] = draw.token
            running[i] = len(outs[i]) < limits[i]
        step = idx.new_tensor(tokens).view(B, 1)
        logits = model(step, input_pos=idx.new_full((B, 1), pos), cache=cache).logits[:, -1]
    return outs
