"""What every request body shares: strict types, no unknown fields, no NUL characters in text."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("NUL characters (\\u0000) are not allowed in text")
    return text


Text = Annotated[str, AfterValidator(no_nul)]


class RequestModel(BaseModel):
    """Request bodies: a typo'd field or a number sent as a string is refused (422), not guessed at."""

    model_config = ConfigDict(extra="forbid", strict=True)
