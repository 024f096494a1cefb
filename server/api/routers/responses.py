"""POST /v1/responses (OpenAI's Responses API; `stream: true` gives its typed SSE events) and GET /v1/responses/{id}."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from server.api.dependencies import AppSettings, Registry, Responses
from server.api.routers.sse import sse_response
from server.api.schemas.responses import ResponsesRequest
from server.engine.events import FinishEvent, TokenEvent
from server.errors import APIError, openai_error_body
from server.features.chat import prepare_chat
from server.features.completion import collect_all, merged_events
from server.features.constraints import constrained
from server.features.responses import messages_of, new_id, output_items
from server.features.tools import CallStream, ToolCall

router = APIRouter(tags=["responses (OpenAI format)"])


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, kept: Responses) -> dict:
    """A stored response, as it was returned."""
    return kept.get(response_id, "response_id").response


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, registry: Registry, settings: AppSettings,
                          kept: Responses):  # fmt: skip
    """The model's next turn after `input` (and the stored conversation of `previous_response_id`), as output
    items: text as a message, tool calls as function_call items; with `stream`, OpenAI's events in order."""
    previous = body.previous_response_id
    history = kept.get(previous, "previous_response_id").conversation if previous is not None else []
    items = [*history, *body.items()]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    turn = prepare_chat(registry, settings, body.model, [*system, *messages_of(items)], body)
    job = await run_in_threadpool(constrained, turn.job, turn.constraint, settings)
    rid, created = new_id("resp"), int(time.time())
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]

    def response(status: str, output: list[dict], finish: FinishEvent | None = None) -> dict:
        usage = None
        if finish is not None:
            usage = {"input_tokens": len(job.prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": finish.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": len(job.prompt_ids) + finish.generated_tokens}  # fmt: skip
        incomplete = finish is not None and finish.reason == "length"
        choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        return {
            "id": rid, "object": "response", "created_at": created, "model": job.model.id,
            "status": "incomplete" if incomplete else status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": choice or "auto", "tools": tools,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and
                                body.text.format else {"type": "text"})},
            "store": body.store, "truncation": "disabled", "metadata": body.metadata or {}, "usage": usage,
        }  # fmt: skip

    def keep(done: dict) -> None:
        if body.store:
            kept.put(done, [*items, *done["output"]])

    if not body.stream:
        [(_, finish)] = await collect_all([job], settings, request.is_disconnected)
        content, calls = turn.calls.parse(finish.text) if turn.calls is not None else (finish.text, [])
        done = response("completed", output_items(content, calls), finish)
        keep(done)
        return done

    async def events() -> AsyncIterator[dict]:
        sequence = 0

        def event(kind: str, **fields) -> dict:
            nonlocal sequence
            sequence += 1
            return {"data": json.dumps({"type": kind, "sequence_number": sequence - 1, **fields})}

        output: list[dict] = []
        text_item: dict | None = None  # the message item text is being streamed into

        def close_text() -> list[dict]:
            nonlocal text_item
            if text_item is None:
                return []
            item, text_item = text_item, None
            i, part = output.index(item), item["content"][0]
            item["status"] = "completed"
            return [event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                          text=part["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part),
                    event("response.output_item.done", output_index=i, item=item)]  # fmt: skip

        def parts(pieces: list[str | ToolCall]) -> list[dict]:
            nonlocal text_item
            out = []
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    out += close_text()
                    item = output_items(None, [piece])[0]
                    output.append(item)
                    i, args = len(output) - 1, item["arguments"]
                    out += [event("response.output_item.added", output_index=i,
                                  item={**item, "arguments": "", "status": "in_progress"}),
                            event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                  delta=args),
                            event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=args),
                            event("response.output_item.done", output_index=i, item=item)]  # fmt: skip
                elif piece:
                    if text_item is None:
                        text_item = output_items(" ", [])[0]  # a message item, its text filled as it streams
                        text_item["content"][0]["text"], text_item["status"] = "", "in_progress"
                        output.append(text_item)
                        i = len(output) - 1
                        out += [event("response.output_item.added", output_index=i,
                                      item={**text_item, "content": []}),
                                event("response.content_part.added", item_id=text_item["id"], output_index=i,
                                      content_index=0, part={**text_item["content"][0]})]  # fmt: skip
                    text_item["content"][0]["text"] += piece
                    out.append(event("response.output_text.delta", item_id=text_item["id"],
                                     output_index=output.index(text_item), content_index=0, delta=piece,
                                     logprobs=[]))  # fmt: skip
            return out

        calls = CallStream(turn.calls) if turn.calls is not None else None
        try:
            yield event("response.created", response=response("in_progress", []))
            yield event("response.in_progress", response=response("in_progress", []))
            async for _, e in merged_events([job], settings):
                if isinstance(e, TokenEvent) and e.text and not e.special:
                    for out in parts(calls.feed(e.text) if calls is not None else [e.text]):
                        yield out
                elif isinstance(e, FinishEvent):
                    pieces = [*calls.feed(e.tail), *calls.close()] if calls is not None else [e.tail]
                    for out in [*parts(pieces), *close_text()]:
                        yield out
                    done = response("completed", output, e)
                    keep(done)
                    yield event(f"response.{done['status']}", response=done)
        except APIError as err:
            yield {"data": json.dumps(openai_error_body(err.message, err.error_type, err.field, err.status))}

    return sse_response(events(), settings)
