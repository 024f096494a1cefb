"""POST /v1/chat/completions in OpenAI's wire format (the `openai` client's chat.completions.create)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from models.sampling import SamplingParams
from server.api.schemas.base import MAX_TOKENS, RequestModel, Text
from server.api.schemas.openai import OpenAISampling, Usage
from server.api.schemas.structured import Constraint, ResponseFormat
from server.config import Settings
from server.errors import APIError
from server.features.tools import ToolUse

MAX_MESSAGES = 256
MAX_TOOLS = 128
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class ContentPart(RequestModel):
    """A part of a message's content: text (no vision model is served, so an image part is refused by name)."""

    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"type: {self.type!r} parts are not served (only text: no vision or audio model)")
        if self.text is None:
            raise ValueError("text: required in a text part")
        return self


class FunctionCall(RequestModel):
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: Text = Field(..., description="The arguments as JSON text.")


class ToolCallIn(RequestModel):
    """An assistant message's call, as the API returned it."""

    id: str = Field(..., max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(..., description="Who says it.")
    content: Text | list[ContentPart] | None = Field(None, description="What is said: text, or a list of text parts.")
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant's calls of tools.")
    tool_call_id: str | None = Field(None, max_length=128, description="A tool message: the call it answers.")

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only in an assistant message with tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: required in a tool message")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        return self


class FunctionDefinition(RequestModel):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=10_000)
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = Field(None, description="Accepted: every call is held to its schema anyway.")


class FunctionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(OpenAISampling):
    model: str = Field(..., description="A model whose tokenizer carries a chat template (GET /v1/models: chat).")
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Tokens to generate at most (deprecated name)."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Tokens to generate at most.")
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5, description="With logprobs: this many alternatives per token.")
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text, json_object, json_schema.")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or {type: function, function: {name}}."
    )
    parallel_tool_calls: bool = Field(True, description="Whether a reply may hold several calls.")
    # accepted and ignored: they do not change the answer (docs/API.md)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[Literal["text"]] | None = None

    @field_validator("tools")
    @classmethod
    def _some_tools(cls, v: list[FunctionTool] | None) -> list[FunctionTool] | None:
        return v or None  # an empty list is no tools

    def tool_use(self) -> ToolUse | None:
        if self.tools is None:
            if self.tool_choice not in (None, "none"):
                raise APIError(422, "tool_choice: given without tools", "tool_choice")
            return None
        choice = self.tool_choice or "auto"
        named = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        return ToolUse([t.model_dump(exclude_none=True) for t in self.tools], named, self.parallel_tool_calls)

    def constraint(self) -> Constraint | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        wanted = self.max_completion_tokens or self.max_tokens or settings.max_new_tokens_cap
        return self.sampling_params(settings, wanted, (self.top_logprobs or 0) if self.logprobs else None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null where the reply is only tool calls
    tool_calls: list[ToolCallOut] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    """A streamed call: sent whole once it parses (index, id, type and the name with the first chunk of a call)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
