"""POST /v1/chat/completions (OpenAI's format; `stream: true` gives SSE chunks and `data: [DONE]`)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from server.api.dependencies import AppSettings, Registry
from server.api.routers.sse import sse_response
from server.api.schemas.chat import (
    AssistantMessage,
    CalledFunction,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from server.api.schemas.openai import Usage
from server.engine.events import FinishEvent, TokenEvent
from server.errors import APIError, openai_error_body
from server.features.chat import prepare_chat
from server.features.completion import collect_all, merged_events
from server.features.constraints import constrained
from server.features.tools import CallFormat, CallStream, ToolCall

router = APIRouter(tags=["chat (OpenAI format)"])

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def reply(text: str, calls: CallFormat | None) -> tuple[AssistantMessage, bool]:
    """The assistant's message, its tool calls read out of the text where tools were offered; whether it calls."""
    content, found = calls.parse(text) if calls is not None else (text, [])
    tool_calls = [ToolCallOut(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments)) for c in found]
    return AssistantMessage(content=content, tool_calls=tool_calls or None), bool(found)


def logprobs_of(tokens: list[TokenEvent]) -> ChoiceLogprobs:
    def top(text: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                **top(t.token_text, t.logprob).model_dump(),
                top_logprobs=[top(a.text, a.logprob) for a in t.top_logprobs],
            )
            for t in tokens
            if not t.special
        ]
    )


@router.post("/v1/chat/completions", response_model=ChatCompletion, response_model_exclude_none=True)
async def chat_completions(body: ChatCompletionRequest, request: Request, registry: Registry, settings: AppSettings):
    """The assistant's next turn of `messages`, rendered by the model's chat template; `n` replies (seed s
    gives s, s+1, ...); with `logprobs`, each token's logprob and `top_logprobs` alternatives; with
    `stream`, SSE chunks (`stream_options.include_usage`: a last chunk with the usage)."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    turn = prepare_chat(registry, settings, body.model, messages, body)
    job = await run_in_threadpool(constrained, turn.job, turn.constraint, settings)
    seed = job.params.seed
    jobs = [replace(job, params=replace(job.params, seed=None if seed is None else seed + j)) for j in range(body.n)]
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), job.model.id
    prompt_tokens = len(job.prompt_ids)

    if not body.stream:
        results = await collect_all(jobs, settings, request.is_disconnected)
        choices = []
        for i, (tokens, finish) in enumerate(results):
            message, calls = reply(finish.text, turn.calls)
            reason = "tool_calls" if calls else FINISH[finish.reason]
            lp = logprobs_of(tokens) if body.logprobs else None
            choices.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=reason))
        completion_tokens = sum(finish.generated_tokens for _, finish in results)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)  # fmt: skip
        return ChatCompletion(id=cid, created=created, model=model, choices=choices, usage=usage)

    async def stream():
        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> dict:
            out = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage)
            return {"data": out.model_dump_json(exclude_none=True)}

        generated = 0
        streams = [CallStream(turn.calls) if turn.calls is not None else None for _ in range(body.n)]
        called = [0] * body.n  # calls sent so far, per choice

        def deltas(i: int, parts: list[str | ToolCall]) -> list[ChunkChoice]:
            out = []
            for part in parts:
                if isinstance(part, ToolCall):
                    function = CalledFunction(name=part.name, arguments=part.arguments)
                    delta = Delta(tool_calls=[ToolCallDelta(index=called[i], id=part.id, function=function)])
                    called[i] += 1
                    out.append(ChunkChoice(index=i, delta=delta))
                elif part:
                    out.append(ChunkChoice(index=i, delta=Delta(content=part)))
            return out

        try:
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(body.n)])
            async for i, e in merged_events(jobs, settings):
                if isinstance(e, TokenEvent) and (e.text or body.logprobs) and not e.special:
                    lp = logprobs_of([e]) if body.logprobs else None
                    parts = deltas(i, streams[i].feed(e.text)) if streams[i] is not None else []
                    if streams[i] is None or (lp is not None and not parts):  # a token's logprobs come with it
                        parts = [ChunkChoice(index=i, delta=Delta(content=e.text if streams[i] is None else None))]
                    if parts:
                        parts[0].logprobs = lp
                    for c in parts:
                        yield chunk([c])
                elif isinstance(e, FinishEvent):
                    generated += e.generated_tokens
                    tail = e.tail
                    if streams[i] is not None:
                        for c in deltas(i, [*streams[i].feed(tail), *streams[i].close()]):
                            yield chunk([c])
                        tail = ""
                    reason = "tool_calls" if called[i] else FINISH[e.reason]
                    yield chunk([ChunkChoice(index=i, delta=Delta(content=tail or None), finish_reason=reason)])
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                                      total_tokens=prompt_tokens + generated))  # fmt: skip
        except APIError as err:
            yield {"data": json.dumps(openai_error_body(err.message, err.error_type, err.field, err.status))}
        yield {"data": "[DONE]"}

    return sse_response(stream(), settings)
