import json
from pathlib import Path

import pytest
import torch

from model_store.store import CheckpointError, list_checkpoints, load_gpt, resolve, write_checkpoint, write_manifest


@pytest.fixture
def checkpoint(tmp_path, tiny_trained_gpt, tiny_tokenizer) -> Path:
    folder = tmp_path / "tiny-gpt"
    write_checkpoint(folder, tiny_trained_gpt, tiny_tokenizer, card="# tiny\n", metrics={"steps": 0})
    return folder


def test_round_trip_keeps_outputs(checkpoint, tiny_trained_gpt):
    model, tok = load_gpt(checkpoint)
    x = torch.randint(1, tok.get_vocab_size(), (1, 12))
    with torch.no_grad():
        ref = tiny_trained_gpt(x).logits
        out = model(x).logits
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)  # stored in fp16
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()  # still tied
    assert not model.training


def test_manifest_lists_every_file(checkpoint):
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert set(files) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "metrics.json",
    }
    assert all(len(f["sha256"]) == 64 for f in files.values())


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_weights_are_rejected_naming_the_file(checkpoint):
    flip_one_byte(checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 does not match"):
        load_gpt(checkpoint)


def test_truncated_file_is_rejected(checkpoint):
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: size 100 bytes"):
        load_gpt(checkpoint)


def test_missing_tokenizer_is_rejected(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
        load_gpt(checkpoint)


def test_pickle_file_is_refused(checkpoint):
    torch.save({"x": torch.zeros(1)}, checkpoint / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: pickle-format"):
        load_gpt(checkpoint)


def test_wrong_shapes_are_rejected_naming_the_tensor(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["d_ff"] = cfg["d_ff"] * 2
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    write_manifest(checkpoint)  # a consistent manifest: the mismatch is in the content
    with pytest.raises(CheckpointError, match=r"tensor blocks\.0\.mlp\.fc\.(weight|bias) has shape"):
        load_gpt(checkpoint)


def test_list_reports_invalid_checkpoints_without_failing(checkpoint, tmp_path):
    other = tmp_path / "broken"
    other.mkdir()
    (other / "config.json").write_text("{}")
    infos = {i.id: i for i in list_checkpoints(tmp_path)}
    assert infos["tiny-gpt"].ok and infos["tiny-gpt"].family.runner == "decoder"
    assert not infos["broken"].ok and "manifest.json: missing manifest" in infos["broken"].error


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "..", "a/b", "", "x" * 200, "name\x00"])
def test_model_ids_cannot_leave_the_store(bad, tmp_path):
    with pytest.raises(CheckpointError, match="invalid model id"):
        resolve(bad, tmp_path)


def test_plain_model_id_resolves_inside_the_store(tmp_path):
    assert resolve("gpt-wikitext2", tmp_path) == (tmp_path / "gpt-wikitext2").resolve()


def test_gpt_tokenizer_loads_in_transformers_with_its_end_of_text_token(checkpoint, tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tiny_tokenizer.token_to_id("<|endoftext|>")
    text = "The castle was built in 1350 ."
    assert tok(text)["input_ids"] == tiny_tokenizer.encode(text, add_special_tokens=False).ids


def test_checkpoint_without_tokenizer_config_still_loads(checkpoint, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    (old / "tokenizer_config.json").unlink()
    write_manifest(old)
    model, tok = load_gpt(old)
    assert tok.token_to_id("<|endoftext|>") == model.config.eos_token_id
