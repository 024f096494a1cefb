"""Speculative decoding with drafts from the sequence itself (prompt lookup: transformers' prompt_lookup_num_tokens,
vLLM's "ngram" method): where the last few tokens appeared before, the tokens that followed them then are the
draft, and the model checks the pending token and the draft in one pass (the runner's `verify`). A greedy
sequence keeps the tokens it would have made one step at a time (up to the pass's own rounding); each draft token
the model agrees with is a decode step, and a read of every weight, saved. Small models' greedy text repeats
itself, and quotes its prompt, often, so its greedy continuation takes far fewer passes than tokens
(docs/BENCHMARKS.md, "AVX2 CPU", "Drafts").
"""

from __future__ import annotations

from collections.abc import Callable

from server.execution.runner import CausalLMRunner

LONGEST_NGRAM = 3  # the longest suffix looked up: a longer match is likelier to go on as it did
SHORTEST_NGRAM = 1  # the shortest: a lone repeated token still proposes what followed it


class PromptLookup:
    """An index of a token sequence's n-grams (n = 1..LONGEST_NGRAM), each to where its latest occurrence with a
    continuation ends, extended as the sequence grows: a draft costs a few dictionary reads, not a scan."""

    def __init__(self) -> None:
        self.indexed = 0  # the sequence's first tokens indexed so far (the sequence itself is its owner's)
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence

    def index(self, tokens: list[int]) -> None:
        """Index the tokens added since the last call (the sequence only grows)."""
        for end in range(max(self.indexed, 1), len(tokens)):  # n-grams ending at `end` continue with tokens[end]
            for n in range(1, min(LONGEST_NGRAM, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self.indexed = len(tokens)

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest earlier occurrence of the sequence's last tokens."""
        for n in range(min(LONGEST_NGRAM, len(tokens)), SHORTEST_NGRAM - 1, -1):
            end = self._ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + limit]
        return []


def agreed(draft: list[int], greedy: list[int]) -> int:
    """How many draft tokens the model agrees with: greedy[i] is its token after the pending one and draft[:i]."""
    n = 0
    while n < len(draft) and greedy[n] == draft[n]:
        n += 1
    return n


def speculate(
    runner: CausalLMRunner,
    lookup: PromptLookup,
    tokens: list[int],
    position: int,
    eos_bias: Callable[[int], float],
    limit: int,
    table: list[int],
) -> tuple[list[int], list[float], int] | None:
    """A sequence's next tokens from one draft check: its pending token (the last of `tokens`, indexed by `lookup`,
    at `position` of the sequence whose block table `table` is) and up to `limit` drafts in one pass (the runner's
    `verify`); the greedy token after the pending one and after each draft token the model agreed with, their
    logprobs, and how many tokens were drafted.
    eos_bias(i): the EOS bias of the token after the i-th. None where there is no draft, no draft check ready,
    or the pass would run past the context: decode a step instead."""
    width = runner.facts.verify_tokens
    draft = lookup.draft(tokens, min(limit, width - 1))
    if not draft or position + width > runner.facts.context_length:
        return None
    padded = [tokens[-1], *draft] + [draft[-1]] * (width - 1 - len(draft))  # what follows is not read
    checked = runner.verify(padded, position, [eos_bias(i) for i in range(width)], table)
    if checked is None:
        return None
    greedy, logprobs = checked
    n = agreed(draft, greedy) + 1
    return greedy[:n], logprobs[:n], len(draft)
