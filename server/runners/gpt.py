"""Our from-scratch GPT behind the runner seam: prefill through the growing KV cache, then each
sequence's keys and values copied into its slot of the decode step's static cache
(server/decode_step.py), where a step has fixed shapes and can be compiled."""

from __future__ import annotations

from collections.abc import Hashable

import torch
from tokenizers import Tokenizer

from models.gpt import GPT
from models.kv_cache import KVCache
from server.decode_step import DecodeStep
from server.runners.base import RunnerFacts


class TokenizersCodec:
    """A `tokenizers` tokenizer as the seam's codec."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class GPTRunner:
    def __init__(self, model: GPT, tokenizer: Tokenizer | None, max_rows: int = 32) -> None:
        c = model.config
        self.model = model.eval()
        self.tokenizer = TokenizersCodec(tokenizer) if tokenizer is not None else None
        self.facts = RunnerFacts(
            family="gpt",
            context_length=c.context_length,
            vocab_size=c.vocab_size,
            eos_id=c.eos_token_id,
            layers=c.n_layer,
            heads=c.n_attention_heads,
            normaliser=c.softmax,
            attention_settings=c.attention_settings(),
            config=c.to_dict(),
        )
        self.device = next(model.parameters()).device
        self.step = DecodeStep(model, max_rows)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """One forward pass over the left-padded prompts (B, T); each row's keys and values go to its slot."""
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), self.facts.eos_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), T), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, T - len(prompt) :] = torch.tensor(prompt)
            mask[i, T - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        padded = not bool(mask.all())
        cache = KVCache(self.facts.layers)
        logits = self.model(
            ids,
            attention_mask=mask if padded else None,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0) if padded else None,
            kv_cache=cache,
        ).logits[:, -1]
        for i, (slot, prompt) in enumerate(zip(slots, prompts, strict=True)):
            self.step.write(slot, cache, i, T - len(prompt))
        return logits.float().cpu()

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        return self.step(tokens, positions)

    def move(self, src: int, dst: int, length: int) -> None:
        self.step.move(src, dst, length)

    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device=self.device)).logits[0]

    def attention(self, ids: list[int]) -> list[torch.Tensor]:
        out = self.model(torch.tensor([ids], device=self.device), return_attention=True)
        return [a[0] for a in out.attentions]

    def compile_target(self, max_rows: int) -> tuple[DecodeStep, list[Hashable]]:
        return self.step, self.step.compile_order(max_rows)
