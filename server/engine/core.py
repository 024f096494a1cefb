"""Continuous-batching text generation for any causal LM behind the runner seam (server/execution/).

The compute thread (server/execution/compute_thread.py) drives the engine, one step per call, each in the order a
reader expects (vLLM's schedule -> execute -> update):
1. schedule: retire finished, cancelled or timed-out rows, admit waiting requests that fit;
2. run: decode the running rows' last tokens (one step for all, or several back to back while every row is
   greedy and none was admitted: `steps_per_schedule`; a lone row's drafts checked in one pass: `draft_tokens`),
   then prefill the admitted prompts (their uncached tails: prefix caching);
3. sample: choose every row's next token (greedy rows' on the decode step's graph, the others in one
   sampler call);
4. output: each row's token to its request, and which rows are now finished.
Running request i is row i of a step; a retired request's row is refilled by moving the last one into it, so a
step always covers rows 0..n-1 (a fixed-shape step that can be compiled). A request is admitted when a row and the
blocks it may need are free (server/engine/request_blocks.py). Results go back as ids through a per-request `sink`
that only queues them: text is made on the consumer's side (server/engine/output.py).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from models.sampling import Draw, SamplingParams, sample
from server.config import default
from server.engine.events import EngineOutput, Event, FinishEvent, Retired, Sampled, TokenEvent
from server.engine.output import RequestOutput
from server.engine.request_blocks import RequestBlocks
from server.engine.rows import (
    EngineStats,
    GenerationRequest,
    QueueFullError,
    RunningRow,
    compacted,
    decode_rows,
    greedy_draw,
)
from server.engine.speculation import speculate
from server.execution.compute_thread import ComputeThread
from server.execution.runner import CausalLMRunner

log = logging.getLogger("tinyserve")


class GenerationEngine:
    def __init__(
        self,
        runner: CausalLMRunner,
        max_batch_size: int | None = None,
        max_queue: int = default("max_queue"),
        max_prefill_tokens: int = default("max_prefill_tokens"),
        steps_per_schedule: int = default("steps_per_schedule"),
        draft_tokens: int = default("draft_tokens"),
        prefix_caching: bool = default("prefix_caching"),
    ) -> None:
        """max_batch_size: the runner's slots unless fewer are asked for (more cannot run: ValueError)."""
        facts = runner.facts
        if facts.slots < 1:
            raise ValueError(f"{type(runner).__name__} reports no slots (ModelFacts.slots)")
        max_batch_size = facts.slots if max_batch_size is None else max_batch_size
        if max_batch_size > facts.slots:
            raise ValueError(f"max_batch_size {max_batch_size} > the runner's {facts.slots} slots")
        self.runner, self.tokenizer, self.eos_id = runner, runner.tokenizer, facts.eos_id
        self.context_length = facts.context_length
        self.max_batch_size, self.max_queue, self.max_prefill_tokens = max_batch_size, max_queue, max_prefill_tokens
        self.steps_per_schedule = steps_per_schedule
        self.draft_tokens = draft_tokens if facts.verify_tokens else 0  # 0: no speculation
        self.kv = RequestBlocks(runner, prefix_caching)
        self.stats = EngineStats()
        self.driver: ComputeThread | None = None  # the compute thread whose loop runs this engine (`drive_with`)
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._lock = threading.Lock()
        self._rows: list[RunningRow] = []  # row i of every step
        self._to_sample: list[tuple[RunningRow, torch.Tensor]] = []  # rows whose token the sampler chooses, (V,)

    # -- who runs it: a compute thread calls `run_once` while `has_work`; `submit` wakes that thread -----

    def drive_with(self, thread: ComputeThread) -> None:
        """Be run by this compute thread's loop (the server's engines share its one thread)."""
        self.driver = thread
        thread.attach(self)

    def start(self) -> None:
        """Run on a compute thread of its own (an engine used on its own: tests, benchmarks)."""
        self.drive_with(ComputeThread(f"engine-{id(self):x}"))
        self.driver.start()

    def stop(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[EngineOutput], None],
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
        if self.driver is not None:
            self.driver.wake()
        return req

    def _withdraw(self, req: GenerationRequest) -> None:
        """A cancelled request still waiting frees its place in the queue at once (no 429 for others)."""
        with self._lock:
            try:
                self._waiting.remove(req)
            except ValueError:
                return  # admitted or finished: the next step drops it
            self.stats.queued = len(self._waiting)
        self._finish_request(req, req.end_reason)

    # -- the scheduling loop, one iteration per call from the compute thread ---------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._rows)

    def run_once(self) -> None:
        """One engine step: schedule, run, sample, output. An error fails the batch, not the engine."""
        admitted: list[GenerationRequest] = []
        with torch.inference_mode():  # as the cache was made: a slot's move writes to it too
            try:
                admitted = self._schedule()
                self._run(admitted)
                self._sample()
                self._output()
            except Exception as e:  # e.g. out of memory: fail the batch, keep serving
                log.exception("an engine step failed; its batch fails with it")
                message = f"{type(e).__name__}: {e}"
                for row in self._rows:
                    if not row.finished:
                        self._finish(row, "error", message)
                placed = {id(row.req) for row in self._rows}
                for req in admitted:  # taken from the queue, not prefilled yet
                    if id(req) not in placed:
                        self._finish_request(req, "error", message)
                self._rows, self._to_sample = [], []
                self.stats.running = 0

    def cancel_all(self, message: str) -> None:
        """Finish every running and waiting request as cancelled (shutdown)."""
        for row in self._rows:
            if not row.finished:
                self._finish(row, "cancelled", message)
        self._rows = []
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for req in waiting:
            self._finish_request(req, "cancelled", message)

    # -- 1. schedule --------------------------------------------------------------------------

    def _schedule(self) -> list[GenerationRequest]:
        """Retire finished, cancelled and timed-out rows (their slots refilled), then admit the waiting that fit."""
        kept = [row for row in self._rows if not row.finished and self._wanted(row)]
        if len(kept) < len(self._rows):
            self._rows, moves = compacted(self._rows, kept)
            for src, dst, length in moves:
                self.runner.move(src, dst, length)
        self.stats.running = len(self._rows)  # also when the batch empties (the gauge read 1 forever)
        with self._lock:
            admitted = []
            while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
                if not self.kv.take(self._waiting[0]):
                    break  # the first in line waits for blocks; none behind it goes first
                admitted.append(self._waiting.popleft())
            self.stats.queued = len(self._waiting)
        live = []
        for req in admitted:
            if req.cancelled.is_set():
                self._finish_request(req, req.end_reason)
            else:
                live.append(req)
        return live

    # -- 2. run --------------------------------------------------------------------------------

    def _run(self, admitted: list[GenerationRequest]) -> None:
        """Decode the running rows (one step when prompts were admitted), then prefill the admitted prompts into the
        rows after them; rows with only their first token (a burst in parts) skip their step, to join the new ones."""
        if self._rows and not (admitted and all(row.generated <= 1 for row in self._rows)):
            steps = self._steps_ahead(self._rows, admitted)
            if steps > 1:
                self._decode_greedy(self._rows, steps)
            else:
                self._decode(self._rows)
        self._admit(admitted)

    def _decode(self, running: list[RunningRow]) -> None:
        """One step for every running row: greedy rows get their token from the step, the others' logits
        go to the batch sampler."""
        greedy = [row.req.params.greedy for row in running]  # chosen on the step's graph
        self.kv.grow(running, 1)
        vocab = self.runner.facts.vocab_size
        out = self.runner.decode(decode_rows(running, [row.tokens[-1] for row in running], 0, vocab))
        sampled = [i for i, g in enumerate(greedy) if not g]
        copies = out.logits[sampled].float().cpu() if sampled else None  # a copy: a CUDA graph reuses its output
        for row, g, token, logprob in zip(running, greedy, out.greedy, out.logprobs, strict=True):
            if g:
                row.draws.append(greedy_draw(row, token, logprob))
        self._to_sample += [(running[i], copies[j]) for j, i in enumerate(sampled)]
        self.stats.decode_steps += 1

    def _steps_ahead(self, running: list[RunningRow], admitted: list[GenerationRequest]) -> int:
        """Tokens a row makes before the next schedule: 1 unless no request waits or was admitted (its prefill should
        not wait) and every row is greedy (chosen on the step's graph; a constraint's mask follows the tokens as they
        come: RunningRow.take) without stop sequences (found on the output side, a step behind); then up to
        `steps_per_schedule`, no more than a row has left (vLLM's multi-step scheduling)."""
        if self.steps_per_schedule == 1 or self._waiting or admitted:
            return 1
        if not all(r.req.params.greedy and not r.req.params.stop for r in running):
            return 1
        return min(self.steps_per_schedule, min(row.max_new - row.generated for row in running))

    def _decode_greedy(self, running: list[RunningRow], steps: int) -> None:
        """Up to `steps` tokens a row back to back, each step's greedy tokens fed to the next (a lone row's drafts
        checked in one pass where it has some: speculation.py); they stop after a row's end of text, when a
        request arrives (its prefill should not wait) or when a running one is cancelled."""
        ends = [{self.eos_id, *row.req.params.stop_token_ids} for row in running]
        tokens = [row.tokens[-1] for row in running]
        ahead = 0
        while ahead < steps:
            made = self._verified(running, ahead, steps - ahead)
            if made is None:
                self.kv.grow(running, ahead + 1)
                out = self.runner.decode(decode_rows(running, tokens, ahead, self.runner.facts.vocab_size))
                made = [[(token, logprob)] for token, logprob in zip(out.greedy, out.logprobs, strict=True)]
            self.stats.decode_steps += 1
            ended = [row.take(new, end) for row, end, new in zip(running, ends, made, strict=True)]
            ahead += len(made[0])
            tokens = [new[-1][0] for new in made]
            if any(ended) or self._waiting or any(row.req.cancelled.is_set() for row in running):
                break

    def _verified(self, running: list[RunningRow], ahead: int, budget: int) -> list[list[tuple[int, float]]] | None:
        """A lone row's next tokens from one draft check (speculation.py), at most `budget`; None: decode."""
        row = running[0]
        if len(running) != 1 or not self.draft_tokens or budget < 2 or row.sampling.matcher or row.req.steer_row:
            return None  # a constrained or steered row's drafts would be checked without its mask or its steering
        bias = row.sampling.eos_logit_bias
        limit = min(self.draft_tokens, budget - 1)
        lookup, tokens = row.lookup()
        self.kv.grow(running, ahead + self.runner.facts.verify_tokens)
        made = speculate(
            self.runner, lookup, tokens, row.cached + ahead, lambda i: bias(ahead + i), limit, row.req.table
        )
        if made is None:
            return None
        tokens, logprobs, drafted = made
        self.stats.draft_tokens += drafted
        self.stats.draft_tokens_agreed += len(tokens) - 1
        return [list(zip(tokens, logprobs, strict=True))]

    def _admit(self, reqs: list[GenerationRequest]) -> None:
        """Prefill the new prompts in groups sorted by length, a group's padded size within max_prefill_tokens: a
        pass per group, not per request (time to first token under load), no long prompt padding short ones."""
        group: list[GenerationRequest] = []
        for req in sorted(reqs, key=self.kv.uncached):
            if group and (len(group) + 1) * self.kv.uncached(req) > self.max_prefill_tokens:
                self._prefill(group)
                group = []
            group.append(req)
        if group:
            self._prefill(group)
        self.stats.running = len(self._rows)

    def _prefill(self, reqs: list[GenerationRequest]) -> None:
        """The prompts' uncached tails into the next free rows (through their blocks), in one call to the runner;
        their full blocks then findable by later prompts."""
        slots = list(range(len(self._rows), len(self._rows) + len(reqs)))
        try:
            logits = self.runner.prefill(
                slots,
                [req.prompt_ids for req in reqs],
                [req.table for req in reqs],
                [self.kv.cached(req) for req in reqs],
                [req.steer_row for req in reqs],
            )
        except Exception as e:  # a failed prefill fails its request, not its group or the engine
            log.exception("a prefill of %d prompts failed", len(reqs))
            if len(reqs) > 1:
                for req in reqs:
                    self._prefill([req])
            else:
                self._finish_request(reqs[0], "error", f"{type(e).__name__}: {e}")
            return
        self.stats.prefill_passes += 1
        for req in reqs:
            self.kv.written(req, req.prompt_ids, len(req.prompt_ids))
        for req, row_logits in zip(reqs, logits, strict=True):  # a new row's first token: always the sampler's
            row = RunningRow(req, min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids)))
            self._rows.append(row)
            self._to_sample.append((row, row_logits))

    # -- 3. sample -----------------------------------------------------------------------------

    def _sample(self) -> None:
        """Every row whose token the run did not choose (sampled rows, new rows): one call of the batch sampler."""
        if self._to_sample:
            rows, logits = zip(*self._to_sample, strict=True)
            self._to_sample = []
            for row, draw in zip(
                rows, sample(torch.stack(logits), [r.sampling for r in rows], self.eos_id), strict=True
            ):
                row.draws.append(draw)

    # -- 4. output -----------------------------------------------------------------------------

    def _output(self) -> None:
        """Each row's tokens to its request, in order (its end is its last: _decode_greedy stops there); a row
        that ends here is retired."""
        for row in self._rows:
            draws, row.draws = row.draws, []
            for draw in draws:
                self._advance(row, draw)
            self.kv.written(row.req, row.tokens, row.cached)  # the full blocks: findable by later prompts

    def _wanted(self, row: RunningRow) -> bool:
        """False (and finished) when the request was cancelled or ran out of time."""
        if row.req.cancelled.is_set():
            self._finish(row, row.req.end_reason)
            return False
        if row.req.deadline is not None and time.monotonic() > row.req.deadline:
            self._finish(row, "timeout", "request exceeded its time limit")
            return False
        return True

    def _advance(self, row: RunningRow, draw: Draw) -> None:
        """Send the row's next token, and retire the row when the token ends it."""
        self.stats.tokens_generated += 1
        eos = draw.token == self.eos_id or draw.token in row.req.params.stop_token_ids  # a chat's end of turn too
        complete = False  # a constraint's grammar is complete: nothing more may follow
        if not eos:
            complete = row.sampling.advance(draw.token)  # appends the token to row.tokens
        matcher = row.sampling.matcher
        if matcher is not None and matcher.is_error():
            self._finish(row, "error", f"constraint: {matcher.get_error()}")
            return
        end = "eos_token" if eos or complete else "length" if row.generated >= row.max_new else None
        self._emit(row.req, Sampled(draw.token, draw.logprob, draw.top, eos, end))
        if end is not None:
            self._finish(row, end)

    @staticmethod
    def _emit(req: GenerationRequest, out: EngineOutput) -> None:
        """Hand an output to the request's sink; a failing sink (its client gone) never hurts the batch."""
        try:
            req.sink(out)
        except Exception:
            req.cancel()

    def _finish_request(self, req: GenerationRequest, reason: str, message: str = "") -> None:
        """A request that ends without a row (withdrawn, cancelled before admission, its prefill failed)."""
        self.kv.release(req)
        self.stats.finished[reason] += 1
        self._emit(req, Retired(reason, 0, len(req.prompt_ids), message))

    def _finish(self, row: RunningRow, reason: str, message: str = "") -> None:
        """The row ends here: its blocks let go (those its written tokens fill kept findable) before its client
        hears of it; the next schedule retires it."""
        self.kv.release(row.req, row.tokens, row.cached)
        row.finished = True
        self.stats.finished[reason] += 1
        self._emit(row.req, Retired(reason, row.generated, len(row.req.prompt_ids), message))

    # -- synchronous use (tests, command line, Cog): text made on the caller's thread ----------

    def stream(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None) -> Iterator[Event]:
        """Submit and yield every event, with its text, as it comes; closing the iterator cancels the request."""
        outs: queue.Queue[EngineOutput] = queue.Queue()
        req = self.submit(prompt_ids, params, outs.put, timeout_s)
        made = RequestOutput(req, self.tokenizer, self.eos_id)
        try:
            while not made.finished:
                yield from made.add(outs.get())
        finally:
            req.cancel()

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> tuple[list[TokenEvent], FinishEvent]:
        """Submit and wait: every token event, then the finish event."""
        *tokens, finish = self.stream(prompt_ids, params, timeout_s)
        return tokens, finish
