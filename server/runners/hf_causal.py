"""A transformers causal LM (GPT-2, GPT-NeoX, ...) behind the runner seam, for models trained with
transformers or exported by `tinyserve export`.

Each slot holds its own keys and values (per layer, (1, heads, length, head_dim)). A decode step
left-pads the running sequences' caches to the longest, masks the padding, gives every row its own
position id, runs the model once for the batch, and appends each row's new column to its slot: exact
continuous batching for any architecture transformers runs with a DynamicCache, at the cost of
copying the caches every step (fine for the small models this product serves; our GPT's static cache
avoids it).
"""

from __future__ import annotations

import torch

from models.sampling import greedy_choice
from server.runners.base import PROBE, RunnerFacts, StepOutput, start_tokens

Slot = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each (1, heads, length, head_dim)


class HFCodec:
    """A transformers tokenizer as the seam's codec: its start-of-sequence tokens before a text, no special
    token shown."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix = start_tokens(*(tokenizer(PROBE, add_special_tokens=b)["input_ids"] for b in (False, True)))

    def encode(self, text: str) -> list[int]:
        return self.prefix + self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def context_length_of(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"{type(config).__name__} names no context length")


class HFCausalLMRunner:
    def __init__(self, model, tokenizer, max_rows: int = 32) -> None:
        c = model.config
        eos = c.eos_token_id if c.eos_token_id is not None else tokenizer.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is None:
            raise ValueError("the model names no end-of-text token (config.eos_token_id or the tokenizer's)")
        self.model = model.eval()
        self.tokenizer = HFCodec(tokenizer)
        architecture = type(model).__name__
        self.facts = RunnerFacts(
            family=architecture,
            context_length=context_length_of(c),
            vocab_size=c.vocab_size,
            eos_id=int(eos),
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            normaliser="softmax0",
            attention_settings={"softmax": "softmax0", "n_head": c.num_attention_heads, "architecture": architecture},
            config=c.to_dict(),
        )
        self.device = next(model.parameters()).device
        self.slots: list[Slot | None] = [None] * max_rows

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Each prompt alone (no padding, so its cache is exactly its own)."""
        from transformers import DynamicCache

        rows = []
        for slot, prompt in zip(slots, prompts, strict=True):
            cache = DynamicCache(config=self.model.config)
            out = self.model(torch.tensor([prompt], device=self.device), past_key_values=cache, use_cache=True)
            self.slots[slot] = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            rows.append(out.logits[0, -1])
        return torch.stack(rows).float().cpu()

    def decode(self, tokens: list[int], positions: list[int], eos_bias: list[float]) -> StepOutput:
        from transformers import DynamicCache

        n, longest = len(tokens), max(positions)  # position i = tokens cached for row i
        layers = []
        for layer in range(len(self.slots[0])):
            keys, values = self.slots[0][layer]
            k = keys.new_zeros(n, keys.shape[1], longest, keys.shape[3])  # left-padded to the longest
            v = values.new_zeros(n, values.shape[1], longest, values.shape[3])
            for i in range(n):
                ki, vi = self.slots[i][layer]
                k[i, :, longest - positions[i] :] = ki[0]
                v[i, :, longest - positions[i] :] = vi[0]
            layers.append((k, v))
        mask = torch.zeros(n, longest + 1, dtype=torch.long, device=self.device)
        for i, p in enumerate(positions):
            mask[i, longest - p :] = 1
        out = self.model(
            input_ids=torch.tensor(tokens, device=self.device).view(n, 1),
            attention_mask=mask,
            position_ids=torch.tensor(positions, device=self.device).view(n, 1),
            past_key_values=DynamicCache(ddp_cache_data=layers, config=self.model.config),
            use_cache=True,
        )
        for layer, new in enumerate(out.past_key_values.layers):
            for i in range(n):
                keys, values = self.slots[i][layer]
                self.slots[i][layer] = (
                    torch.cat([keys, new.keys[i : i + 1, :, -1:]], dim=2),
                    torch.cat([values, new.values[i : i + 1, :, -1:]], dim=2),
                )
        logits = out.logits[:, -1]
        greedy, logprobs = greedy_choice(logits, torch.tensor(eos_bias, device=logits.device), self.facts.eos_id)
        return StepOutput(greedy.tolist(), logprobs.tolist(), logits)

    def move(self, src: int, dst: int, length: int) -> None:
        self.slots[dst], self.slots[src] = self.slots[src], None

    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device=self.device)).logits[0]

    def attention(self, ids: list[int]) -> list[torch.Tensor]:
        out = self.model(torch.tensor([ids], device=self.device), output_attentions=True)
        return [a[0] for a in out.attentions]

    def compile_target(self, max_rows: int) -> None:
        return None  # served eagerly
