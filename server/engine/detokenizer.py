"""Text out of generated tokens, once per request: incremental decoding plus stop sequences.

The output side (server/engine/output.py) feeds each request's tokens to its Detokenizer and puts the
released text in the events, so nothing downstream decodes again.
"""

from __future__ import annotations


class Detokenizer:
    """A request's generated token ids -> the text released to the client, as the tokens come.

    Byte-level BPE tokens need their neighbours to decode (a character can span tokens), so each step
    decodes a short window that starts at the previous token that completed text; an incomplete UTF-8
    character decodes to U+FFFD and is held back until the next token completes it.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = StopMatcher(stops)
        self.ids: list[int] = []
        self.decoded = ""  # text of `ids` fed to the stop matcher so far
        self.prefix_offset = 0  # decoding window: ids[prefix_offset:read_offset] is already in `decoded`
        self.read_offset = 0

    @property
    def text(self) -> str:
        """Everything generated so far, cut at a stop sequence."""
        return self.stop.text

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; returns (text that is safe to release now, whether a stop sequence was hit)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return self.stop.feed("")
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.decoded += text[len(before) :]
        return self.stop.feed(text[len(before) :])

    def finish(self) -> tuple[str, bool]:
        """At the end: release what was held back (undecoded bytes, stop-sequence prefixes)."""
        released, stopped = self.stop.feed(self.tokenizer.decode(self.ids)[len(self.decoded) :])
        return released + ("" if stopped else self.stop.flush()), stopped


class StopMatcher:
    """Finds stop sequences in streamed text, across token boundaries.

    Text that might be the start of a stop sequence is held back until it is known not to be, so a
    stream never shows part of a stop sequence.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated so far
        self.emitted = 0  # characters of self.text already released

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Add decoded text; returns (text that is safe to emit now, whether a stop sequence was hit)."""
        self.text += new_text
        search_from = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) != -1]
        if hits:
            end = min(hits)
            self.text = self.text[:end]
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out, True
        hold = 0  # longest suffix of the text that is a proper prefix of some stop sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, False

    def flush(self) -> str:
        """At the end of generation: release what was held back."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
