"""POST /generate and POST /generate_stream in the text-generation-inference wire format."""

from __future__ import annotations

import json
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse

from server.api.dependencies import AppSettings, Registry
from server.api.routers.sse import sse_response
from server.api.schemas.generation import (
    Details,
    GenerateRequest,
    GenerateResponse,
    StreamDetails,
    StreamResponse,
    Token,
)
from server.config import Settings
from server.engine.events import TokenEvent
from server.errors import APIError, error_body
from server.features.completion import CompletionJob, Fields, collect, events, prepare_completion
from server.features.constraints import constrained
from server.serving.registry import ModelRegistry

router = APIRouter(tags=["completion (TGI format)"])


async def prepare(body: GenerateRequest, registry: ModelRegistry, settings: Settings) -> CompletionJob:
    p = body.parameters
    fields = Fields(
        model="parameters.model", prompt="inputs", logit_bias="parameters.logit_bias", steer="parameters.steer"
    )
    params = p.to_sampling_params(settings)
    job = prepare_completion(registry, settings, p.model, body.inputs, params, p.truncate, fields, steer=p.steer)
    grammar = p.grammar.constraint("parameters.grammar") if p.grammar else None
    return await run_in_threadpool(constrained, job, grammar, settings)


def tgi_token(e: TokenEvent) -> Token:
    return Token(id=e.id, text=e.text, logprob=e.logprob, special=e.special)


def top_tokens(e: TokenEvent) -> list[Token]:
    return [Token(id=a.id, text=a.text, logprob=a.logprob, special=a.special) for a in e.top_logprobs]


@router.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)
async def generate(
    body: GenerateRequest, request: Request, registry: Registry, settings: AppSettings
) -> GenerateResponse:
    """Complete `inputs`; with `parameters.details`, also the finish reason and per-token logprobs."""
    job = await prepare(body, registry, settings)
    events, finish = await collect(job, settings, request.is_disconnected)
    tokens = [tgi_token(e) for e in events]
    tops = [top_tokens(e) for e in events]
    text = (body.inputs if body.parameters.return_full_text else "") + finish.text
    details = None
    if body.parameters.details:
        details = Details(
            finish_reason=finish.reason,
            generated_tokens=finish.generated_tokens,
            seed=job.params.seed,
            tokens=tokens,
            top_tokens=tops if body.parameters.top_n_tokens else None,
        )
    return GenerateResponse(generated_text=text, details=details)


@router.post("/generate_stream", response_class=EventSourceResponse)
async def generate_stream(body: GenerateRequest, registry: Registry, settings: AppSettings) -> EventSourceResponse:
    """Server-sent events, one per token (`data: {"token": ...}`); the last carries generated_text and
    details. Errors after the stream started arrive as `data: {"error": ..., "error_type": ...}`."""
    job = await prepare(body, registry, settings)
    prefix = body.inputs if body.parameters.return_full_text else ""

    async def stream():
        last: TokenEvent | None = None  # the final token is sent together with the details, as TGI does
        try:
            async for e in events(job, settings):
                if isinstance(e, TokenEvent) and not e.last:
                    yield {
                        "data": StreamResponse(token=tgi_token(e), top_tokens=top(e)).model_dump_json(exclude_none=True)
                    }
                elif isinstance(e, TokenEvent):
                    last = e
                else:
                    # the held-back tail (a stop sequence's near miss, a partial character) rides on the last token
                    final = last or TokenEvent(job.model.runner.facts.eos_id, "", special=True)
                    final = replace(final, text=final.text + e.tail)
                    details = StreamDetails(
                        finish_reason=e.reason, generated_tokens=e.generated_tokens, seed=job.params.seed
                    )
                    response = StreamResponse(
                        token=tgi_token(final),
                        top_tokens=top(final),
                        generated_text=prefix + e.text,
                        details=details,
                    )
                    yield {"data": response.model_dump_json(exclude_none=True)}
        except APIError as err:
            yield {"data": json.dumps(error_body(err.message, err.error_type, err.field))}

    def top(e: TokenEvent) -> list[Token] | None:
        return top_tokens(e) if body.parameters.top_n_tokens else None

    return sse_response(stream(), settings)


@router.post("/", response_model=list[GenerateResponse], response_model_exclude_none=True)
async def compat(body: GenerateRequest, request: Request, registry: Registry, settings: AppSettings):
    """TGI's compatibility route, used by huggingface_hub's InferenceClient: `stream` picks SSE or a list."""
    if body.stream:
        return await generate_stream(body, registry, settings)
    return [await generate(body, request, registry, settings)]
