"""Continuous-batching text generation for any causal LM behind the runner seam (server/runners/).

The compute thread (server/compute.py) drives the engine. Between two decode steps it admits
waiting requests (prefill, then join the running batch) and drops finished, cancelled or timed-out
ones, so requests join and leave the batch independently. Running request i owns the runner's slot
i; a finished request's slot is refilled by moving the last one into it, so a step always covers
slots 0..n-1 (for our GPT, a fixed-shape step that can be compiled).

Results go back through a per-request callback (`sink`), which the HTTP layer points at an asyncio
queue and synchronous callers at a plain queue.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from models.sampling import Draw, SamplingParams, SequenceState, reported_logprob, sample
from server.compute import ComputeThread
from server.config import default
from server.detokenizer import Detokenizer
from server.runners import CausalLMRunner


@dataclass(frozen=True)
class Alternative:
    """A likely token at a step, with its text: routers report it without a tokenizer."""

    id: int
    text: str
    logprob: float
    special: bool  # the end-of-text token


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; immutable once emitted (every consumer sees the same event)."""

    id: int
    text: str  # text released by this token ('' while a stop sequence or a UTF-8 character is pending)
    token_text: str = ""  # the token's own text, decoded alone (when logprobs were asked for)
    special: bool = False  # the end-of-text token
    logprob: float | None = None
    top_logprobs: tuple[Alternative, ...] = ()
    last: bool = False  # the generation ends with this token (a FinishEvent follows at once)


@dataclass
class FinishEvent:
    reason: str  # length | eos_token | stop_sequence | cancelled | timeout | error
    text: str  # the whole generated text (stop sequence excluded)
    generated_tokens: int
    prompt_tokens: int
    message: str = ""
    tail: str = ""  # text held back until the end (a possible stop-sequence start, a partial character)


Event = TokenEvent | FinishEvent


class QueueFullError(RuntimeError):
    """The waiting queue is at capacity: the caller should answer 429 with Retry-After."""


class GenerationRequest:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[Event], None],
        timeout_s: float | None,
        withdraw: Callable[[GenerationRequest], None] = lambda req: None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink = sink
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.cancelled = threading.Event()
        self._withdraw = withdraw

    def cancel(self) -> None:
        """Leave the waiting queue now, or stop at the next decode step (e.g. the client disconnected)."""
        self.cancelled.set()
        self._withdraw(self)


class _Row:
    """A request in the running batch."""

    def __init__(self, req: GenerationRequest, logits: torch.Tensor, max_new: int, tokenizer) -> None:
        self.req = req
        self.logits: torch.Tensor | None = logits  # (V,) raw logits for the next token, for the batch sampler
        self.next_token: int | None = None  # or the next token, already chosen by the decode step (greedy rows)
        self.generated: list[int] = []
        self.length = len(req.prompt_ids)  # real tokens in the cache
        self.max_new = max_new
        self.detokenizer = Detokenizer(tokenizer, req.params.stop)
        generator = torch.Generator().manual_seed(req.params.seed) if req.params.seed is not None else None
        self.sampling = SequenceState(req.params, list(req.prompt_ids), 0, generator)
        self.draw: Draw | None = None  # the batch sampler's choice, with the logprobs it reports


@dataclass
class EngineStats:
    queued: int = 0
    running: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    prefill_passes: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)  # finish reason -> requests


class GenerationEngine:
    def __init__(
        self,
        runner: CausalLMRunner,
        max_batch_size: int | None = None,
        max_queue: int = default("max_queue"),
        max_prefill_tokens: int = default("max_prefill_tokens"),
    ) -> None:
        """max_batch_size: the runner's slots unless fewer are asked for (more cannot run: ValueError)."""
        slots = runner.facts.slots
        max_batch_size = slots if max_batch_size is None else max_batch_size
        if max_batch_size > slots:
            raise ValueError(f"max_batch_size {max_batch_size} > the runner's {slots} slots")
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.eos_id = runner.facts.eos_id
        self.context_length = runner.facts.context_length
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = EngineStats()
        self.wake: Callable[[], None] = lambda: None  # set by the compute thread that drives the engine
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._lock = threading.Lock()
        self._rows: list[_Row] = []  # row i owns slot i of the decode step's cache
        self._own_thread: ComputeThread | None = None

    # -- lifecycle (an engine used on its own: tests, benchmarks) -------------------------------

    def start(self) -> None:
        """Run on a compute thread of its own (the server attaches its engines to the shared one)."""
        self._own_thread = ComputeThread(f"engine-{id(self):x}")
        self._own_thread.attach(self)
        self._own_thread.start()

    def stop(self) -> None:
        if self._own_thread is not None:
            self._own_thread.stop()

    # -- submitting ----------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[Event], None],
        timeout_s: float | None = None,
    ) -> GenerationRequest:
        """Queue a request; raises QueueFullError when the queue is full, ValueError on a bad prompt."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.context_length}")
        req = GenerationRequest(prompt_ids, params, sink, timeout_s, self._withdraw)
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests waiting (max_queue={self.max_queue})")
            self._waiting.append(req)
            self.stats.queued = len(self._waiting)
        self.wake()
        return req

    def _withdraw(self, req: GenerationRequest) -> None:
        """A cancelled request still waiting frees its place in the queue at once (no 429 for others)."""
        with self._lock:
            try:
                self._waiting.remove(req)
            except ValueError:
                return  # admitted or finished: the next step drops it
            self.stats.queued = len(self._waiting)
        self._emit(req, FinishEvent("cancelled", "", 0, len(req.prompt_ids)))

    # -- the scheduling loop, one iteration per call from the compute thread ---------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._rows)

    def run_once(self) -> None:
        """Admit what fits in the batch, then one decode step; an error fails the batch, not the engine."""
        with self._lock:
            admitted = []
            while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
                admitted.append(self._waiting.popleft())
            self.stats.queued = len(self._waiting)
        with torch.inference_mode():
            self._admit(admitted)
            try:
                self._step()
            except Exception as e:  # e.g. out of memory: fail the batch, keep serving
                for row in self._rows:
                    self._finish(row, "error", f"{type(e).__name__}: {e}")
                self._rows = []

    def cancel_all(self, message: str) -> None:
        """Finish every running and waiting request as cancelled (shutdown)."""
        for row in self._rows:
            self._finish(row, "cancelled", message)
        self._rows = []
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for req in waiting:
            self._emit(req, FinishEvent("cancelled", "", 0, len(req.prompt_ids), message))

    def _admit(self, reqs: list[GenerationRequest]) -> None:
        """Prefill the new prompts together, a few at a time, each into a free slot of the cache.

        Prompts are sorted by length and grouped so that a group's padded size stays within
        max_prefill_tokens: one forward pass per group instead of one per request (time to first
        token under load), without one long prompt padding many short ones.
        """
        live = []
        for req in reqs:
            if req.cancelled.is_set():
                self._emit(req, FinishEvent("cancelled", "", 0, len(req.prompt_ids)))
            else:
                live.append(req)
        group: list[GenerationRequest] = []
        for req in sorted(live, key=lambda r: len(r.prompt_ids)):
            if group and (len(group) + 1) * len(req.prompt_ids) > self.max_prefill_tokens:
                self._prefill(group)
                group = []
            group.append(req)
        if group:
            self._prefill(group)

    def _prefill(self, reqs: list[GenerationRequest]) -> None:
        """The prompts into the next free slots, in one call to the runner."""
        slots = list(range(len(self._rows), len(self._rows) + len(reqs)))
        try:
            logits = self.runner.prefill(slots, [req.prompt_ids for req in reqs])
        except Exception as e:  # a failed prefill fails its request, not its group or the engine
            if len(reqs) > 1:
                for req in reqs:
                    self._prefill([req])
            else:
                self._emit(reqs[0], FinishEvent("error", "", 0, len(reqs[0].prompt_ids), f"{type(e).__name__}: {e}"))
            return
        self.stats.prefill_passes += 1
        for req, row_logits in zip(reqs, logits, strict=True):
            max_new = min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids))
            self._rows.append(_Row(req, row_logits, max_new, self.tokenizer))

    def _step(self) -> None:
        """Take every row's next token (chosen by the last decode step for greedy rows, by one batch
        sampler call for the others), retire finished rows, run one decode step."""
        if not self._rows:
            return
        live = [row for row in self._rows if self._wanted(row)]
        pending = [row for row in live if row.next_token is None]
        if pending:
            logits = torch.stack([r.logits for r in pending])
            for row, draw in zip(pending, sample(logits, [r.sampling for r in pending], self.eos_id), strict=True):
                row.next_token, row.draw, row.logits = draw.token, draw, None
        kept = [row for row in live if self._advance(row)]
        if len(kept) < len(self._rows):
            self._compact(kept)
            self.stats.running = len(self._rows)  # also when the batch empties (the gauge read 1 forever)
            if not self._rows:
                return
        rows = self._rows
        out = self.runner.decode(
            [row.generated[-1] for row in rows],
            [row.length for row in rows],
            [row.sampling.eos_logit_bias() if row.req.params.greedy else 0.0 for row in rows],
        )
        sampled = [i for i, row in enumerate(rows) if not row.req.params.greedy]
        copies = out.logits[sampled].float().cpu() if sampled else None  # a copy: a CUDA graph reuses its output
        for row, token, logprob in zip(rows, out.greedy, out.logprobs, strict=True):
            row.length += 1
            if row.req.params.greedy:
                row.next_token = token
                row.draw = Draw(token, reported_logprob(logprob)) if row.req.params.logprobs else None
            else:
                row.next_token = None
        for j, i in enumerate(sampled):
            rows[i].logits = copies[j]
        self.stats.decode_steps += 1
        self.stats.running = len(rows)

    def _compact(self, kept: list[_Row]) -> None:
        """Fill the slots of finished rows with the last running ones, so running rows own slots 0..n-1."""
        slot = {id(row): i for i, row in enumerate(self._rows)}
        placed: list[_Row | None] = [None] * len(kept)
        movers = []
        for row in kept:
            if slot[id(row)] < len(kept):
                placed[slot[id(row)]] = row
            else:
                movers.append(row)
        holes = [i for i, row in enumerate(placed) if row is None]
        for row, hole in zip(movers, holes, strict=True):
            self.runner.move(slot[id(row)], hole, row.length)
            placed[hole] = row
        self._rows = placed

    def _wanted(self, row: _Row) -> bool:
        """False (and finished) when the request was cancelled or ran out of time."""
        if row.req.cancelled.is_set():
            self._finish(row, "cancelled")
            return False
        if row.req.deadline is not None and time.monotonic() > row.req.deadline:
            self._finish(row, "timeout", "request exceeded its time limit")
            return False
        return True

    def _advance(self, row: _Row) -> bool:
        """Report the row's next token; False when the row is finished."""
        req, p = row.req, row.req.params
        draw, row.draw = row.draw or Draw(row.next_token), None
        token, logprob = draw.token, draw.logprob
        alternatives = tuple(Alternative(i, self.tokenizer.decode([i]), lp, i == self.eos_id) for i, lp in draw.top)
        token_text = self.tokenizer.decode([token]) if p.logprobs else ""
        self.stats.tokens_generated += 1
        if token == self.eos_id:
            self._emit(req, TokenEvent(token, "", token_text, True, logprob, alternatives, last=True))
            self._finish(row, "eos_token")
            return False
        row.generated.append(token)
        row.sampling.seen.append(token)
        row.sampling.generated += 1
        released, stopped = row.detokenizer.add(token)
        at_length = len(row.generated) >= row.max_new
        last = stopped or at_length
        self._emit(req, TokenEvent(token, released, token_text, False, logprob, alternatives, last=last))
        if stopped or at_length:
            self._finish(row, "stop_sequence" if stopped else "length")
            return False
        return True

    @staticmethod
    def _emit(req: GenerationRequest, event: Event) -> None:
        """Hand an event to the request's sink; a failing sink (its client gone) never hurts the batch."""
        try:
            req.sink(event)
        except Exception:
            req.cancel()

    def _finish(self, row: _Row, reason: str, message: str = "") -> None:
        tail = ""
        if reason != "stop_sequence":  # release what was held back: undecoded bytes, stop-sequence prefixes
            tail, stopped = row.detokenizer.finish()
            reason = "stop_sequence" if stopped else reason
        self.stats.finished[reason] += 1
        prompt_tokens = len(row.req.prompt_ids)
        self._emit(row.req, FinishEvent(reason, row.detokenizer.text, len(row.generated), prompt_tokens, message, tail))

    # -- synchronous use (tests, command line, Cog) --------------------------------------------

    def stream(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None) -> Iterator[Event]:
        """Submit and yield every event as it comes; closing the iterator early cancels the request."""
        events: queue.Queue[Event] = queue.Queue()
        req = self.submit(prompt_ids, params, events.put, timeout_s)
        try:
            while not isinstance(event := events.get(), FinishEvent):
                yield event
            yield event
        finally:
            req.cancel()

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> tuple[list[TokenEvent], FinishEvent]:
        """Submit and wait: every token event, then the finish event."""
        *tokens, finish = self.stream(prompt_ids, params, timeout_s)
        return tokens, finish
