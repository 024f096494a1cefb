"""The EsperBERTo encoder for fill-mask: eager, or compiled per padded length bucket.

A fill-mask request is one short encoder pass, so its cost is the encoder's ~100 small ops and its
weight reads, as in a decode step. Texts are padded (attention mask 0) to a length bucket (16, 32,
... max tokens) so that a compiled encoder (server/execution/compiler.py) has fixed shapes; a text whose
bucket is not compiled yet runs eagerly, unpadded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from server.execution.passes import buckets

if TYPE_CHECKING:  # transformers is slow to import: loaded with the first fill-mask model
    from models.esperberto.model import MaskedLM

# (input_ids (1, T), attention_mask (1, T) or None for no padding) -> final hidden states (1, T, C)
EncodeFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def eager_encoder(model: MaskedLM) -> EncodeFn:
    from models.esperberto.model import encoder

    body = encoder(model)  # the encoder's own forward: the compute thread's guard hook sits on the whole model

    def encode(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return encode


class EncoderStep:
    def __init__(self, model: MaskedLM, max_tokens: int) -> None:
        self.device = next(model.parameters()).device
        self.dtype = self.check_rounding = next(model.parameters()).dtype
        self.weights_bytes = None  # its kernels by dtype and rows alone
        self.pad_id = model.config.pad_token_id
        self.vocab_size = model.config.vocab_size
        self.buckets = buckets(max_tokens, smallest=16)
        self.traced = eager_encoder(model)  # also what runs until a bucket is compiled
        self.model = model
        # length bucket -> compiled encoder: written by the background compiler (server/execution/compiler.py,
        # BackgroundCompiler.run) when a bucket's graph is built and checked; read by __call__ on the compute
        # thread (fill-mask, server/features/readouts.py), which runs a text eagerly, unpadded, until then
        self.compiled: dict[int, EncodeFn] = {}

    def compile_passes(self, max_tokens: int = 128) -> list[tuple[EncoderStep, int]]:
        """What server/execution/compiler.py builds, short texts first: a fill-mask sentence is rarely longer than a few
        dozen tokens."""
        return [(self, b) for b in self.buckets if b <= max_tokens]

    def matmul_rows(self, length: int) -> int:
        return length  # one text of `length` tokens

    def example(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = (torch.arange(length, device=self.device) * 31 % self.vocab_size).view(1, length)
        mask = torch.ones((1, length), dtype=torch.long, device=self.device)
        mask[:, length - length // 4 :] = 0  # some padding, as requests have
        return ids, mask

    def real_inputs(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.example(length)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over the final hidden states: what fill-mask ranks."""
        from models.esperberto.model import lm_logits

        return lm_logits(self.model, hidden)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, C) final hidden states."""
        T = input_ids.shape[0]
        bucket = next((b for b in self.buckets if b >= T), None)
        compiled = self.compiled.get(bucket)
        ids = input_ids.to(self.device).view(1, T)
        if compiled is None:
            return self.traced(ids, None)[0]
        padded = torch.full((1, bucket), self.pad_id, dtype=ids.dtype, device=self.device)
        padded[:, :T] = ids
        mask = torch.zeros((1, bucket), dtype=torch.long, device=self.device)
        mask[:, :T] = 1
        return compiled(padded, mask)[0, :T]
