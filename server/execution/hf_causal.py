"""A transformers causal LM (any architecture our decoder does not compute) behind the runner seam.

Every slot keeps its keys and values in one preallocated buffer per layer, (slots, heads, context,
head_dim), as our decoder's static cache does (`SlotCache`, a transformers `Cache`): a row's tokens sit
at their own positions, a prefill writes a group of right-padded prompts in one pass, and a decode step
writes each row's new column where it belongs and attends over the first `columns` (the longest row's),
the shorter rows' later columns masked. Nothing is copied between steps.

Not the paged pool our decoder serves from (server/engine/kv_blocks.py): transformers' attention reads one
contiguous cache per layer, and its paged kernels are CUDA's; so this runner keeps a static slot a sequence (its
`facts.kv_blocks` is 0), which the engine admits by slots and prefills whole, without prefix caching.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from models.sampling import greedy_choice
from server.config import default
from server.execution.runner import DecodeRows, ModelFacts, StepOutput, TextCodec, context_within, right_padded

ATTENTION_LAYERS = ("full_attention", "sliding_attention")


class SlotLayer(DynamicLayer):
    """One layer's slots: writes at each row's positions, returns the step's rows and columns as views."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, context = self.cache.slots, self.cache.context
        self.key_buffer = key_states.new_zeros(rows, key_states.shape[1], context, key_states.shape[3])
        self.value_buffer = value_states.new_zeros(rows, value_states.shape[1], context, value_states.shape[3])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        rows = torch.arange(c.first, c.first + key_states.shape[0], device=self.device).unsqueeze(1)  # (B, 1)
        self.key_buffer[rows, :, c.positions] = key_states.transpose(1, 2)  # indexed as (B, T, heads, D)
        self.value_buffer[rows, :, c.positions] = value_states.transpose(1, 2)
        window = slice(c.first, c.first + key_states.shape[0])
        return self.key_buffer[window, :, : c.columns], self.value_buffer[window, :, : c.columns]

    def get_seq_length(self) -> int:
        return self.cache.columns - self.cache.positions.shape[1]  # the columns before this step's queries

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.columns, 0

    def get_max_length(self) -> int:
        return self.cache.context

    def move(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized:
            self.key_buffer[dst, :, :length] = self.key_buffer[src, :, :length]
            self.value_buffer[dst, :, :length] = self.value_buffer[src, :, :length]


class SlotCache(Cache):
    """Per-slot static keys and values for every layer; `at` sets where the next forward writes and reads."""

    def __init__(self, layers: int, slots: int, context: int) -> None:
        self.slots, self.context = slots, context
        self.first, self.positions, self.columns = 0, torch.zeros(1, 1, dtype=torch.long), 1
        super().__init__(layers=[SlotLayer(self) for _ in range(layers)])

    def at(self, first: int, positions: torch.Tensor, columns: int) -> SlotCache:
        """Rows first.. (one per input row) write positions (B, T) and attend over their first `columns`."""
        self.first, self.positions, self.columns = first, positions, columns
        return self

    def move(self, src: int, dst: int, length: int) -> None:
        for layer in self.layers:
            layer.move(src, dst, length)


def context_length_of(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"{type(config).__name__} names no context length")


def served_context(config, max_context: int | None) -> int:
    """The checkpoint's context, capped at max_context and at its sliding window (within the window,
    sliding attention is full attention: the slot cache needs no window of its own)."""
    context = context_length_of(config)
    if max_context:
        context = min(context, max_context)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= set(ATTENTION_LAYERS):
        raise ValueError(f"layer types {sorted(kinds - set(ATTENTION_LAYERS))} have no key/value slots to serve")
    window = getattr(config, "sliding_window", None)
    if window and ("sliding_attention" in kinds or getattr(config, "use_sliding_window", True)):
        context = min(context, int(window))
    return context


def bytes_per_position(config, dtype: torch.dtype) -> int:
    """Keys and values of one position in every layer (from the config: the buffers are shaped at first use)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class HFCausalLMRunner:
    def __init__(
        self,
        model,
        tokenizer,
        max_rows: int = default("max_batch_size"),
        max_context: int | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        c = model.config
        eos = c.eos_token_id if c.eos_token_id is not None else tokenizer.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is None:
            raise ValueError("the model names no end-of-text token (config.eos_token_id or the tokenizer's)")
        self.model = model.eval()
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            raise ValueError("the tokenizer is not a fast one (tokenizer.json): it cannot be served")
        self.tokenizer = TextCodec(tokenizer.backend_tokenizer)
        self.device = next(model.parameters()).device
        context = served_context(c, max_context)
        per_position = bytes_per_position(c, next(model.parameters()).dtype)
        context = context_within(per_position, max_rows, context, kv_cache_bytes)
        architecture = type(model).__name__
        self.facts = ModelFacts(
            family=architecture,
            context_length=context,
            vocab_size=c.vocab_size,
            eos_id=int(eos),
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            normaliser="softmax0",
            attention_settings={"softmax": "softmax0", "n_head": c.num_attention_heads, "architecture": architecture},
            config=c.to_dict(),
            parameters=sum(p.numel() for p in model.parameters()),
            kv_cache_bytes=max_rows * context * per_position,
            slots=max_rows,
        )
        self.cache = SlotCache(c.num_hidden_layers, max_rows, context)

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        tables: object = None,
        starts: object = None,
        steer_rows: object = None,
    ) -> torch.Tensor:
        """Right-padded prompts (B, T) in one pass into their consecutive slots; a row's padding lands past
        its prompt, where its decode steps write (causal attention alone: a padding mask would leave the
        padded queries with no key, and NaN in the columns they write). No block tables (facts.kv_blocks is 0:
        every prompt is prefilled whole) and no steering (facts.steer_width is 0)."""
        ids, positions, last = right_padded(slots, prompts, self.facts.eos_id, self.device)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=self.cache.at(slots[0], positions, ids.shape[1]),
            use_cache=True,
        )
        return out.logits[torch.arange(len(prompts), device=self.device), last].float().cpu()

    def decode(self, rows: DecodeRows) -> StepOutput:
        """The rows' tables are not read: each row has its slot."""
        n, columns = len(rows.tokens), max(rows.positions) + 1  # position i: where row i's token goes
        at = torch.tensor(rows.positions, device=self.device).view(n, 1)
        visible = torch.arange(columns, device=self.device) <= at  # (n, columns): a row's own columns
        out = self.model(
            input_ids=torch.tensor(rows.tokens, device=self.device).view(n, 1),
            attention_mask=visible.long(),
            position_ids=at,
            past_key_values=self.cache.at(0, at, columns),
            use_cache=True,
        )
        logits = out.logits[:, -1]
        mask = None
        if any(m is not None for m in rows.allowed):
            V = logits.shape[-1]
            allowed = [np.ones(V, bool) if m is None else m for m in rows.allowed]
            mask = torch.from_numpy(np.stack(allowed)).to(self.device)
        bias = torch.tensor(rows.eos_bias, device=logits.device)
        greedy, logprobs = greedy_choice(logits, bias, self.facts.eos_id, mask)
        return StepOutput(greedy.tolist(), logprobs.tolist(), logits)

    def verify(self, tokens: list[int], position: int, eos_bias: list[float], table: object = None) -> None:
        return None  # no draft check (facts.verify_tokens is 0): transformers' eager forward gains nothing from one

    def steer(self, vectors: torch.Tensor) -> int:
        raise ValueError("this model cannot be steered (facts.steer_width is 0)")

    def unsteer(self, row: int) -> None:
        pass  # nothing was steered

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def logits(self, ids: list[int], steer: object = None) -> torch.Tensor:  # never steered (steer_width 0)
        return self.model(torch.tensor([ids], device=self.device)).logits[0]

    def attention(self, ids: list[int]) -> list[torch.Tensor]:
        out = self.model(torch.tensor([ids], device=self.device), output_attentions=True)
        return [a[0] for a in out.attentions]

    def compile_passes(self, max_rows: int) -> list:
        return []  # served eagerly

    def compiler_done(self) -> None:
        pass  # nothing kept for a compiler
