"""The one path from a request to the models, shared by the HTTP routers and the Cog predictor.

Routers and predict.py are glue: they turn their inputs into these calls and the results into their
wire formats. What decides something lives here once: which model serves a request, the prompt
policy, when a finish is a failure, the 429 on a full queue, and the collect-or-499 loop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

from models.sampling import SamplingParams
from server.config import Settings
from server.engine.events import EngineOutput, Event, FinishEvent, Retired, TokenEvent
from server.engine.output import RequestOutput
from server.engine.rows import QueueFullError
from server.errors import APIError
from server.features.steering import SteerPart, steer_of
from server.serving.registry import ModelLoadingError, ModelRegistry, ServedModel, UnknownModelError

RETRY_AFTER_S = "1"
LOADING_RETRY_AFTER_S = "5"  # a checkpoint loads behind /health's 200 in a few seconds
VARIANTS = {"softmax0": ["softmax0"], "softmax1": ["softmax1"], "both": ["softmax0", "softmax1"]}


class Fields(NamedTuple):
    """How a wire format names the request's fields, so that a 4xx names the one the client sent."""

    model: str = "model"
    prompt: str = "prompt"
    logit_bias: str = "logit_bias"
    steer: str = "steer"


DEFAULT_FIELDS = Fields()


@dataclass(frozen=True)
class CompletionJob:
    """A validated completion request: the model, the prompt's token ids and the sampling parameters."""

    model: ServedModel
    prompt_ids: list[int]  # what generation continues
    params: SamplingParams
    echo_ids: list[int] | None = None  # the whole prompt, when it is echoed (it may exceed the context)


def find_model(registry: ModelRegistry, model_id: str | None, kind: str | None, field: str) -> ServedModel:
    """The requested model, or the default one of that kind; unknown ids are 404s naming the field, a
    model still loading a 503 with Retry-After."""
    try:
        return registry.get(model_id, kind) if model_id is not None else registry.default(kind)
    except UnknownModelError as e:
        raise APIError(404, f"{field}: {e}", field, "not_found") from None
    except ModelLoadingError as e:
        raise loading_error(field, str(e)) from None


def loading_error(field: str, message: str) -> APIError:
    return APIError(503, f"{field}: {message}", field, "loading", {"Retry-After": LOADING_RETRY_AFTER_S})


def fill_mask_models(registry: ModelRegistry, model_id: str | None, variant: str) -> list[ServedModel]:
    """The model asked for by id, else one served model per requested normaliser, in that order."""
    if model_id is not None:
        return [find_model(registry, model_id, "mlm", "model")]
    wanted = VARIANTS[variant]
    served = {m.facts.normaliser: m for m in reversed(registry.models.values()) if m.kind == "mlm"}  # first wins
    missing = [v for v in wanted if v not in served]
    if missing and "mlm" in registry.loading.values():
        raise loading_error("variant", "the fill-mask models are loading; retry in a few seconds")
    if missing:
        raise APIError(404, f"variant: no {' or '.join(missing)} fill-mask model is served", "variant", "not_found")
    return [served[v] for v in wanted]


def prepare_completion(
    registry: ModelRegistry,
    settings: Settings,
    model_id: str | None,
    prompt: str | list[int],
    params: SamplingParams,
    truncate: int | None = None,
    fields: Fields = DEFAULT_FIELDS,
    echo: bool = False,
    steer: list[SteerPart] | None = None,
) -> CompletionJob:
    """A prompt given as text or as token ids, checked against the model and its limits, steered where the request
    asks (features/steering.py). An echoed prompt is scored whole, however long (lm-eval sends windows longer than a
    small model's context); its completion continues from the last tokens that fit."""
    m = find_model(registry, model_id, "causal", fields.model)
    check_logit_bias(m, params.logit_bias, fields.logit_bias)
    params = replace(params, steer=steer_of(registry, m, steer, fields.steer))
    if isinstance(prompt, str):
        ids = encode_prompt(m, prompt, settings, fields.prompt)
    else:
        ids = check_token_ids(m, prompt, settings, fields.prompt)
    if echo:
        return CompletionJob(m, ids[-(m.facts.context_length - 1) :], params, echo_ids=ids)
    return CompletionJob(m, fit_prompt(m, ids, settings, truncate, fields.prompt), params)


def encode_prompt(m: ServedModel, text: str, settings: Settings, field: str) -> list[int]:
    if len(text) > settings.max_prompt_chars:
        raise APIError(
            422,
            f"{field}: prompt has {len(text)} characters; the limit is {settings.max_prompt_chars} "
            "(refused, not truncated)",
            field,
        )
    ids = m.runner.tokenizer.encode(text)
    if not ids:
        raise APIError(422, f"{field}: prompt must not be empty", field)
    return ids


def check_token_ids(m: ServedModel, ids: list[int], settings: Settings, field: str) -> list[int]:
    """A prompt sent as token ids: each must be in the vocabulary; the error names the index."""
    if len(ids) > settings.max_prompt_tokens:
        raise APIError(422, f"{field}: prompt has {len(ids)} tokens; the limit is {settings.max_prompt_tokens}", field)
    vocab = m.runner.facts.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        where = f"{field}[{bad}]"
        raise APIError(422, f"{where}: token id {ids[bad]} is outside the vocabulary [0, {vocab})", where)
    return ids


def fit_prompt(m: ServedModel, ids: list[int], settings: Settings, truncate: int | None, field: str) -> list[int]:
    """Over-long prompts are refused unless truncation is asked for (or configured); truncation keeps the
    checkpoint's start-of-sequence tokens (Llama's BOS) and the last tokens of the text."""
    prefix = m.runner.tokenizer.prefix
    prefix = prefix if ids[: len(prefix)] == prefix else []
    if truncate and len(ids) > truncate:
        ids = prefix + ids[len(prefix) :][-(truncate - len(prefix)) :] if truncate > len(prefix) else ids[-truncate:]
    limit = m.facts.context_length - 1  # room for one new token
    if len(ids) > limit:
        if not settings.truncate_prompt:
            raise APIError(
                422,
                f"{field}: prompt is {len(ids)} tokens; model {m.id} takes at most {limit} "
                "(refused; set parameters.truncate to keep the last tokens)",
                field,
            )
        ids = prefix + ids[len(prefix) :][-(limit - len(prefix)) :]
    return ids


def check_logit_bias(m: ServedModel, bias: dict[int, float], field: str) -> None:
    vocab = m.runner.facts.vocab_size
    bad = [t for t in bias if not 0 <= t < vocab]
    if bad:
        raise APIError(422, f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})", field)


class Outbox:
    """Engine events into one event loop's queues, with at most one wake-up of the loop pending.

    Waking the loop from the compute thread writes to its self-pipe, and the loop thread then takes the
    GIL from the compute thread: once per token per request, that cost grew with the batch. Here a
    decode step's events for every request cost one wake-up, and a request collected whole (not
    streamed) wakes its loop only when it finishes.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[asyncio.Queue[EngineOutput], EngineOutput]] = collections.deque()
        self._scheduled = False
        self._lock = threading.Lock()

    def sink(self, queue: asyncio.Queue[EngineOutput], wake_on_tokens: bool) -> Callable[[EngineOutput], None]:
        """The engine-side callback for one request's outputs (called on the compute thread)."""

        def put(out: EngineOutput) -> None:
            self._items.append((queue, out))  # before the flag is read: a pending drain will see it
            if wake_on_tokens or isinstance(out, Retired):
                self._schedule()

        return put

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False  # before draining: an event added from now on schedules a new drain
        while self._items:
            queue, event = self._items.popleft()
            queue.put_nowait(event)


_outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()


def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    if loop not in _outboxes:
        _outboxes[loop] = Outbox(loop)
    return _outboxes[loop]


async def events(
    job: CompletionJob,
    settings: Settings,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    streaming: bool = True,
) -> AsyncIterator[Event]:
    """Run one request on the model's engine and yield its events.

    The text is made here, on the event loop's thread (server/engine/output.py). streaming=False (the whole
    response at the end) delivers the token events together with the finish, unless a stop sequence
    must be looked for as the tokens come. Leaving the iteration early (client gone, stream closed)
    cancels the request at the next decode step, so its batch slot is freed.
    """
    engine = job.model.engine
    queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
    sink = outbox(asyncio.get_running_loop()).sink(queue, wake_on_tokens=streaming or bool(job.params.stop))
    try:
        req = engine.submit(job.prompt_ids, job.params, sink, settings.request_timeout_s)
    except QueueFullError as e:
        raise busy(e) from None
    output = RequestOutput(req, engine.tokenizer, engine.eos_id)
    try:
        while not output.finished:
            if queue.empty():  # wait_for costs a task per call: only pay it when there is nothing to read
                try:
                    out = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        return
                    continue
            else:
                out = queue.get_nowait()
            for event in output.add(out):
                if isinstance(event, FinishEvent) and (error := failure(event, settings)):
                    raise error
                yield event
    finally:
        req.cancel()


async def collect(
    job: CompletionJob, settings: Settings, is_disconnected: Callable[[], Awaitable[bool]] | None = None
) -> tuple[list[TokenEvent], FinishEvent]:
    """Every token event and the finish event; 499 when the client left before the end."""
    tokens, finish = [], None
    async for e in events(job, settings, is_disconnected, streaming=False):
        if isinstance(e, FinishEvent):
            finish = e
        else:
            tokens.append(e)
    if finish is None:
        raise APIError(499, "client disconnected", None, "cancelled")
    return tokens, finish


async def collect_all(
    jobs: list[CompletionJob], settings: Settings, is_disconnected: Callable[[], Awaitable[bool]] | None = None
) -> list[tuple[list[TokenEvent], FinishEvent]]:
    """`collect` for several jobs at once (the engine batches them); one failure cancels the others."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(job, settings, is_disconnected)) for job in jobs]
    except* APIError as errors:
        raise errors.exceptions[0] from None
    return [t.result() for t in tasks]


async def merged_events(jobs: list[CompletionJob], settings: Settings) -> AsyncIterator[tuple[int, Event]]:
    """The events of several jobs as they come, each with its job's index; a failure ends them all."""
    queue: asyncio.Queue[tuple[int, Event] | APIError] = asyncio.Queue()

    async def pump(index: int, job: CompletionJob) -> None:
        try:
            async for event in events(job, settings):
                await queue.put((index, event))
        except APIError as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        finished = 0
        while finished < len(jobs):
            item = await queue.get()
            if isinstance(item, APIError):
                raise item
            yield item
            finished += isinstance(item[1], FinishEvent)
    finally:
        for t in tasks:
            t.cancel()  # leaving early cancels the requests (events' own cleanup)


def stream_sync(job: CompletionJob, settings: Settings) -> Iterator[Event]:
    """`events` for a caller without an event loop (the Cog predictor): the same 429 and failure rules."""
    stream = job.model.engine.stream(job.prompt_ids, job.params, settings.request_timeout_s)
    try:
        try:
            first = next(stream)  # the request is submitted here
        except QueueFullError as e:
            raise busy(e) from None
        for event in itertools.chain([first], stream):
            if isinstance(event, FinishEvent) and (error := failure(event, settings)):
                raise error
            yield event
    finally:
        stream.close()  # leaving early cancels the request


def failure(finish: FinishEvent, settings: Settings) -> APIError | None:
    """The one rule for how a generation ended: length, EOS and stop sequences are successes."""
    if finish.reason == "timeout":
        return APIError(408, f"request exceeded its time limit of {settings.request_timeout_s} s", None, "timeout")
    if finish.reason in ("error", "cancelled"):
        return APIError(503, f"generation failed: {finish.message or finish.reason}", None, "generation")
    return None


def busy(e: QueueFullError) -> APIError:
    return APIError(429, f"server busy: {e}; retry later", None, "overloaded", {"Retry-After": RETRY_AFTER_S})
