"""The shipped EsperBERTo checkpoints: both variants load as themselves, read word order, and fill masks with verbs.

tests/fixtures/esperanto_heldout.txt is 50 paragraphs of the corpus's held-out split (every 50th line,
never trained on; public-domain works, see shared/data/README.md).
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

import models.esperberto  # noqa: F401  (registers softmax1)
from model_store.store import STORE_ROOT, list_checkpoints
from tests.conftest import FIXTURES
from training.esperberto.data import encode_blocks
from training.esperberto.train import evaluate_mlm

pytestmark = pytest.mark.slow

VARIANTS = ("softmax0", "softmax1")
VERB_ENDINGS = ("as", "is", "os", "us")  # Esperanto present, past, future, conditional


def folder(variant: str) -> Path:
    return STORE_ROOT / f"esperberto-{variant}"


@pytest.fixture(scope="module", params=VARIANTS)
def shipped(request):
    path = folder(request.param)
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    return request.param, model, AutoTokenizer.from_pretrained(path)


def test_both_checkpoints_are_listed_valid_and_small():
    infos = {i.id: i for i in list_checkpoints()}
    for variant in VARIANTS:
        info = infos[f"esperberto-{variant}"]
        assert info.ok and info.family.kind == "mlm", info.error
        assert (folder(variant) / "model.safetensors").stat().st_size <= 25 * 2**20


def test_variant_is_restored_on_load(shipped):
    variant, model, _ = shipped
    assert model.config.attention_variant == variant
    assert (model.config._attn_implementation == "softmax1") == (variant == "softmax1")


def test_reads_word_order_on_heldout_text(shipped):
    _, model, tok = shipped
    lines = (FIXTURES / "esperanto_heldout.txt").read_text().splitlines()
    with torch.no_grad():
        h = evaluate_mlm(model, tok, encode_blocks(lines, tok, 128))
    assert h["order_gap"] > 0.5, h  # a bag-of-words model scores ~0
    assert h["top5_accuracy"] > 0.45, h


@pytest.mark.parametrize("text", ["Mi <mask> vin.", "La suno <mask>."])
def test_fill_mask_proposes_verbs(shipped, text):
    _, model, tok = shipped
    words = [r["token_str"].strip() for r in pipeline("fill-mask", model=model, tokenizer=tok)(text, top_k=5)]
    assert sum(w.endswith(VERB_ENDINGS) for w in words) >= 3, words


def test_model_card_shows_heldout_figures_and_examples():
    for variant in VARIANTS:
        card = (folder(variant) / "README.md").read_text()
        assert "order gap" in card and "| `Mi <mask> vin.` |" in card, variant
        assert (folder(variant) / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
