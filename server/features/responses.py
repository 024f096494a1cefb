"""OpenAI's Responses API over the chat path: a response's input items (messages, function calls and their
outputs) as chat messages for the model's template, its output as items, and the responses kept in memory so a
later request continues one by `previous_response_id` (bounded by count and bytes, oldest dropped first)."""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from server.errors import APIError
from server.features.tools import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def text_of(content: str | list[dict]) -> str:
    """A content given as text or as parts (input_text, output_text)."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def messages_of(items: list[dict]) -> list[dict]:
    """Input items as chat messages: consecutive function calls one assistant message with their tool_calls, each
    output a tool message answering its call_id."""
    messages: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": text_of(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text_of(item["output"])})
    return messages


def output_items(content: str | None, calls: list[ToolCall]) -> list[dict]:
    """The reply as output items: its text a message (output_text), each call a function_call."""
    items = []
    if content:
        part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
        items.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [part]})  # fmt: skip
    for c in calls:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": c.id, "name": c.name,
                      "arguments": c.arguments, "status": "completed"})  # fmt: skip
    return items


@dataclass
class Kept:
    response: dict  # as GET /v1/responses/{id} returns it
    conversation: list[dict]  # the input items before it and its output: what a follow-up continues
    size: int


class ResponseStore:
    """Stored responses by id, in memory, the oldest dropped past `count` of them or `mb` megabytes."""

    def __init__(self, count: int, mb: float) -> None:
        self.count, self.bytes = count, int(mb * 2**20)
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        with self.lock:
            self.kept[response["id"]] = Kept(response, conversation, size)
            self.size += size
            while self.kept and (len(self.kept) > self.count or self.size > self.bytes):
                _, dropped = self.kept.popitem(last=False)
                self.size -= dropped.size

    def get(self, response_id: str, field: str) -> Kept:
        with self.lock:
            kept = self.kept.get(response_id)
        if kept is None:
            raise APIError(404, f"{field}: no stored response {response_id!r} (kept in memory, bounded; "
                           "responses made with store: false are not kept)", field, "not_found")  # fmt: skip
        return kept
