"""The special token every GPT checkpoint shares: documents end with it, and a prompt read as a new
document starts after it."""

from __future__ import annotations

from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"


def eos_id(tokenizer: Tokenizer) -> int:
    tid = tokenizer.token_to_id(EOS_TOKEN)
    if tid is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN} token")
    return tid
