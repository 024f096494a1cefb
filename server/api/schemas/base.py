"""What every request body shares: strict types, no unknown fields, no NUL characters in text."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("NUL characters (\\u0000) are not allowed in text")
    return text


Text = Annotated[str, AfterValidator(no_nul)]

# One set of bounds for the sampling parameters TGI, OpenAI and Cog share; a format narrows one only where its
# own spec does (OpenAI: temperature at most 2). Cog's inputs take ge/le only: its "> 0" is ge=MIN_POSITIVE.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0  # repetition_penalty (> 0; 1 = off)
MAX_EOS_BIAS = 100.0
MAX_TOKENS = 100_000  # max_new_tokens, min_new_tokens, eos_bias_start (max_new_tokens is capped by the server too)
MAX_SEED = 2**63 - 1
MIN_POSITIVE = 0.01


class RequestModel(BaseModel):
    """Request bodies: a typo'd field or a number sent as a string is refused (422), not guessed at."""

    model_config = ConfigDict(extra="forbid", strict=True)
