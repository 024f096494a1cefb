"""A model's weights moved to memory advised for huge pages (server/execution/huge_pages.py)."""

import pytest
import torch

from server.execution import huge_pages
from tests.conftest import tiny_gpt


def vm_flags(address: int) -> list[str]:
    """The flags of this process's mapping that holds `address` (/proc/self/smaps)."""
    flags, inside = None, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    assert flags is not None, "no mapping holds the address"
    return flags


@pytest.mark.skipif(huge_pages.thp_mode() == "never", reason="this kernel offers no transparent huge pages")
def test_the_weights_move_into_one_block_advised_for_huge_pages_and_compute_the_same():
    model = tiny_gpt(vocab_size=97).to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids).logits
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    moved = huge_pages.on_huge_pages(model)
    assert moved >= sum(t.numel() * t.element_size() for t in tensors)
    addresses = sorted(p.data_ptr() for p in model.parameters())
    assert addresses[-1] - addresses[0] < moved and all(a % huge_pages.ALIGN == 0 for a in addresses)
    assert "hg" in vm_flags(addresses[0])  # MADV_HUGEPAGE
    # each tensor has a storage of its own (dynamo refuses aliased inputs of a nested compile region)
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    model = tiny_gpt(vocab_size=97)
    where = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.on_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == where



def test_a_checkpoint_is_read_straight_into_a_block_and_nothing_is_moved_again(tmp_path, tiny_tokenizer):
    """Our GPT's tensors in the file's dtype: each read into its place in the block (no buffer), a storage each,
    64-byte aligned, the model computing as the plain load's; on_huge_pages then moves only what the file lacks."""
    from model_store import load_gpt
    from model_store.store import write_checkpoint

    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size())
    write_checkpoint(tmp_path / "tiny", model, tiny_tokenizer, card="# tiny\n", metrics={}, dtype=torch.float32)
    plain, _ = load_gpt(tmp_path / "tiny")
    block = huge_pages.HugePageBlock()
    placed, _ = load_gpt(tmp_path / "tiny", arena=block)
    params = list(placed.parameters())
    assert all(block.holds(p) for p in params) and all(p.data_ptr() % huge_pages.ALIGN == 0 for p in params)
    assert len({p.untyped_storage().data_ptr() for p in params}) == len(params)
    assert "hg" in vm_flags(params[0].data_ptr()) or huge_pages.thp_mode() == "never"
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(placed(ids).logits, plain(ids).logits)
    buffers = sum(b.nbytes for b in placed.buffers())  # the sinusoidal table: made, not read
    assert huge_pages.on_huge_pages(placed, block) in (0, huge_pages.aligned(buffers))
    with pytest.raises(RuntimeError, match="one checkpoint"):
        block.place([[(torch.float32, torch.Size([4]))]])
