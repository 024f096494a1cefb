"""POST /v1/completions (OpenAI format; `stream: true` gives SSE chunks and `data: [DONE]`), GET /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import NamedTuple

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from server.api.dependencies import AppSettings, Registry
from server.api.routers.sse import sse_response
from server.api.schemas.openai import (
    Choice,
    Completion,
    CompletionRequest,
    Logprobs,
    OpenAIModel,
    OpenAIModelList,
    Usage,
)
from server.engine.events import FinishEvent, TokenEvent
from server.errors import APIError, openai_error_body
from server.execution.compute_thread import ComputeThread
from server.execution.runner import token_logprobs
from server.features.chat import chats
from server.features.completion import CompletionJob, Fields, collect_all, find_model, merged_events, prepare_completion
from server.features.constraints import constrained
from server.serving.registry import ServedModel

router = APIRouter(tags=["completion (OpenAI format)"])

OPENAI_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def openai_model(m: ServedModel) -> OpenAIModel:
    return OpenAIModel(id=m.id, created=int((m.folder / "config.json").stat().st_mtime), chat=chats(m))


@router.get("/v1/models", response_model=OpenAIModelList)
async def list_models(registry: Registry) -> OpenAIModelList:
    """The completion models, as OpenAI's `models.list()` expects (GET /models lists every model)."""
    return OpenAIModelList(data=[openai_model(m) for m in registry.models.values() if m.kind == "causal"])


@router.get("/v1/models/{model_id}", response_model=OpenAIModel)
async def get_model(model_id: str, registry: Registry) -> OpenAIModel:
    """One completion model, as OpenAI's `models.retrieve()` expects."""
    return openai_model(find_model(registry, model_id, "causal", "model_id"))


@router.post("/v1/completions", response_model=Completion, response_model_exclude_none=True)
async def completions(body: CompletionRequest, request: Request, registry: Registry, settings: AppSettings):
    """Complete each prompt `n` times (choice index = prompt index × n + sample); with `logprobs`,
    per-token logprobs and alternatives (with `echo`, the prompt's too); with `stream`, SSE chunks, each
    naming its choice. `max_tokens: 0` with `echo` scores the prompts without generating."""
    if body.max_tokens == 0 and not body.echo:
        raise APIError(422, "max_tokens: 0 generates nothing; it scores the prompt only with echo: true", "max_tokens")
    params = body.to_sampling_params(settings)
    many = len(body.prompt) > 1
    prompt_jobs = [
        prepare_completion(
            registry,
            settings,
            body.model,
            prompt,
            params,
            fields=Fields(prompt=f"prompt[{i}]" if many else "prompt"),
            echo=body.echo,
            steer=body.steer,
        )
        for i, prompt in enumerate(body.prompt)
    ]
    if body.structured_outputs is not None:  # compiled once; each row copies the matcher
        first = await run_in_threadpool(constrained, prompt_jobs[0], body.structured_outputs.constraint(), settings)
        constraint = first.params
        prompt_jobs = [
            replace(job, params=replace(job.params, constraint=constraint.constraint)) for job in prompt_jobs
        ]
    jobs = [  # n samples of each prompt, encoded once
        replace(job, params=replace(job.params, seed=None if params.seed is None else params.seed + j))
        for job in prompt_jobs
        for j in range(body.n)
    ]
    m = jobs[0].model
    echoed = [await echo_of(job, body.logprobs, registry.compute) if body.echo else Echo("") for job in prompt_jobs]
    prefixes = [e for e in echoed for _ in range(body.n)]
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def logprobs_of(tokens: list[TokenEvent], offset: int, prefix: Echo) -> Logprobs | None:
        if body.logprobs is None:
            return None
        out = prefix.logprobs.model_copy(deep=True) if prefix.logprobs else Logprobs()
        if body.logprobs and out.top_logprobs is None:
            out.top_logprobs = []
        for t in tokens:
            out.tokens.append(t.token_text)
            out.token_logprobs.append(t.logprob)
            out.text_offset.append(offset)
            offset += len(t.text)
            if body.logprobs:
                out.top_logprobs.append(top_dict((a.text, a.logprob) for a in t.top_logprobs))
        return out

    if not body.stream:
        if body.max_tokens == 0:
            results = [([], FinishEvent("length", "", 0, len(job.prompt_ids))) for job in jobs]
        else:
            results = await collect_all(jobs, settings, request.is_disconnected)
        choices = [
            Choice(
                index=i,
                text=prefixes[i].text + finish.text,
                logprobs=logprobs_of(tokens, len(prefixes[i].text), prefixes[i]),
                finish_reason=OPENAI_FINISH[finish.reason],
            )
            for i, (tokens, finish) in enumerate(results)
        ]
        prompt_tokens = sum(len(job.echo_ids or job.prompt_ids) for job in prompt_jobs)  # each prompt once
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

        offsets = [len(p.text) for p in prefixes]
        try:
            for i, prefix in enumerate(prefixes):
                if prefix.text:
                    last = body.max_tokens == 0
                    yield chunk(i, prefix.text, "length" if last else None, prefix.logprobs)
            if body.max_tokens == 0:
                yield {"data": "[DONE]"}
                return
            async for i, e in merged_events(jobs, settings):
                if isinstance(e, TokenEvent):
                    yield chunk(i, e.text, lp=logprobs_of([e], offsets[i], Echo("")))
                    offsets[i] += len(e.text)
                elif isinstance(e, FinishEvent):
                    yield chunk(i, e.tail, OPENAI_FINISH[e.reason])
        except APIError as err:
            yield {"data": json.dumps(openai_error_body(err.message, err.error_type, err.field, err.status))}
        yield {"data": "[DONE]"}

    return sse_response(stream(), settings)


def top_dict(alternatives: Iterable[tuple[str, float]]) -> dict[str, float]:
    """OpenAI's {text: logprob}, most likely first; tokens whose texts collide (partial UTF-8 bytes all
    decode to U+FFFD) keep the likelier one."""
    out: dict[str, float] = {}
    for text, logprob in alternatives:
        out.setdefault(text, logprob)
    return out


class Echo(NamedTuple):
    """An echoed prompt: its text and, when logprobs were asked for, its tokens' logprobs."""

    text: str
    logprobs: Logprobs | None = None


async def echo_of(job: CompletionJob, alternatives: int | None, compute: ComputeThread) -> Echo:
    """The prompt as text (decoded from its ids, so token-id prompts echo too) and, with `logprobs`, each
    prompt token's logprob (the first is null: nothing predicts it), offset and top alternatives. A
    prompt longer than the model's context is scored with sliding windows (runners.token_logprobs)."""
    m, ids = job.model, job.echo_ids or job.prompt_ids
    text = m.tokenizer.decode(ids)
    if alternatives is None:
        return Echo(text)
    steer = job.params.steer.vectors if job.params.steer is not None else None  # the prompt as the request reads it
    scored = await compute.run(token_logprobs, m.runner, ids, alternatives, steer)
    decode = m.tokenizer.decode
    top = [top_dict((decode([a]), v) for a, v in alts) for alts in scored.top]
    logprobs = Logprobs(
        tokens=[decode([t]) for t in ids],
        token_logprobs=[None, *scored.logprobs],
        text_offset=[len(decode(ids[:i])) for i in range(len(ids))],
        top_logprobs=[None, *top] if alternatives else None,
    )
    return Echo(text, logprobs)
