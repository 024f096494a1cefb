"""`tinyserve export MODEL OUT --format hf`: our GPT as a GPT-NeoX checkpoint that transformers loads
with no code of ours, giving our logits (fp32, 1e-4) and our greedy tokens."""

import pytest
import torch

from model_store.export import ExportError, export_hf
from model_store.store import STORE_ROOT, load_gpt, write_checkpoint
from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server.cli import main as tinyserve
from tests.conftest import tiny_gpt


def checkpoint(tmp_path, tokenizer, name="tiny", **overrides):
    model = tiny_gpt(
        seed=3,
        vocab_size=tokenizer.get_vocab_size(),
        eos_token_id=eos_id(tokenizer),
        context_length=128,
        **{"positions": "rope", **overrides},
    )
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced one shows
        for name_, p in model.named_parameters():
            if name_.endswith("bias") or ".ln" in name_ or name_.startswith("ln"):
                p.add_(torch.randn_like(p) * 0.1)
    write_checkpoint(tmp_path / name, model, tokenizer, card="# tiny\n", metrics={}, dtype=torch.float32)
    return tmp_path / name


def assert_same_model(folder, exported, prompt_ids):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, _ = load_gpt(folder)
    theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x).logits, atol=1e-4, rtol=1e-4)
        greedy = ours.generate(x, SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0))[0]
        hf = theirs.generate(x, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, len(prompt_ids) :]
    assert greedy.tolist() == hf.tolist()
    assert AutoTokenizer.from_pretrained(exported).eos_token_id == ours.config.eos_token_id


@pytest.mark.parametrize(
    "overrides",
    [{}, {"qkv_sharing": "qk"}, {"qkv_sharing": "qkv"}, {"bias": False}],
    ids=["plain", "qk", "qkv", "nobias"],
)
def test_exported_gpt_is_our_model_in_transformers(tmp_path, tiny_tokenizer, overrides):
    folder = checkpoint(tmp_path, tiny_tokenizer, **overrides)
    exported = export_hf(folder, tmp_path / "hf")
    assert (exported / "config.json").exists() and not list(exported.glob("*.py"))  # no remote code
    assert_same_model(folder, exported, tiny_tokenizer.encode("The castle was built in").ids)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"softmax": "softmax1"}, "softmax='softmax1'"),
        ({"positions": "sinusoidal"}, "positions='sinusoidal'"),
        ({"score": "additive"}, "score='additive'"),
        ({"n_head": 2, "n_relational_head": 2}, "n_relational_head=2"),
    ],
)
def test_variants_neox_cannot_express_are_refused_by_name(tmp_path, tiny_tokenizer, overrides, named):
    folder = checkpoint(tmp_path, tiny_tokenizer, **overrides)
    with pytest.raises(ExportError, match=named):
        export_hf(folder, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_command_reads_the_store_setting(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    checkpoint(tmp_path / "store", tiny_tokenizer, name="tiny-gpt")
    monkeypatch.setenv("TINYSERVE_STORE", str(tmp_path / "store"))
    tinyserve(["export", "tiny-gpt", str(tmp_path / "out"), "--format", "hf"])
    assert (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(SystemExit) as e:
        tinyserve(["export", "no-such-model", str(tmp_path / "out2")])
    assert e.value.code == 2 and "no-such-model" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_gpt_exports_exactly(tmp_path):
    folder = STORE_ROOT / "gpt-wikitext2"
    _, tok = load_gpt(folder)
    exported = export_hf(folder, tmp_path / "hf")
    assert_same_model(folder, exported, tok.encode("The castle was built in", add_special_tokens=False).ids)
