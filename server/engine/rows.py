"""What an engine holds of its requests: each one as submitted (`GenerationRequest`, waiting or running), a
running one's row of the batch (`RunningRow`) and the engine's counters (`EngineStats`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.sampling import Draw, SamplingParams, SequenceState, reported_logprob
from server.engine.events import EngineOutput
from server.engine.kv_blocks import Holding
from server.engine.speculation import PromptLookup
from server.execution.runner import DecodeRows


class QueueFullError(RuntimeError):
    """The waiting queue is at capacity: the caller should answer 429 with Retry-After."""


class GenerationRequest:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[EngineOutput], None],
        timeout_s: float | None,
        withdraw: Callable[[GenerationRequest], None] = lambda req: None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink = sink
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.cancelled = threading.Event()
        self.end_reason = "cancelled"  # why it was asked to end, as its Retired output says
        self._withdraw = withdraw
        self.blocks: Holding | None = None  # its KV blocks, from admission on (a paged runner's: kv_blocks.py)
        self.steer_row = 0  # its row of the runner's steering table while it runs steered (0: none)

    @property
    def table(self) -> list[int]:
        """Its block table (empty where the runner keeps a static slot a row)."""
        return self.blocks.table if self.blocks is not None else []

    def end(self, reason: str) -> None:
        """Leave the waiting queue now, or stop at the next step: `reason` is what the output side found
        (a stop sequence); the first reason given is kept."""
        if not self.cancelled.is_set():
            self.end_reason = reason
        self.cancelled.set()
        self._withdraw(self)

    def cancel(self) -> None:
        """End it because nobody wants its output any more (the client disconnected)."""
        self.end("cancelled")


class RunningRow:
    """A request in the running batch."""

    def __init__(self, req: GenerationRequest, max_new: int) -> None:
        self.req = req
        # the row's tokens, held once: its prompt, then each generated token but an end of text, appended by
        # its sampling state (which reads them for the repetition penalty)
        self.tokens = list(req.prompt_ids)
        self.draws: list[Draw] = []  # this run's tokens, chosen (greedy rows: by the decode step), not sent yet
        self.max_new = max_new
        generator = torch.Generator().manual_seed(req.params.seed) if req.params.seed is not None else None
        self.sampling = SequenceState(req.params, self.tokens, 0, generator)
        self.finished = False  # its finish event is out: the next schedule retires it
        self._lookup = PromptLookup()  # its tokens' n-grams, where it drafts (built at its first draft)

    @property
    def generated(self) -> int:
        """Tokens generated so far (sent, the end of text excluded)."""
        return len(self.tokens) - len(self.req.prompt_ids)

    @property
    def cached(self) -> int:
        """Tokens whose keys and values are in the cache: all but the last, which the next step decodes."""
        return len(self.tokens) - 1

    def take(self, made: list[tuple[int, float]], ends: set[int]) -> bool:
        """A greedy pass's (token, logprob) pairs as draws, up to an end token or the end of the row's constraint
        (the pass's tokens after it are dropped); whether one came. The constraint takes each token at once: the
        next step's mask is its next state."""
        for token, logprob in made:
            self.draws.append(greedy_draw(self, token, logprob))
            if token in ends:
                return True
            if self.sampling.matcher is not None and self.sampling.consume_ahead(token):
                return True  # the constraint is complete: nothing may follow
        return False

    def lookup(self) -> tuple[PromptLookup, list[int]]:
        """The index of the row's tokens and this run's draws, brought up to date, and those tokens."""
        tokens = self.tokens + [d.token for d in self.draws]
        self._lookup.index(tokens)
        return self._lookup, tokens


@dataclass
class EngineStats:
    queued: int = 0
    running: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    prefill_passes: int = 0
    draft_tokens: int = 0  # proposed to a draft check (server/engine/speculation.py)
    draft_tokens_agreed: int = 0  # of those, the model's own greedy tokens
    finished: collections.Counter = field(default_factory=collections.Counter)  # finish reason -> requests


def greedy_draw(row: RunningRow, token: int, logprob: float) -> Draw:
    """A greedy row's token as the decode step chose it, with its logprob where the request asked for one."""
    return Draw(token, reported_logprob(logprob) if row.req.params.logprobs else None)


def decode_rows(running: list[RunningRow], tokens: list[int], ahead: int, vocab_size: int) -> DecodeRows:
    """The next step's inputs for rows that are `ahead` tokens past their cache: a greedy row's EOS bias and
    constraint mask applied on the step's graph; a sampled row's by the sampler, on its logits."""
    greedy = [row.req.params.greedy for row in running]
    return DecodeRows(
        tokens,
        [row.cached + ahead for row in running],
        [row.sampling.eos_logit_bias(ahead) if g else 0.0 for row, g in zip(running, greedy, strict=True)],
        [row.sampling.allowed_next(vocab_size) if g else None for row, g in zip(running, greedy, strict=True)],
        [row.req.table for row in running],
        [row.req.steer_row for row in running],
    )


def compacted(rows: list[RunningRow], kept: list[RunningRow]) -> tuple[list[RunningRow], list[tuple[int, int, int]]]:
    """The kept rows as rows 0..n-1, the last ones moved into the places of those gone, and the moves (from, to,
    cached positions) a runner with a slot a row makes (CausalLMRunner.move)."""
    slot = {id(row): i for i, row in enumerate(rows)}
    placed: list[RunningRow | None] = [None] * len(kept)
    movers = []
    for row in kept:
        if slot[id(row)] < len(kept):
            placed[slot[id(row)]] = row
        else:
            movers.append(row)
    holes = [i for i, row in enumerate(placed) if row is None]
    moves = []
    for row, hole in zip(movers, holes, strict=True):
        moves.append((slot[id(row)], hole, row.cached))
        placed[hole] = row
    return placed, moves
