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
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    TokenLogprob,
    TopLogprob,
)
from server.api.schemas.openai import Usage
from server.engine.events import FinishEvent, TokenEvent
from server.errors import APIError, openai_error_body
from server.features.chat import prepare_chat
from server.features.completion import collect_all, merged_events
from server.features.constraints import constrained

router = APIRouter(tags=["chat (OpenAI format)"])

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


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
    job = prepare_chat(registry, settings, body.model, messages, body)
    job = await run_in_threadpool(constrained, job, body.constraint(), settings)
    seed = job.params.seed
    jobs = [replace(job, params=replace(job.params, seed=None if seed is None else seed + j)) for j in range(body.n)]
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), job.model.id
    prompt_tokens = len(job.prompt_ids)

    if not body.stream:
        results = await collect_all(jobs, settings, request.is_disconnected)
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=finish.text),
                logprobs=logprobs_of(tokens) if body.logprobs else None,
                finish_reason=FINISH[finish.reason],
            )
            for i, (tokens, finish) in enumerate(results)
        ]
        completion_tokens = sum(finish.generated_tokens for _, finish in results)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)  # fmt: skip
        return ChatCompletion(id=cid, created=created, model=model, choices=choices, usage=usage)

    async def stream():
        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> dict:
            out = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage)
            return {"data": out.model_dump_json(exclude_none=True)}

        generated = 0
        try:
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(body.n)])
            async for i, e in merged_events(jobs, settings):
                if isinstance(e, TokenEvent) and (e.text or body.logprobs) and not e.special:
                    lp = logprobs_of([e]) if body.logprobs else None
                    yield chunk([ChunkChoice(index=i, delta=Delta(content=e.text), logprobs=lp)])
                elif isinstance(e, FinishEvent):
                    generated += e.generated_tokens
                    yield chunk(
                        [ChunkChoice(index=i, delta=Delta(content=e.tail or None), finish_reason=FINISH[e.reason])]
                    )
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                                      total_tokens=prompt_tokens + generated))  # fmt: skip
        except APIError as err:
            yield {"data": json.dumps(openai_error_body(err.message, err.error_type, err.field, err.status))}
        yield {"data": "[DONE]"}

    return sse_response(stream(), settings)
