"""POST /v1/responses in OpenAI's wire format (the `openai` client's responses.create and responses.stream)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from models.sampling import SamplingParams
from server.api.schemas.base import MAX_SEED, MAX_TOKENS, RequestModel, Text
from server.api.schemas.chat import FUNCTION_NAME, MAX_MESSAGES, MAX_TOOLS
from server.api.schemas.generation import EosControls
from server.api.schemas.steering import Steered
from server.config import Settings
from server.errors import APIError
from server.features.constraints import Constraint
from server.features.tools import ToolUse


class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None  # an output_text sent back: ignored
    logprobs: list[Any] | None = None


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str = Field(..., max_length=128)
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: Text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(..., max_length=128)
    output: Text | list[TextPart]
    id: str | None = None
    status: str | None = None


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


class FunctionToolParam(RequestModel):
    """A Responses function tool: flat, {type, name, description, parameters, strict}."""

    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=10_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


class ResponsesRequest(EosControls, Steered):
    model: str = Field(..., description="A model whose tokenizer carries a chat template.")
    input: Text | list[dict[str, Any]] = Field(..., description="Text, or items: messages, function calls, outputs.")
    instructions: Text | None = Field(None, description="A system message for this response (not carried over).")
    tools: list[FunctionToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Extension: same seed, same response.")
    stream: bool = False
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = Field(True, description="Keep the response in memory for previous_response_id.")
    # accepted and ignored: they do not change the answer (docs/API.md)
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[dict]) -> str | list[dict]:
        if isinstance(v, str):
            return v
        if not 1 <= len(v) <= MAX_MESSAGES:
            raise ValueError(f"give 1 to {MAX_MESSAGES} items")
        items = []
        for i, item in enumerate(v):
            kind = item.get("type", "message")
            if kind not in ITEMS:
                raise ValueError(f"input[{i}].type: {kind!r} is not served (one of {', '.join(ITEMS)})")
            try:
                items.append(ITEMS[kind].model_validate(item).model_dump(exclude_none=True, by_alias=True))
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"input[{i}].{where}: {first['msg']}") from None
        return items

    def items(self) -> list[dict]:
        """The input as items (text: one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def tool_use(self) -> ToolUse | None:
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise APIError(422, "tool_choice: given without tools", "tool_choice")
            return None
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                 for t in self.tools]  # fmt: skip
        choice = self.tool_choice or "auto"
        named = choice.name if isinstance(choice, NamedFunctionChoice) else choice
        return ToolUse(tools, named, self.parallel_tool_calls, nested=False)

    def constraint(self) -> Constraint | None:
        f = self.text.format if self.text is not None else None
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return Constraint("json", {"type": "object"}, "text.format")
        if f.schema_ is None:
            raise APIError(422, "text.format.schema: required when type is json_schema", "text.format.schema")
        return Constraint("json", f.schema_, "text.format.schema")

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        greedy = self.temperature == 0
        return SamplingParams(
            max_new_tokens=min(self.max_output_tokens or settings.max_new_tokens_cap, settings.max_new_tokens_cap),
            temperature=self.temperature,
            top_p=None if greedy or self.top_p >= 1 else self.top_p,
            seed=self.seed,
            **self.eos_params(settings),
        )
