"""Structured output: a request's JSON schema, regex, choice list or Lark grammar compiled by llguidance
into a matcher the sampler masks each step with (models/sampling.py), and that ends the request when
the grammar is complete.

Each ecosystem's way of asking comes in as a `Constraint` (TGI's `grammar`, OpenAI's `response_format`,
vLLM's `structured_outputs`). Compiling runs on two grammar threads, never on the compute thread or the
event loop; a request whose grammar is not compiled within the time limit is refused (its compile still
finishes on its thread). JSON is generated without free whitespace (compact separators, as OpenAI and
vLLM return it).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
from dataclasses import dataclass, replace
from typing import Literal

from server.config import Settings
from server.errors import APIError
from server.features.completion import CompletionJob
from server.serving.registry import ServedModel


@dataclass(frozen=True)
class Constraint:
    """A request's structured output, whichever ecosystem's field gave it (server/api/schemas/structured.py)."""

    kind: Literal["json", "regex", "choice", "lark"]
    value: object  # a schema (dict or JSON text), a regex, a list of strings, a Lark grammar
    field: str  # where the request gave it: a failure names it


JSON_OPTIONS = {"whitespace_flexible": False}  # compact: "," and ":" with no spaces, no newlines
# grammars compile here, not on the event loop's default executor (where a slow one would queue unrelated work)
COMPILERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")


def grammar_of(c: Constraint) -> str:
    """llguidance's grammar text for the constraint."""
    from llguidance import LLMatcher

    if c.kind == "json":
        schema = json.loads(c.value) if isinstance(c.value, str) else c.value
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.value)
    if c.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.value))
    return LLMatcher.grammar_from_lark(c.value)


def tokenizer_of(m: ServedModel):
    """The model's vocabulary as llguidance reads it (from its tokenizer.json; slow for a large one)."""
    return llguidance_tokenizer(m.runner.tokenizer, m.runner.facts.vocab_size, m.runner.facts.eos_id)


@functools.lru_cache(maxsize=16)
def llguidance_tokenizer(codec, vocab_size: int, eos_id: int):
    from llguidance import LLTokenizer

    return LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_id)


def compile_matcher(m: ServedModel, c: Constraint):
    """The constraint's matcher at its start state, or an APIError naming the field and llguidance's reason."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(c)
    except (ValueError, TypeError) as e:
        raise APIError(422, f"{c.field}: {e}", c.field) from None
    try:
        vocabulary = tokenizer_of(m)
    except Exception as e:  # e.g. a tokenizer llguidance cannot read
        raise APIError(422, f"{c.field}: model {m.id} cannot be constrained ({e})", c.field) from None
    matcher = LLMatcher(vocabulary, grammar, log_level=0)  # a bad grammar leaves it in its error state
    if matcher.is_error():
        raise APIError(422, f"{c.field}: {matcher.get_error().strip()}", c.field)
    return matcher


def constrained(job: CompletionJob, c: Constraint | None, settings: Settings) -> CompletionJob:
    """The job with its constraint compiled (on a grammar thread, within grammar_compile_timeout_s): how every
    route and the Cog predictor attach one. It waits for the compile: routes call it on a worker thread."""
    if c is None:
        return job
    if job.model.runner is None:
        raise APIError(422, f"{c.field}: model {job.model.id} does not generate text", c.field)
    compiling = COMPILERS.submit(compile_matcher, job.model, c)
    try:
        matcher = compiling.result(timeout=settings.grammar_compile_timeout_s)
    except TimeoutError:
        limit = settings.grammar_compile_timeout_s
        raise APIError(422, f"{c.field}: did not compile within {limit} s", c.field) from None
    return replace(job, params=replace(job.params, constraint=matcher))
