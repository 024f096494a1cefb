"""The output side of a request: the engine's ids made into events with text, on the consumer's thread.

The compute thread only chooses tokens; each consumer (the service layer's event loop, a synchronous
caller's thread) turns its own request's `Sampled` ids into text here, as vLLM's output processor does.
A stop sequence is text, so it is found here too: the request is then asked to end, and the tokens the
engine chose meanwhile (at most a step or two) are dropped.
"""

from __future__ import annotations

from typing import Protocol

from models.sampling import SamplingParams
from server.engine.detokenizer import Detokenizer
from server.engine.events import Alternative, EngineOutput, Event, FinishEvent, Retired, TokenEvent


class Request(Protocol):
    """What the output side reads of a submitted request (server/engine/core.py, GenerationRequest)."""

    prompt_ids: list[int]
    params: SamplingParams

    def end(self, reason: str) -> None: ...


class RequestOutput:
    """One request's engine outputs -> its token events and finish event, each exactly once."""

    def __init__(self, req: Request, tokenizer, eos_id: int) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.detokenizer = Detokenizer(tokenizer, req.params.stop)
        self.generated = 0  # tokens made into events, the end-of-text token excluded
        self.finished = False

    def add(self, out: EngineOutput) -> list[Event]:
        """The events this engine output makes: none once the request has finished here."""
        if self.finished:
            return []
        if isinstance(out, Retired):
            return [self._finish(out.reason, out.message)]
        p = self.req.params
        alternatives = tuple(Alternative(i, self.tokenizer.decode([i]), lp, i == self.eos_id) for i, lp in out.top)
        token_text = self.tokenizer.decode([out.id]) if p.logprobs else ""
        if out.eos:
            token = TokenEvent(out.id, "", token_text, True, out.logprob, alternatives, last=True)
            return [token, self._finish("eos_token")]
        self.generated += 1
        released, stopped = self.detokenizer.add(out.id)
        last = stopped or out.end is not None
        token = TokenEvent(out.id, released, token_text, False, out.logprob, alternatives, last=last)
        if stopped:
            self.req.end("stop_sequence")
            return [token, self._finish("stop_sequence")]
        return [token, self._finish(out.end)] if out.end is not None else [token]

    def _finish(self, reason: str, message: str = "") -> FinishEvent:
        self.finished = True
        tail = ""
        if reason != "stop_sequence":  # release what was held back: undecoded bytes, stop-sequence prefixes
            tail, stopped = self.detokenizer.finish()
            reason = "stop_sequence" if stopped else reason
        prompt_tokens = len(self.req.prompt_ids)
        return FinishEvent(reason, self.detokenizer.text, self.generated, prompt_tokens, message, tail)
