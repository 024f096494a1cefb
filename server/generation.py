"""Between the HTTP schemas and the engine: prompt policy, sampling parameters, async event streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from sse_starlette import EventSourceResponse

from server.config import Settings
from server.engine import Event, FinishEvent, QueueFullError
from server.errors import APIError
from server.registry import ServedModel
from training.sampling import SamplingParams

NEVER = -1e9  # JSON has no -inf: a bias at or below this means "never stop"
RETRY_AFTER_S = "1"


def encode_prompt(m: ServedModel, text: str, settings: Settings, truncate: int | None, field: str) -> list[int]:
    """Prompt token ids; over-long prompts are refused unless truncation is asked for (or configured)."""
    if len(text) > settings.max_prompt_chars:
        raise APIError(
            422,
            f"{field}: prompt has {len(text)} characters; the limit is {settings.max_prompt_chars} "
            "(refused, not truncated)",
            field,
        )
    ids = m.tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise APIError(422, f"{field}: prompt must not be empty", field)
    if truncate:
        ids = ids[-truncate:]
    limit = m.model.config.context_length - 1
    if len(ids) > limit:
        if not settings.truncate_prompt:
            raise APIError(
                422,
                f"{field}: prompt is {len(ids)} tokens; model {m.id} takes at most {limit} "
                "(refused; set parameters.truncate to keep the last tokens)",
                field,
            )
        ids = ids[-limit:]
    return ids


def sampling_params(
    p,
    settings: Settings,
    *,
    greedy: bool,
    temperature: float | None,
    max_new_tokens: int,
    top_logprobs: int,
    want_logprobs: bool,
) -> SamplingParams:
    """Shared by the TGI and OpenAI routes; `p` carries the common fields and the EOS controls."""
    eos_bias = settings.default_eos_bias if p.eos_bias is None else p.eos_bias
    return SamplingParams(
        max_new_tokens=min(max_new_tokens, settings.max_new_tokens_cap),
        min_new_tokens=p.min_new_tokens,
        temperature=0.0 if greedy else (1.0 if temperature is None else temperature),
        top_k=p.top_k if not greedy else None,
        top_p=p.top_p if not greedy else None,
        repetition_penalty=p.repetition_penalty or 1.0,
        stop=list(p.stop),
        seed=p.seed,
        logit_bias=dict(p.logit_bias),
        eos_bias=float("-inf") if eos_bias <= NEVER else eos_bias,
        eos_bias_decay=p.eos_bias_decay,
        eos_bias_start=p.eos_bias_start,
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
    )


def check_logit_bias(m: ServedModel, bias: dict[int, float], field: str) -> None:
    vocab = m.model.config.vocab_size
    bad = [t for t in bias if not 0 <= t < vocab]
    if bad:
        raise APIError(422, f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})", field)


async def events(
    m: ServedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    settings: Settings,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[Event]:
    """Run one request on the model's engine and yield its events.

    Leaving the iteration early (client gone, stream closed) cancels the request at the next decode
    step, so its batch slot is freed.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()
    try:
        req = m.engine.submit(
            prompt_ids, params, lambda e: loop.call_soon_threadsafe(queue.put_nowait, e), settings.request_timeout_s
        )
    except QueueFullError as e:
        raise APIError(
            429, f"server busy: {e}; retry later", None, "overloaded", {"Retry-After": RETRY_AFTER_S}
        ) from None
    try:
        while True:
            if queue.empty():  # wait_for costs a task per call: only pay it when there is nothing to read
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        return
                    continue
            else:
                event = queue.get_nowait()
            if isinstance(event, FinishEvent) and event.reason == "timeout":
                raise APIError(
                    408, f"request exceeded its time limit of {settings.request_timeout_s} s", None, "timeout"
                )
            if isinstance(event, FinishEvent) and event.reason in ("error", "cancelled"):
                raise APIError(503, f"generation failed: {event.message or event.reason}", None, "generation")
            yield event
            if isinstance(event, FinishEvent):
                return
    finally:
        req.cancel()


def sse_response(stream: AsyncIterator[dict], settings: Settings) -> EventSourceResponse:
    """Server-sent events that outlive a SIGTERM: sse-starlette ends every stream at once on shutdown
    unless given a grace period, and a drain must let in-flight generations finish."""
    return EventSourceResponse(stream, ping=15, shutdown_grace_period=settings.shutdown_grace_s)
