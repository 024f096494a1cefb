"""Our from-scratch GPT behind the runner seam. Its static KV cache holds the engine's slots: a
prefill writes the prompts straight into their slots, a decode step (server/execution/decoder/step.py, fixed
shapes, compiled) extends them; both are the model's one forward(idx, input_pos)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from tokenizers import Tokenizer

from models.gpt import GPT
from server.config import default
from server.execution.compiler import Pass
from server.execution.decoder.prepacked import adopt_prepacked
from server.execution.decoder.prompt_pass import PromptPass
from server.execution.decoder.step import CHECK_TEXT, DecodeStep
from server.execution.decoder.verify_pass import VERIFY_TOKENS, VerifyPass
from server.execution.runner import ModelFacts, StepOutput, TextCodec, context_within, right_padded


def fit_context(model: GPT, rows: int, budget_bytes: int | None) -> int:
    """The positions each of `rows` slots keeps within the KV budget (the decode step's cache has one spare
    column)."""
    p = next(model.parameters())
    per_position = sum(h * d for block in model.blocks for h, d in block.attn.cache_shapes()) * p.element_size()
    return context_within(per_position, rows, model.config.context_length, budget_bytes, spare=1)


class GPTRunner:
    def __init__(
        self, model: GPT, tokenizer: Tokenizer | None, max_rows: int = default("max_batch_size"), family: str = "gpt"
    ) -> None:
        c = model.config
        self.model = model.eval()
        self.tokenizer = TextCodec(tokenizer) if tokenizer is not None else None
        self.facts = ModelFacts(
            family=family,
            context_length=c.context_length,
            vocab_size=c.vocab_size,
            eos_id=c.eos_token_id,
            layers=c.n_layer,
            heads=c.n_attention_heads,
            normaliser=c.softmax,
            attention_settings=c.attention_settings(),
            config=c.to_dict(),
            parameters=sum(p.numel() for p in model.parameters()),
        )
        self.device = next(model.parameters()).device
        check_ids = self.tokenizer.encode(CHECK_TEXT) if self.tokenizer is not None else None
        self.step = DecodeStep(model, max_rows, check_ids)
        self.prompts = PromptPass(self.step)
        self.verifier = VerifyPass(self.step)
        self.facts = replace(
            self.facts,
            kv_cache_bytes=sum(t.nbytes for t in self.step.cache.tensors()),
            slots=max_rows,
            verify_tokens=VERIFY_TOKENS if self.verifier.buckets() else 0,
        )

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Right-padded prompts (B, T) in one pass, written straight into their (consecutive) slots.

        A row's padding lands in columns past its prompt, which its queries never see and its decode
        steps overwrite. The naive "zero_after" mask normalises over every key that exists, padding
        included, so its prompts go one per pass.
        """
        if self.model.config.masking != "causal" and len(prompts) > 1:
            return torch.cat([self.prefill([slot], [p]) for slot, p in zip(slots, prompts, strict=True)])
        ids, positions, last = right_padded(slots, prompts, self.facts.eos_id, self.device)
        cache = self.step.cache.view(len(prompts), self.step.context + 1, start=slots[0])
        return self.prompts(ids, positions, last, cache).float().cpu()  # (B, V)

    def decode(
        self, tokens: list[int], positions: list[int], eos_bias: list[float], allowed: list[np.ndarray | None]
    ) -> StepOutput:
        return self.step(tokens, positions, eos_bias, allowed)

    def verify(self, tokens: list[int], position: int, eos_bias: list[float]) -> tuple[list[int], list[float]] | None:
        return self.verifier(tokens, position, eos_bias)

    def move(self, src: int, dst: int, length: int) -> None:
        self.step.move(src, dst, length)

    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device=self.device)).logits[0]

    def attention(self, ids: list[int]) -> list[torch.Tensor]:
        out = self.model(torch.tensor([ids], device=self.device), return_attention=True)
        return [a[0] for a in out.attentions]

    def compiler_done(self) -> None:
        """The plain model's linear layers become the eager model's prepacked ones: only tracing, export and the check
        read the plain weights, a copy of them (docs/BENCHMARKS.md, "Memory")."""
        adopt_prepacked(self.model, self.step.eager_model)

    def compile_passes(self, max_rows: int) -> list[Pass]:
        """The decode step's regional graphs, quick to build, its smallest bucket first, then the prompts' pass
        (every request runs one), then the other buckets; then whole frozen graphs of the buckets where they are
        faster (the CPU's: server/execution/compiler.py), then the draft check (a lone request's speed-up, last)."""
        rows = self.step.compile_order(max_rows)
        regional = [Pass(self.step, r, regional=True) for r in rows]
        prompts = [Pass(self.prompts, bucket, regional=True) for bucket in self.prompts.buckets()]
        frozen = [Pass(self.step, r) for r in rows if self.step.freezes(r)]
        drafts = [Pass(self.verifier, b, regional=not self.verifier.freezes(b)) for b in self.verifier.buckets()]
        return regional[:1] + prompts + regional[1:] + frozen + drafts
