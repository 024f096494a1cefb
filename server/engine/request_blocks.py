"""What each request holds while it runs: its KV blocks, the engine's side of a paged pool (server/engine/kv_blocks.py),
and, steered, its row of the runner's steering table (server/execution/steering.py).

A request takes its blocks when it is admitted (those of its prompt's prefix found cached, new ones for the rest of
its prompt, and a reservation for every position it may write later: its most new tokens and a draft check past
them), grows into its reservation step by step, keys the full blocks its written tokens fill, and lets them all go
when it ends. Where the runner keeps a static slot a row (`facts.kv_blocks` 0) there is no pool: every request is
admitted by rows alone and prefilled whole. A steered request's blocks are keyed with its vectors' digest (its
keys and values are its own) and it takes its steering row when it is admitted, for as long as its blocks.
"""

from __future__ import annotations

from models.kv_cache import BLOCK_TOKENS
from server.engine.kv_blocks import KVBlocks
from server.engine.rows import GenerationRequest, RunningRow
from server.execution.runner import CausalLMRunner


class RequestBlocks:
    def __init__(self, runner: CausalLMRunner, prefix_caching: bool) -> None:
        facts = runner.facts
        self.pool = KVBlocks(facts.kv_blocks, prefix_caching) if facts.kv_blocks else None  # None: static slots
        self.context_length = facts.context_length
        self.verify_tokens = facts.verify_tokens  # positions a draft check writes past a row's last token
        self.runner = runner  # whose steering table it takes rows of

    def most_positions(self, req: GenerationRequest) -> int:
        """The positions a request may write: its prompt, its most new tokens and a draft check's past them."""
        return min(len(req.prompt_ids) + req.params.max_new_tokens + self.verify_tokens, self.context_length)

    def take(self, req: GenerationRequest) -> bool:
        """Whether the request has its blocks now (taken here if they are free; always without a pool), and then its
        steering row."""
        steer = req.params.steer
        if self.pool is not None and req.blocks is None:
            salt = steer.key if steer is not None else None  # steered keys and values differ
            cached = self.pool.cached(req.prompt_ids, salt)
            if not self.pool.fits(self.most_positions(req), cached):
                return False
            req.blocks = self.pool.admit(req.prompt_ids, self.most_positions(req), cached, salt)
        if steer is not None and not req.steer_row:  # the table has a row for every running sequence
            req.steer_row = self.runner.steer(steer.vectors)
        return True

    def release(self, req: GenerationRequest, tokens: list[int] = (), written: int = 0) -> None:
        """The request's blocks let go, once; the full ones its first `written` `tokens` fill stay findable. Its
        steering row too."""
        if self.pool is not None and req.blocks is not None:
            self.pool.keep_full(req.blocks, tokens, written)
            self.pool.release(req.blocks)
            req.blocks = None
        if req.steer_row:
            self.runner.unsteer(req.steer_row)
            req.steer_row = 0

    def grow(self, rows: list[RunningRow], ahead: int) -> None:
        """Blocks for each row's positions up to `ahead` past those cached (from its reservation; no further than the
        context)."""
        if self.pool is not None:
            for row in rows:
                self.pool.grow(row.req.blocks, min(row.cached + ahead, self.context_length))

    def written(self, req: GenerationRequest, tokens: list[int], written: int) -> None:
        """The request's first `written` `tokens` are in the cache: the full blocks they fill become findable."""
        if self.pool is not None and req.blocks is not None:
            self.pool.keep_full(req.blocks, tokens, written)

    @staticmethod
    def cached(req: GenerationRequest) -> int:
        """The prompt's tokens read from cached blocks: its prefill starts after them."""
        return req.blocks.cached * BLOCK_TOKENS if req.blocks is not None else 0

    def uncached(self, req: GenerationRequest) -> int:
        return len(req.prompt_ids) - self.cached(req)
