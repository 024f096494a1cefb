"""What a request's consumer receives. The engine (compute thread) sends ids: `Sampled` per step, then
`Retired`; the output side (server/engine/output.py, on the consumer's thread) makes them into `TokenEvent`s
with text and a `FinishEvent`, which the routers, the service layer and the Cog predictor read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alternative:
    """A likely token at a step, with its text: routers report it without a tokenizer."""

    id: int
    text: str
    logprob: float
    special: bool  # the end-of-text token


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; immutable once emitted (every consumer sees the same event)."""

    id: int
    text: str  # text released by this token ('' while a stop sequence or a UTF-8 character is pending)
    token_text: str = ""  # the token's own text, decoded alone (when logprobs were asked for)
    special: bool = False  # the end-of-text token
    logprob: float | None = None
    top_logprobs: tuple[Alternative, ...] = ()
    last: bool = False  # the generation ends with this token (a FinishEvent follows at once)


@dataclass
class FinishEvent:
    reason: str  # length | eos_token | stop_sequence | cancelled | timeout | error
    text: str  # the whole generated text (stop sequence excluded)
    generated_tokens: int
    prompt_tokens: int
    message: str = ""
    tail: str = ""  # text held back until the end (a possible stop-sequence start, a partial character)


Event = TokenEvent | FinishEvent


@dataclass(frozen=True)
class Sampled:
    """The token the engine chose for a request at one step, as ids."""

    id: int
    logprob: float | None = None  # when asked for
    top: tuple[tuple[int, float], ...] = ()  # likely alternatives (id, logprob), when asked for
    eos: bool = False  # an end-of-text (or end-of-turn) token: it has no text
    end: str | None = None  # why the engine ends the request with it: eos_token, length (FinishEvent.reason)


@dataclass(frozen=True)
class Retired:
    """The engine is done with a request: it ended by itself or was asked to stop (`GenerationRequest.end`)."""

    reason: str  # as FinishEvent.reason
    generated_tokens: int
    prompt_tokens: int
    message: str = ""


EngineOutput = Sampled | Retired
