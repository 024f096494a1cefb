"""A paged KV cache (blocks from one pool, a block table per row) gives the static cache's logits."""

import pytest
import torch

from models.kv_cache import BLOCK_TOKENS, PagedKVCache
from tests.conftest import tiny_gpt
from tests.test_compiled_step import VARIANTS


def paged(model, blocks: int) -> PagedKVCache:
    shapes = [block.attn.cache_shapes() for block in model.blocks]
    p = next(model.parameters())
    return PagedKVCache.empty(shapes, blocks, p.dtype, p.device)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompts_then_steps_over_scattered_blocks_give_the_static_caches_logits(variant):
    model = tiny_gpt(vocab_size=97, context_length=64, **VARIANTS[variant]).eval()
    lengths = [21, 7, 34]  # unequal prompts, right-padded into one pass
    B, T = len(lengths), max(lengths)
    torch.manual_seed(0)
    ids = torch.randint(1, 97, (B, T))
    positions = torch.arange(T).expand(B, T)
    static = model.new_cache(B)
    pool = paged(model, 24)
    # each row's blocks scattered over the pool, in no order; the rows' last table entries name block 0, unused
    table = torch.tensor([[5, 17, 2, 9], [11, 0, 0, 0], [3, 20, 14, 8]])
    with torch.no_grad():
        want = model(ids, input_pos=positions, cache=static).logits
        got = model(ids, input_pos=positions, cache=pool.rows(table)).logits
        for row, n in enumerate(lengths):  # each row's prompt positions (the padding's logits differ: unread keys)
            torch.testing.assert_close(got[row, :n], want[row, :n], rtol=1e-5, atol=1e-5)
        tokens, pos = ids[:, :1], torch.tensor(lengths).view(B, 1)
        for _ in range(BLOCK_TOKENS + 3):  # steps across a block's end
            want = model(tokens, input_pos=pos, cache=static).logits
            got = model(tokens, input_pos=pos, cache=pool.rows(table)).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tokens, pos = want[:, -1].argmax(-1, keepdim=True), pos + 1


def test_rows_sharing_a_prefix_block_read_it_and_write_only_their_own():
    model = tiny_gpt(vocab_size=97, context_length=64, positions="rope").eval()
    prefix = torch.randint(1, 97, (1, BLOCK_TOKENS))
    pool = paged(model, 8)
    with torch.no_grad():
        model(prefix, input_pos=torch.arange(BLOCK_TOKENS).view(1, -1), cache=pool.rows(torch.tensor([[1]])))
        kept = [p.clone() for p in pool.tensors()]
        tails = torch.randint(1, 97, (2, 5))
        pos = torch.arange(BLOCK_TOKENS, BLOCK_TOKENS + 5).expand(2, 5)
        got = model(tails, input_pos=pos, cache=pool.rows(torch.tensor([[1, 2], [1, 3]]))).logits
        whole = torch.cat([prefix.expand(2, -1), tails], dim=1)
        want = model(whole).logits[:, BLOCK_TOKENS:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    shared = slice(BLOCK_TOKENS, 2 * BLOCK_TOKENS)  # block 1's pool rows: read by both rows, written by neither
    assert all(torch.equal(p[shared], k[shared]) for p, k in zip(pool.tensors(), kept, strict=True))
