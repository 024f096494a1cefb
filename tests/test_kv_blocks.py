"""The KV pool's blocks: admission by blocks, growth from the reservation, shared prefixes, LRU eviction."""

import random

import pytest

from models.kv_cache import BLOCK_TOKENS
from server.engine.kv_blocks import NULL_BLOCK, KVBlocks, blocks_for


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)]


def prefilled(kv: KVBlocks, prompt: list[int], most: int, cached: list[int]):
    """Admitted, and its prompt written (the engine keys its full blocks then)."""
    held = kv.admit(prompt, most, cached)
    kv.keep_full(held, prompt)
    return held


def test_a_sequence_holds_its_prompts_blocks_and_has_the_rest_reserved():
    kv = KVBlocks(10)
    assert kv.usable == 9 and kv.available() == 9
    prompt = tokens(20)  # 2 blocks
    assert kv.fits(20 + 40) and not kv.fits(9 * BLOCK_TOKENS + 1)
    held = kv.admit(prompt, 60, kv.cached(prompt))
    assert len(held.table) == 2 and NULL_BLOCK not in held.table and held.reserved == 2
    assert kv.available() == 9 - 4
    kv.grow(held, 33)  # a third block, from the reservation
    assert len(held.table) == 3 and held.reserved == 1 and kv.available() == 5
    kv.release(held)
    assert kv.available() == 9 and kv.held() == 0 and kv.reserved == 0


def test_a_prompt_finds_the_full_blocks_an_earlier_one_computed_and_prefills_its_tail_only():
    kv = KVBlocks(16)
    first = tokens(40)
    a = prefilled(kv, first, 48, kv.cached(first))
    assert kv.stats.cached_tokens == 0
    second = first[:35] + tokens(10, seed=1)  # the same first two blocks, then its own
    hit = kv.cached(second)
    assert hit == a.table[:2]
    b = prefilled(kv, second, 50, hit)
    assert b.table[:2] == a.table[:2] and b.table[2] != a.table[2] and b.cached == 2
    assert kv.holders[a.table[0]] == 2 and kv.stats.cached_tokens == 2 * BLOCK_TOKENS
    assert kv.cached(tokens(40, seed=2)) == []  # another prefix
    assert kv.cached(first[:BLOCK_TOKENS]) == []  # one token is always left to compute
    assert kv.cached(first[: BLOCK_TOKENS + 1]) == a.table[:1]
    assert kv.cached(first, salt="steered") == []  # keys and values made otherwise are another prefix


def test_a_freed_prefix_stays_findable_until_the_pool_needs_its_blocks_least_recently_freed_first():
    kv = KVBlocks(7)  # 6 usable
    old, new = tokens(33), tokens(33, seed=1)  # 3 blocks each, 2 of them full
    kv.release(prefilled(kv, old, 33, []))
    kv.release(prefilled(kv, new, 33, []))
    assert kv.held() == 0 and len(kv.cached(old)) == 2 and len(kv.cached(new)) == 2
    kv.release(prefilled(kv, tokens(33, seed=2), 33, []))  # 3 blocks: the unkeyed partial ones first, then old's
    assert len(kv.cached(new)) == 2 and len(kv.cached(old)) < 2


def test_growth_past_the_reservation_takes_free_blocks_and_fails_only_when_none_is_left():
    kv = KVBlocks(4)
    held = kv.admit(tokens(5), 5, [])
    kv.grow(held, 3 * BLOCK_TOKENS)
    assert len(held.table) == 3
    with pytest.raises(RuntimeError, match="no free block"):
        kv.grow(held, 3 * BLOCK_TOKENS + 1)


def test_after_any_order_of_admissions_growth_and_ends_no_block_is_held_and_none_is_lost():
    rng = random.Random(0)
    kv = KVBlocks(40)
    running: list[tuple] = []
    stems = [tokens(64, seed=s) for s in range(4)]  # shared openings, as system prompts are
    for _ in range(2000):
        if running and rng.random() < 0.4:
            held, seq, most = running.pop(rng.randrange(len(running)))
            kv.release(held)
        elif running and rng.random() < 0.5:
            held, seq, most = running[rng.randrange(len(running))]
            if len(seq) < most:
                seq += tokens(1, seed=len(seq))
                kv.grow(held, len(seq))
                kv.keep_full(held, seq)
        else:
            seq = stems[rng.randrange(4)][: rng.randrange(1, 64)] + tokens(rng.randrange(1, 40), seed=rng.random())
            most = len(seq) + rng.randrange(0, 60)
            hit = kv.cached(seq)
            if kv.fits(most, hit):
                held = prefilled(kv, seq, most, hit)
                assert len(held.table) == blocks_for(len(seq)) and len(set(held.table)) == len(held.table)
                running.append((held, seq, most))
        in_use = [b for held, _, _ in running for b in held.table]
        assert all(kv.holders[b] >= 1 for b in in_use) and kv.available() >= 0
    for held, _, _ in running:
        kv.release(held)
    assert kv.held() == 0 and kv.reserved == 0 and len(kv.free) == kv.usable
    assert kv.stats.cached_tokens > 0
