"""A checkpoint file is hashed once per version of it: validated again unread, and hashed anew once written."""

import os

import pytest

from model_store import digests
from model_store.store import CheckpointError, validate, write_checkpoint
from tests.conftest import tiny_gpt


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Digests kept in a file of this test's; the files sha256_file reads, in order."""
    monkeypatch.setattr(digests, "STAMPS", tmp_path / "stamps" / "sha256.json")
    read: list[str] = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda path: read.append(path.name) or real(path))
    return read


def test_a_validated_checkpoint_is_not_read_again_in_this_process_or_the_next(counted, tmp_path, tiny_tokenizer):
    folder = tmp_path / "gpt"
    write_checkpoint(folder, tiny_gpt(), tiny_tokenizer, card="# gpt\n", metrics={})
    assert "model.safetensors" in counted  # hashed for its manifest
    counted.clear()
    validate(folder)
    assert counted == []
    digests._read_from = None  # as a new process: the memo read back from its file
    digests._known.clear()
    validate(folder)
    assert counted == [] and digests.STAMPS.is_file()


def test_a_file_written_again_is_hashed_again_even_with_its_size_and_times_put_back(counted, tmp_path, tiny_tokenizer):
    folder = tmp_path / "gpt"
    write_checkpoint(folder, tiny_gpt(), tiny_tokenizer, card="# gpt\n", metrics={})
    weights = folder / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # its change time still moves
    counted.clear()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 does not match"):
        validate(folder)
    assert counted == ["model.safetensors"]


def test_an_unwritable_memo_costs_the_memo_not_the_check(monkeypatch, tmp_path, tiny_tokenizer):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(digests, "STAMPS", blocker / "sha256.json")
    folder = tmp_path / "gpt"
    write_checkpoint(folder, tiny_gpt(), tiny_tokenizer, card="# gpt\n", metrics={})
    validate(folder)
    (folder / "README.md").write_text("# changed\n")
    with pytest.raises(CheckpointError, match=r"README\.md: (size|sha256)"):
        validate(folder)
