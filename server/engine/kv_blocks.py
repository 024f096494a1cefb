"""The model's KV pool as blocks: which sequence holds each, which are free, which hold a known prefix.

vLLM's KV cache manager, for one model: the runner's pool (models/kv_cache.py, `PagedKVCache`) has `blocks` blocks
of BLOCK_TOKENS positions; block 0 is the null block (padding rows and a table's unused entries name it) and is
never handed out. A running sequence holds the blocks its positions fill, in order (its block table), and a
reservation of the blocks it may still need (its prompt and its most new tokens, taken as it grows), so that a
sequence admitted always finishes: admission waits for blocks, growth never fails.

Prefix caching: a full block is keyed by the hash of its tokens chained to the hash of the blocks before it (and of
anything else that changes keys and values: `salt`). A later prompt that starts with the same full blocks takes them
read-only (each block counts its holders) and prefills only its tail. A block no one holds is free; if it has a key
it stays findable until the pool needs it, the least recently freed first (LRU).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from models.kv_cache import BLOCK_TOKENS, blocks_for

NULL_BLOCK = 0


def chain(parent: bytes, tokens: Sequence[int], salt: Hashable = None) -> bytes:
    """The key of a full block: its tokens, the key of the blocks before it, and the salt."""
    return hashlib.blake2b(repr((parent, tuple(tokens), salt)).encode(), digest_size=16).digest()


@dataclass
class BlockStats:
    prompt_tokens: int = 0  # prompt tokens admitted
    cached_tokens: int = 0  # of those, read from cached blocks instead of prefilled


@dataclass
class Holding:
    """A sequence's blocks: its table, the keys of its full blocks (chained with its salt), and the blocks still
    reserved for it."""

    table: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # keys[i]: block table[i]'s, while it is full and keyed
    reserved: int = 0
    cached: int = 0  # its first blocks, found cached at admission: its prompt's prefill starts after them
    salt: Hashable = None  # what else made its keys and values (a steered sequence's vectors)


class KVBlocks:
    def __init__(self, blocks: int, prefix_caching: bool = True) -> None:
        """prefix_caching: False, and no block is ever found by its prompt (each prompt prefilled whole)."""
        if blocks < 2:
            raise ValueError(f"a KV pool needs 2 blocks or more (the null block and one), not {blocks}")
        self.blocks = blocks
        self.holders = [0] * blocks  # block -> sequences holding it
        # free blocks, least recently freed first (taken from the front); block -> None
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, blocks))
        self.key_of: dict[int, bytes] = {}  # block -> its key, while it holds a keyed prefix
        self.block_of: dict[bytes, int] = {}  # key -> block
        self.reserved = 0  # blocks promised to running sequences, not taken yet
        self.prefix_caching = prefix_caching
        self.stats = BlockStats()

    # -- what can be had --------------------------------------------------------------------------------------

    @property
    def usable(self) -> int:
        """Blocks a sequence may hold: all but the null block."""
        return self.blocks - 1

    def available(self) -> int:
        """Blocks free and not promised (keyed free blocks count: the pool takes them back when it needs them)."""
        return len(self.free) - self.reserved

    def cached(self, tokens: Sequence[int], salt: Hashable = None) -> list[int]:
        """The blocks holding the longest prefix of full blocks of `tokens` that is cached; at least one token is
        left after them (the pass needs a token to compute the next one's logits)."""
        found, parent = [], b""
        if not self.prefix_caching:
            return found
        for start in range(0, len(tokens) - 1 - (len(tokens) - 1) % BLOCK_TOKENS, BLOCK_TOKENS):
            parent = chain(parent, tokens[start : start + BLOCK_TOKENS], salt)
            block = self.block_of.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def fits(self, positions: int, cached: Sequence[int] = ()) -> bool:
        """Whether a sequence of up to `positions` positions, whose first blocks are `cached`, can be admitted."""
        taken_from_free = sum(1 for b in cached if self.holders[b] == 0)
        return blocks_for(positions) - len(cached) + taken_from_free <= self.available()

    # -- a sequence's life ------------------------------------------------------------------------------------

    def admit(self, tokens: Sequence[int], positions: int, cached: Sequence[int], salt: Hashable = None) -> Holding:
        """A new sequence: the cached blocks of its prompt `tokens` taken, blocks for the rest of the prompt
        allocated, and those its later positions (up to `positions`) reserved. Check `fits` first; once the prompt
        is written, `keep_full` makes its blocks findable."""
        holding = Holding(salt=salt)
        for block in cached:
            self._hold(block)
        holding.table = [*cached, *self._allocate(blocks_for(len(tokens)) - len(cached))]
        holding.keys = [self.key_of[b] for b in cached]
        holding.cached = len(cached)
        holding.reserved = max(0, blocks_for(positions) - len(holding.table))
        self.reserved += holding.reserved
        self.stats.prompt_tokens += len(tokens)
        self.stats.cached_tokens += len(cached) * BLOCK_TOKENS
        return holding

    def grow(self, holding: Holding, positions: int) -> None:
        """Blocks for the sequence's first `positions` positions, from its reservation (or the free ones past it)."""
        while len(holding.table) < blocks_for(positions):
            if holding.reserved > 0:
                holding.reserved -= 1
                self.reserved -= 1
            elif self.available() < 1:
                raise RuntimeError("the KV pool has no free block (a sequence grew past its reservation)")
            holding.table += self._allocate(1)

    def keep_full(self, holding: Holding, tokens: Sequence[int], written: int | None = None) -> None:
        """Key the sequence's blocks that its first `written` `tokens` (default: all; those in the cache) fill, so
        that later prompts find them. A block already keyed elsewhere with the same key stays unkeyed here (one block
        a key)."""
        written = len(tokens) if written is None else written
        while len(holding.keys) < min(written // BLOCK_TOKENS, len(holding.table)):
            i = len(holding.keys)
            key = chain(
                holding.keys[-1] if holding.keys else b"",
                tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS],
                holding.salt,
            )
            block = holding.table[i]
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key
            holding.keys.append(key)

    def release(self, holding: Holding) -> None:
        """The sequence has ended: its blocks let go (keyed ones stay findable until taken), its reservation too."""
        self.reserved -= holding.reserved
        holding.reserved = 0
        for block in reversed(holding.table):  # its last blocks first: a prefix's head outlives its tail
            self.holders[block] -= 1
            if self.holders[block] == 0:
                self.free[block] = None
                if block not in self.key_of:  # nothing to find in it: reused before the keyed ones
                    self.free.move_to_end(block, last=False)
        holding.table = []

    # -- blocks --------------------------------------------------------------------------------------------------

    def _hold(self, block: int) -> None:
        if self.holders[block] == 0:
            del self.free[block]
        self.holders[block] += 1

    def _allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"the KV pool has {len(self.free)} free blocks, {n} asked for")
        taken = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            if (key := self.key_of.pop(block, None)) is not None:  # evicted: its prefix is computed again if needed
                del self.block_of[key]
            self.holders[block] = 1
            taken.append(block)
        return taken

    def held(self) -> int:
        """Blocks some sequence holds."""
        return sum(1 for h in self.holders if h > 0)

    def describe(self) -> dict:
        """The pool as /info shows it: its size, what a request may have now, the prompts it served from cache."""
        s = self.stats
        return {
            "blocks": self.usable,
            "block_tokens": BLOCK_TOKENS,
            "tokens": self.usable * BLOCK_TOKENS,
            "held_blocks": self.held(),
            "cached_free_blocks": sum(1 for b in self.free if b in self.key_of),
            "longest_request_now": max(0, self.available()) * BLOCK_TOKENS,
            "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_tokens,
            "hit_rate": round(s.cached_tokens / s.prompt_tokens, 4) if s.prompt_tokens else 0.0,
        }
