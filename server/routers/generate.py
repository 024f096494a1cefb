"""POST /generate and POST /generate_stream in the text-generation-inference wire format."""

from __future__ import annotations

import json
from dataclasses import replace

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from server.config import Settings
from server.dependencies import AppSettings, Registry, find_model
from server.engine import FinishEvent, TokenEvent
from server.errors import APIError, error_body
from server.generation import check_logit_bias, encode_prompt, events, sampling_params, sse_response
from server.registry import ModelRegistry
from server.schemas.generation import (
    Details,
    GenerateRequest,
    GenerateResponse,
    StreamDetails,
    StreamResponse,
    Token,
)

router = APIRouter(tags=["completion (TGI format)"])


def prepare(body: GenerateRequest, registry: ModelRegistry, settings: Settings):
    p = body.parameters
    m = find_model(registry, p.model, "gpt", "parameters.model")
    check_logit_bias(m, p.logit_bias, "parameters.logit_bias")
    ids = encode_prompt(m, body.inputs, settings, p.truncate, "inputs")
    want_logprobs = p.details or p.top_n_tokens is not None
    params = sampling_params(
        p,
        settings,
        greedy=not p.do_sample,
        temperature=p.temperature,
        max_new_tokens=p.max_new_tokens,
        top_logprobs=p.top_n_tokens or 0,
        want_logprobs=want_logprobs,
    )
    return m, ids, params


def tgi_token(e: TokenEvent) -> Token:
    return Token(id=e.id, text=e.text, logprob=e.logprob, special=e.special)


def top_tokens(e: TokenEvent) -> list[Token]:
    return [Token(id=a.id, text=a.text, logprob=a.logprob, special=a.special) for a in e.top_logprobs]


@router.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)
async def generate(
    body: GenerateRequest, request: Request, registry: Registry, settings: AppSettings
) -> GenerateResponse:
    """Complete `inputs`; with `parameters.details`, also the finish reason and per-token logprobs."""
    m, ids, params = prepare(body, registry, settings)
    tokens: list[Token] = []
    tops: list[list[Token]] = []
    finish: FinishEvent | None = None
    async for e in events(m, ids, params, settings, request.is_disconnected):
        if isinstance(e, TokenEvent):
            tokens.append(tgi_token(e))
            tops.append(top_tokens(e))
        else:
            finish = e
    if finish is None:  # the client went away
        raise APIError(499, "client disconnected", None, "cancelled")
    text = (body.inputs if body.parameters.return_full_text else "") + finish.text
    details = None
    if body.parameters.details:
        details = Details(
            finish_reason=finish.reason,
            generated_tokens=finish.generated_tokens,
            seed=body.parameters.seed,
            tokens=tokens,
            top_tokens=tops if body.parameters.top_n_tokens else None,
        )
    return GenerateResponse(generated_text=text, details=details)


@router.post("/generate_stream", response_class=EventSourceResponse)
async def generate_stream(body: GenerateRequest, registry: Registry, settings: AppSettings) -> EventSourceResponse:
    """Server-sent events, one per token (`data: {"token": ...}`); the last carries generated_text and
    details. Errors after the stream started arrive as `data: {"error": ..., "error_type": ...}`."""
    m, ids, params = prepare(body, registry, settings)
    prefix = body.inputs if body.parameters.return_full_text else ""

    async def stream():
        last: TokenEvent | None = None  # the final token is sent together with the details, as TGI does
        try:
            async for e in events(m, ids, params, settings):
                if isinstance(e, TokenEvent) and not e.last:
                    yield {
                        "data": StreamResponse(token=tgi_token(e), top_tokens=top(e)).model_dump_json(exclude_none=True)
                    }
                elif isinstance(e, TokenEvent):
                    last = e
                else:
                    # the held-back tail (a stop sequence's near miss, a partial character) rides on the last token
                    final = last or TokenEvent(m.model.config.eos_token_id, "", special=True)
                    final = replace(final, text=final.text + e.tail)
                    details = StreamDetails(
                        finish_reason=e.reason, generated_tokens=e.generated_tokens, seed=body.parameters.seed
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
