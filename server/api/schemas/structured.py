"""Structured output as each ecosystem asks for it: TGI's `grammar`, OpenAI's `response_format`, vLLM's
`structured_outputs`; each becomes one `Constraint` (compiled by server/features/constraints.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from server.api.schemas.base import RequestModel, Text
from server.features.constraints import Constraint

MAX_CHOICES = 256


class TGIGrammar(RequestModel):
    """TGI's `parameters.grammar`."""

    type: Literal["json", "regex"]
    value: dict[str, Any] | Text = Field(..., description="json: a JSON schema (object or text); regex: a regex.")

    def constraint(self, field: str) -> Constraint:
        return Constraint(self.type, self.value, f"{field}.value")


class JsonSchemaFormat(RequestModel):
    name: str = Field("response", max_length=64)
    schema_: dict[str, Any] = Field(..., alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json", {"type": "object"}, "response_format")
        if self.type == "json_schema":
            return Constraint("json", self.json_schema.schema_, "response_format.json_schema.schema")
        return None


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: Text | None = Field(None, description="A Lark grammar.")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self

    def constraint(self) -> Constraint:
        for key, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "lark")):
            if (value := getattr(self, key)) is not None:
                return Constraint(kind, value, f"structured_outputs.{kind if kind != 'lark' else 'grammar'}")
        raise AssertionError("validated: one is given")
