"""POST /v1/completions (OpenAI format; `stream: true` gives SSE chunks and `data: [DONE]`), GET /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request

from server.dependencies import AppSettings, Registry
from server.engine import FinishEvent, TokenEvent
from server.errors import APIError, openai_error_body
from server.registry import ServedModel
from server.routers.sse import sse_response
from server.schemas.openai import Choice, Completion, CompletionRequest, Logprobs, Model, ModelList, Usage
from server.service import collect_all, find_model, merged_events, prepare_completion

router = APIRouter(tags=["completion (OpenAI format)"])

OPENAI_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def openai_model(m: ServedModel) -> Model:
    return Model(id=m.id, created=int((m.folder / "config.json").stat().st_mtime))


@router.get("/v1/models", response_model=ModelList)
async def list_models(registry: Registry) -> ModelList:
    """The completion models, as OpenAI's `models.list()` expects (GET /models lists every model)."""
    return ModelList(data=[openai_model(m) for m in registry.models.values() if m.kind == "gpt"])


@router.get("/v1/models/{model_id}", response_model=Model)
async def get_model(model_id: str, registry: Registry) -> Model:
    """One completion model, as OpenAI's `models.retrieve()` expects."""
    return openai_model(find_model(registry, model_id, "gpt", "model_id"))


@router.post("/v1/completions", response_model=Completion, response_model_exclude_none=True)
async def completions(body: CompletionRequest, request: Request, registry: Registry, settings: AppSettings):
    """Complete each prompt `n` times (choice index = prompt index × n + sample); with `logprobs`,
    per-token logprobs and alternatives; with `stream`, SSE chunks, each naming its choice."""
    params = body.to_sampling_params(settings)
    prompt_jobs = [prepare_completion(registry, settings, body.model, prompt, params) for prompt in body.prompt]
    jobs = [  # n samples of each prompt, encoded once
        replace(job, params=replace(params, seed=None if params.seed is None else params.seed + j))
        for job in prompt_jobs
        for j in range(body.n)
    ]
    m = jobs[0].model
    prefixes = [prompt if body.echo else "" for prompt in body.prompt for _ in range(body.n)]
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def logprobs_of(tokens: list[TokenEvent], offset: int) -> Logprobs | None:
        if body.logprobs is None:
            return None
        out = Logprobs(top_logprobs=[] if body.logprobs else None)
        for t in tokens:
            out.tokens.append(t.token_text)
            out.token_logprobs.append(t.logprob)
            out.text_offset.append(offset)
            offset += len(t.text)
            if body.logprobs:
                out.top_logprobs.append({a.text: a.logprob for a in t.top_logprobs})
        return out

    if not body.stream:
        results = await collect_all(jobs, settings, request.is_disconnected)
        choices = [
            Choice(
                index=i,
                text=prefixes[i] + finish.text,
                logprobs=logprobs_of(tokens, len(prefixes[i])),
                finish_reason=OPENAI_FINISH[finish.reason],
            )
            for i, (tokens, finish) in enumerate(results)
        ]
        prompt_tokens = sum(finish.prompt_tokens for _, finish in results[:: body.n])  # each prompt once
        completion_tokens = sum(finish.generated_tokens for _, finish in results)
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return Completion(id=cid, created=created, model=m.id, choices=choices, usage=usage)

    async def stream():
        def chunk(index: int, text: str, finish: str | None = None, lp: Logprobs | None = None) -> dict:
            choice = Choice(index=index, text=text, logprobs=lp, finish_reason=finish)
            return {"data": Completion(id=cid, created=created, model=m.id, choices=[choice]).model_dump_json(
                exclude_none=True
            )}  # fmt: skip

        offsets = [len(p) for p in prefixes]
        try:
            for i, prefix in enumerate(prefixes):
                if prefix:
                    yield chunk(i, prefix)
            async for i, e in merged_events(jobs, settings):
                if isinstance(e, TokenEvent):
                    yield chunk(i, e.text, lp=logprobs_of([e], offsets[i]))
                    offsets[i] += len(e.text)
                elif isinstance(e, FinishEvent):
                    yield chunk(i, e.tail, OPENAI_FINISH[e.reason])
        except APIError as err:
            yield {"data": json.dumps(openai_error_body(err.message, err.error_type, err.field, err.status))}
        yield {"data": "[DONE]"}

    return sse_response(stream(), settings)
