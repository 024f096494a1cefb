"""What the engine sends a request's consumer: one event per generated token, then its finish. The
routers, the service layer and the Cog predictor read these, never the engine's rows."""

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
