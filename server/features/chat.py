"""Chat: a conversation rendered by the checkpoint's own chat template into a prompt, as transformers
renders it (its sandboxed Jinja, `add_generation_prompt`), and the tokens that end a reply.

The template comes from the checkpoint's tokenizer_config.json (`chat_template`) or a chat_template.jinja
beside it; a model without one is refused (no made-up template).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from models.sampling import SamplingParams
from server.config import Settings
from server.errors import APIError
from server.features.completion import CompletionJob, check_logit_bias, find_model, fit_prompt
from server.features.constraints import Constraint
from server.features.steering import SteerPart, steer_of
from server.features.tools import CallFormat, ToolUse, call_format, check_tools, tool_constraint
from server.serving.registry import ModelRegistry, ServedModel


@dataclass(frozen=True)
class ChatTurn:
    """A chat request ready to run: its job, and with tools the format its calls are read in and their grammar."""

    job: CompletionJob
    calls: CallFormat | None = None
    constraint: Constraint | None = None


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # Jinja
    special: dict[str, str]  # bos_token, eos_token, ... as the template reads them
    end_of_turn: tuple[str, ...]  # the tokens (as text) that end an assistant's turn
    eos_ids: tuple[int, ...]  # and generation_config.json's eos_token_id(s)


def token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=64)
def chat_template(folder: Path) -> ChatTemplate | None:
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source and (folder / "chat_template.jinja").exists():
        source = (folder / "chat_template.jinja").read_text()
    if not isinstance(source, str) or not source:
        return None
    special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (t := token_text(config.get(k)))}
    generation = folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    eos_ids = tuple(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return ChatTemplate(source, special, tuple(t for t in [special.get("eos_token")] if t), eos_ids)


def end_of_turn_ids(m: ServedModel, template: ChatTemplate) -> list[int]:
    """The ids that end a reply: the tokenizer's end-of-sequence token and generation_config's eos ids."""
    codec = m.runner.tokenizer
    ids = set()
    for text in template.end_of_turn:
        encoded = codec.encode(text)[len(codec.prefix) :]
        if len(encoded) == 1:
            ids.add(encoded[0])
    ids |= set(template.eos_ids)
    ids.discard(m.runner.facts.eos_id)  # already ends every request
    return sorted(i for i in ids if 0 <= i < m.runner.facts.vocab_size)


def conversation(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: content parts joined into text, an assistant's call arguments as
    objects (templates write them with tojson, as transformers documents); a tool message answers a call made
    before it."""
    called: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(part["text"] for part in m["content"])
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                try:
                    arguments = json.loads(call["function"]["arguments"])
                except ValueError:
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise APIError(422, f"{where}: not JSON", where) from None
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
                called.add(call["id"])
            m["tool_calls"] = calls
        if m["role"] == "tool" and m.get("tool_call_id") not in called:
            where, answered = f"messages[{i}].tool_call_id", m.get("tool_call_id")
            raise APIError(422, f"{where}: {answered!r} answers no call an assistant message made before it", where)
        out.append(m)
    return out


def render(template: ChatTemplate, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The conversation as the prompt of the assistant's next turn (transformers' own renderer)."""
    from transformers.utils.chat_template_utils import render_jinja_template  # a slow import: at the first chat

    try:
        rendered = render_jinja_template([conversation(messages)], tools=tools, chat_template=template.source,
                                         add_generation_prompt=True, **template.special)  # fmt: skip
    except Exception as e:  # a template's own raise_exception(), or one that cannot render these messages
        raise APIError(422, f"messages: the model's chat template refused them ({e})", "messages") from None
    rendered = rendered[0] if isinstance(rendered, tuple) else rendered  # (texts, generation indices)
    return rendered[0] if isinstance(rendered, list) else rendered  # one conversation


def prepare_chat(registry: ModelRegistry, settings: Settings, model_id: str, messages: list[dict], request) -> ChatTurn:
    """A chat request (its schema converts itself to sampling parameters, tools and a constraint) as a turn."""
    tools, params = request.tool_use(), request.to_sampling_params(settings)
    turn = prepare_chat_job(registry, settings, model_id, messages, params, tools, request.steer)
    return with_constraint(turn, request.constraint())


def with_constraint(turn: ChatTurn, c: Constraint | None) -> ChatTurn:
    """The turn held to a requested constraint too (structured output), which a tools' grammar leaves no room for."""
    if c is None:
        return turn
    if turn.constraint is not None:
        raise APIError(422, f"{c.field}: not with tools (unless tool_choice is none)", c.field)
    return replace(turn, constraint=c)


def template_of(m: ServedModel) -> ChatTemplate:
    template = chat_template(m.folder)
    if template is None:
        raise APIError(
            422, f"model: {m.id} has no chat template (tokenizer_config.json chat_template or chat_template.jinja)",
            "model",
        )  # fmt: skip
    return template


def prepare_chat_job(
    registry: ModelRegistry,
    settings: Settings,
    model_id: str | None,
    messages: list[dict],
    params: SamplingParams,
    tools: ToolUse | None = None,
    steer: list[SteerPart] | None = None,
) -> ChatTurn:
    """The rendered conversation as a completion job, checked as every prompt is; the reply ends at the
    model's end-of-turn tokens. With tools the template renders them (tool_choice none too, as OpenAI and vLLM
    do) and, unless tool_choice is none, the reply's calls are held to their schemas and read out of it."""
    m = find_model(registry, model_id, "causal", "model")
    template = template_of(m)
    params = replace(params, stop_token_ids=sorted({*params.stop_token_ids, *end_of_turn_ids(m, template)}))
    check_logit_bias(m, params.logit_bias, "logit_bias")
    params = replace(params, steer=steer_of(registry, m, steer, "steer"))
    calls = constraint = None
    if tools is not None:
        check_tools(tools)
    if tools is not None and tools.choice != "none":
        calls = call_format(template.source, m.id)
        constraint = tool_constraint(calls, tools.tools, tools.choice, tools.parallel, added_tokens(m))
    text = render(template, messages, tools.tools if tools is not None else None)
    if len(text) > settings.max_prompt_chars:
        limit = settings.max_prompt_chars
        raise APIError(422, f"messages: the conversation is {len(text)} characters; the limit is {limit}", "messages")
    codec = m.runner.tokenizer
    ids = codec.encode(text)[len(codec.prefix) :]  # the template writes its own start tokens
    return ChatTurn(CompletionJob(m, fit_prompt(m, ids, settings, None, "messages"), params), calls, constraint)


def added_tokens(m: ServedModel) -> set[str]:
    """The texts of the vocabulary's added tokens (a call marker among them is named as a token in a grammar)."""
    return {t.content for t in m.runner.tokenizer.tokenizer.get_added_tokens_decoder().values()}


def chats(m: ServedModel) -> bool:
    return m.kind == "causal" and chat_template(m.folder) is not None
