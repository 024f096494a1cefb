"""Tool calling: the call format a checkpoint's chat template teaches its model, the grammar that makes every call
parse (llguidance, compiled as any constraint: server/features/constraints.py), and the calls read back out of
the reply, whole or as it streams.

Two formats, chosen from the template's text: Hermes / Qwen (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, one block a call) and Llama 3.x's JSON (`{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, calls separated by "; "). With `tool_choice` "required" or a named function the reply is calls
only; with "auto" the model writes text freely until it opens a call (Hermes: its marker; Llama: a reply that
starts with "{"), and the call is then held to the tools' schemas: a lazy lexeme, as llguidance's StructTag.
A marker that is one added token of the vocabulary is named as that token in the grammar (llguidance reads added
tokens as special ones), otherwise as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from server.errors import APIError
from server.features.constraints import Constraint

Choice = Literal["none", "auto", "required"] | str  # or the one function's name


@dataclass(frozen=True)
class ToolUse:
    """A request's tools (OpenAI's chat format: {type: function, function: {name, description, parameters}})."""

    tools: list[dict]
    choice: Choice
    parallel: bool
    nested: bool = True  # each tool's fields under "function" (chat completions), or flat (the Responses API)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's wire format carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class CallFormat:
    name: Literal["hermes", "llama3_json"]
    open: str  # the text that opens a call ("" where a call is a bare JSON object)
    close: str
    separator: str  # between two calls
    arguments_key: str  # "arguments" or "parameters"

    def call_schema(self, tools: list[dict]) -> dict:
        """The JSON of one call to any of `tools` (OpenAI function tools)."""
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    self.arguments_key: t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": {"whitespace_flexible": False}}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's text (None where only calls) and its calls; text that does not parse as a call stays text."""
        if self.name == "hermes":
            calls, kept = [], []
            pattern = re.escape(self.open) + r"\s*(.*?)\s*(?:" + re.escape(self.close) + r"|$)"
            last = 0
            for match in re.finditer(pattern, text, re.DOTALL):
                call = self.call_of(match.group(1))
                if call is None:
                    continue
                kept.append(text[last : match.start()])
                calls.append(call)
                last = match.end()
            kept.append(text[last:])
            content = "".join(kept).strip()
            return (content or None) if calls else text, calls
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = self.call_of(json.dumps(value))
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return None, calls

    def call_of(self, text: str) -> ToolCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        arguments = value.get(self.arguments_key, value.get("arguments")) if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments))


HERMES = CallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
PYTHON_TAG = "<|python_tag|>"  # what Llama 3.x may write before its JSON call
LLAMA3_JSON = CallFormat("llama3_json", "", "", "; ", "parameters")


def call_format(template_source: str, model_id: str) -> CallFormat:
    """The format the template renders tool calls in, or a 422 naming the model whose template has none."""
    if "<tool_call>" in template_source:
        return HERMES
    if "tools" in template_source and (PYTHON_TAG in template_source or '"parameters"' in template_source):
        return LLAMA3_JSON
    raise APIError(422, f"tools: the chat template of model {model_id} does not render tools (no call format: Hermes "
                   "<tool_call> blocks or Llama 3's JSON)", "tools")  # fmt: skip


def literal(text: str, single_tokens: set[str]) -> str:
    """A grammar's literal: a marker that is one added token as that token, the rest as quoted text."""
    parts = re.split(r"(<[^<>\s]+>)", text)
    out = [p if p in single_tokens else json.dumps(p) for p in parts if p]
    return " ".join(out) if out else '""'


def tool_grammar(fmt: CallFormat, tools: list[dict], choice: Choice, parallel: bool, single_tokens: set[str]) -> str:
    """The Lark grammar (llguidance's) of a reply under `choice`: calls only ("required", a name), or free text
    that, once it opens a call, completes it under the schemas ("auto")."""
    chosen = [t for t in tools if choice not in ("auto", "required") and t["function"]["name"] == choice] or tools
    marker = fmt.open.strip()  # "<tool_call>", or "" for a bare JSON call
    schema = json.dumps(fmt.call_schema(chosen))
    opener = literal(marker, single_tokens) if marker else ""
    body = f"{literal(fmt.open[len(marker) :], single_tokens)} %json {schema} {literal(fmt.close, single_tokens)}"
    more = f"({literal(fmt.separator, single_tokens)} call)*" if parallel else ""
    rules = ["%llguidance {}", f"body: {body}", f"call: {opener} body"]  # a call: its marker (if any), then its body
    if choice != "auto":
        return "\n".join([*rules, f"start: call {more}"])
    if not marker:  # a reply that starts with "{" (or Llama's <|python_tag|> token) is calls, any other is text
        tag = f"{PYTHON_TAG}?" if PYTHON_TAG in single_tokens else ""
        return "\n".join([*rules, f"start: TEXT | {tag} call {more}", "TEXT: /([^{](.|\\n)*)?/"])
    if marker in single_tokens:  # text cannot hold the token: the token opens the call
        return "\n".join([*rules, f"start: TEXT | TEXT {opener} body {more}", "TEXT: /(.|\\n)*/"])
    # the marker as text ends the text lazily (at its first appearance) and opens the call
    return "\n".join([*rules, f"start: TEXT | head body {more}", f"head[lazy]: TEXT {opener}", "TEXT: /(.|\\n)*/"])


def tool_constraint(fmt: CallFormat, tools: list[dict], choice: Choice, parallel: bool, single_tokens: set[str]
                    ) -> Constraint | None:  # fmt: skip
    """The constraint of a reply with tools (None: tool_choice "none")."""
    if choice == "none":
        return None
    return Constraint("lark", tool_grammar(fmt, tools, choice, parallel, single_tokens), "tools")


def check_tools(use: ToolUse) -> None:
    """Each tool's parameters a JSON schema llguidance compiles, names distinct, a named choice one of them; a
    failure names the field as the request gave it."""
    from llguidance import LLMatcher

    tools, choice, inner = use.tools, use.choice, "function." if use.nested else ""
    names = [t["function"]["name"] for t in tools]
    for i, t in enumerate(tools):
        if names.index(t["function"]["name"]) != i:
            raise APIError(422, f"tools[{i}].{inner}name: {names[i]!r} is given twice", f"tools[{i}].{inner}name")
        schema = t["function"].get("parameters") or {"type": "object"}
        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            field_name = f"tools[{i}].{inner}parameters"
            raise APIError(422, f"{field_name}: not a JSON schema that compiles ({error.strip()})", field_name)
    if choice not in ("none", "auto", "required") and choice not in names:
        raise APIError(422, f"tool_choice: names {choice!r}, which is none of the tools ({', '.join(names)})",
                       "tool_choice")  # fmt: skip


class CallStream:
    """A streamed reply split into text to send at once and calls, each sent whole once it parses: text that may
    open a call is held back until it does or cannot; a Llama reply that starts as a call is held to its end."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt, self.held, self.calls_only = fmt, "", None  # calls_only: a bare-JSON reply, once decided
        self.called = False  # a call was sent: the blank text between and after calls is not sent (as parse drops it)

    def feed(self, text: str) -> list[str | ToolCall]:
        self.held += text
        if self.fmt.open:
            return self.blocks()
        if self.calls_only is None:
            start = self.held.lstrip()
            if not start or (len(start) < len(PYTHON_TAG) and PYTHON_TAG.startswith(start)):
                return []  # undecided
            self.calls_only = start.startswith(("{", PYTHON_TAG))
        if self.calls_only:
            return []
        sent, self.held = self.held, ""
        return [sent]

    def blocks(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        marker, closer = self.fmt.open.strip(), self.fmt.close.strip()
        while True:
            at = self.held.find(marker)
            if at < 0:  # all but a tail that may begin the marker
                keep = next((k for k in range(min(len(marker) - 1, len(self.held)), 0, -1)
                             if marker.startswith(self.held[-k:])), 0)  # fmt: skip
                sent = self.held[: len(self.held) - keep]
                if self.called and sent.isspace():  # blank after a call: held, it may only come before another
                    return out
                self.held = self.held[len(self.held) - keep :]
                return out + ([sent] if sent else [])
            if at:
                if not (self.called and self.held[:at].isspace()):
                    out.append(self.held[:at])
                self.held = self.held[at:]
            end = self.held.find(closer, len(marker))
            if end < 0:
                return out
            block, self.held = self.held[: end + len(closer)], self.held[end + len(closer) :]
            calls = self.fmt.parse(block)[1]
            self.called |= bool(calls)
            out.extend(calls or [block])

    def close(self) -> list[str | ToolCall]:
        """What is held at the end: calls where it parses, else text."""
        held, self.held = self.held, ""
        content, calls = self.fmt.parse(held) if held else (None, [])
        if self.called and content is not None and content.isspace():
            content = None
        return [*([content] if content else []), *calls]
