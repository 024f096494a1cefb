"""POST /v1/completions (OpenAI format; `stream: true` gives SSE chunks and `data: [DONE]`), GET /v1/models."""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request

from server.dependencies import AppSettings, Registry
from server.engine import FinishEvent, TokenEvent
from server.errors import APIError, error_body
from server.registry import ServedModel
from server.routers.sse import sse_response
from server.schemas.openai import Choice, Completion, CompletionRequest, Logprobs, Model, ModelList, Usage
from server.service import collect, events, find_model, prepare_completion

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
    """Complete `prompt`; with `logprobs`, per-token logprobs and alternatives; with `stream`, SSE."""
    job = prepare_completion(registry, settings, body.model, body.prompt, body.to_sampling_params(settings))
    m = job.model
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    prefix = body.prompt if body.echo else ""

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
        tokens, finish = await collect(job, settings, request.is_disconnected)
        choice = Choice(
            text=prefix + finish.text,
            logprobs=logprobs_of(tokens, len(prefix)),
            finish_reason=OPENAI_FINISH[finish.reason],
        )
        usage = Usage(
            prompt_tokens=finish.prompt_tokens,
            completion_tokens=finish.generated_tokens,
            total_tokens=finish.prompt_tokens + finish.generated_tokens,
        )
        return Completion(id=cid, created=created, model=m.id, choices=[choice], usage=usage)

    async def stream():
        def chunk(text: str, finish: str | None = None, lp: Logprobs | None = None) -> dict:
            c = Completion(
                id=cid, created=created, model=m.id, choices=[Choice(text=text, logprobs=lp, finish_reason=finish)]
            )
            return {"data": c.model_dump_json(exclude_none=True)}

        offset = len(prefix)
        try:
            if prefix:
                yield chunk(prefix)
            async for e in events(job, settings):
                if isinstance(e, TokenEvent):
                    yield chunk(e.text, lp=logprobs_of([e], offset))
                    offset += len(e.text)
                elif isinstance(e, FinishEvent):
                    yield chunk(e.tail, OPENAI_FINISH[e.reason])
        except APIError as err:
            yield {"data": json.dumps({"error": error_body(err.message, err.error_type, err.field)})}
        yield {"data": "[DONE]"}

    return sse_response(stream(), settings)
