"""Our from-scratch GPT behind the runner seam. Its paged KV cache is one pool of blocks that the engine hands out
(server/engine/kv_blocks.py): a prefill writes the prompts' uncached tails through their block tables, a decode
step (server/execution/decoder/step.py, fixed shapes, compiled) extends them; both are the model's one
forward(idx, input_pos)."""

from __future__ import annotations

from dataclasses import replace

import torch
from tokenizers import Tokenizer

from models.gpt import GPT
from models.kv_cache import BLOCK_TOKENS
from server.config import default
from server.execution.decoder.prepacked import adopt_prepacked
from server.execution.decoder.prompt_pass import PromptPass
from server.execution.decoder.step import CHECK_TEXT, DecodeStep
from server.execution.decoder.verify_pass import VERIFY_TOKENS, VerifyPass
from server.execution.passes import Pass
from server.execution.runner import DecodeRows, ModelFacts, StepOutput, TextCodec


def pool_blocks(model: GPT, rows: int, budget_bytes: int | None) -> int:
    """The blocks of the KV pool (the null block included): as many as the KV budget (kv_cache_mb) holds, or
    without one, every row's whole context; ValueError below two blocks (the null one and one)."""
    p = next(model.parameters())
    per_position = sum(h * d for block in model.blocks for h, d in block.attn.cache_shapes()) * p.element_size()
    if budget_bytes is None:
        return rows * -(-model.config.context_length // BLOCK_TOKENS) + 1
    blocks = budget_bytes // (BLOCK_TOKENS * per_position)
    if blocks < 2:
        need = -(-2 * BLOCK_TOKENS * per_position // 2**20)
        raise ValueError(f"kv_cache_mb: a pool of 2 blocks of {BLOCK_TOKENS} positions needs {need} MB")
    return blocks


def prompt_group(
    prompts: list[list[int]], starts: list[int], tables: list[list[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A prefill group as one batch: ids (B, T) right-padded with `pad` (each prompt from its `start` on: the tokens
    before it are cached), positions (B, T) from each start, each row's last index (B,) and the tables (B, N >= 2),
    0 (the null block) past a row's blocks: padding positions past them write there."""
    tails = [p[s:] for p, s in zip(prompts, starts, strict=True)]
    T = max(len(t) for t in tails)
    ids = torch.full((len(tails), T), pad, dtype=torch.long)
    for i, tail in enumerate(tails):
        ids[i, : len(tail)] = torch.tensor(tail)
    positions = torch.arange(T).expand(len(tails), T) + torch.tensor(starts).unsqueeze(1)
    last = torch.tensor([len(t) - 1 for t in tails])
    width = max(2, -(-(max(starts) + T) // BLOCK_TOKENS))
    table = torch.zeros((len(tails), width), dtype=torch.long)
    for i, blocks in enumerate(tables):
        table[i, : len(blocks)] = torch.tensor(blocks)
    return ids.to(device), positions.to(device), last.to(device), table.to(device)


class GPTRunner:
    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer | None,
        max_rows: int = default("max_batch_size"),
        family: str = "gpt",
        blocks: int | None = None,
    ) -> None:
        """blocks: the KV pool's (pool_blocks); default: every row's whole context."""
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
        self.step = DecodeStep(model, max_rows, check_ids, blocks)
        self.prompts = PromptPass(self.step)
        self.verifier = VerifyPass(self.step)
        pool = self.step.cache.blocks
        self.facts = replace(
            self.facts,
            # a sequence may hold every block but the null one
            context_length=min(c.context_length, (pool - 1) * BLOCK_TOKENS),
            kv_cache_bytes=sum(t.nbytes for t in self.step.cache.tensors()),
            slots=max_rows,
            kv_blocks=pool,
            verify_tokens=VERIFY_TOKENS if self.verifier.buckets() else 0,
            steer_width=c.d_model,
        )

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        tables: list[list[int]],
        starts: list[int],
        steer_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Right-padded prompt tails (B, T) in one pass, each from its start (the positions before it are its cached
        blocks), written through its block table (slots: unused, the tables say where).

        A row's padding lands in positions past its prompt, which its queries never see and its decode
        steps overwrite (or in the null block). The naive "zero_after" mask normalises over every key that exists,
        padding included, so its prompts go one per pass.
        """
        steer_rows = steer_rows or [0] * len(prompts)
        if self.model.config.masking != "causal" and len(prompts) > 1:
            rows = zip(slots, prompts, tables, starts, steer_rows, strict=True)
            return torch.cat([self.prefill([slot], [p], [t], [s], [v]) for slot, p, t, s, v in rows])
        ids, positions, last, table = prompt_group(prompts, starts, tables, self.facts.eos_id, self.device)
        steered = torch.tensor(steer_rows, device=self.device)
        return self.prompts(ids, positions, last, self.step.cache.rows(table), steered).float().cpu()  # (B, V)

    def decode(self, rows: DecodeRows) -> StepOutput:
        return self.step(rows)

    def steer(self, vectors: torch.Tensor) -> int:
        return self.step.steering.take(vectors)

    def unsteer(self, row: int) -> None:
        self.step.steering.drop(row)

    def verify(
        self, tokens: list[int], position: int, eos_bias: list[float], table: list[int]
    ) -> tuple[list[int], list[float]] | None:
        return self.verifier(tokens, position, eos_bias, table)

    def move(self, src: int, dst: int, length: int) -> None:
        """Nothing to move: a sequence's keys and values stay in its blocks, its table travels with its row."""

    def logits(self, ids: list[int], steer: torch.Tensor | None = None) -> torch.Tensor:
        steer = steer.to(self.device)[None] if steer is not None else None
        return self.model(torch.tensor([ids], device=self.device), steer=steer).logits[0]

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
