"""The shipped GPT checkpoint: it loads from the store and writes English better than a unigram model."""

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_store.store import STORE_ROOT, list_checkpoints, load_gpt
from models.sampling import SamplingParams
from models.tokenizer import eos_id
from tests.conftest import FIXTURES
from training import SHARED_DATA
from training.data import detokenize_wikitext
from training.eos import eos_lengths
from training.variants import variant_overrides

pytestmark = pytest.mark.slow

SHIPPED = STORE_ROOT / "gpt-wikitext2"
WIKITEXT_TRAIN = SHARED_DATA / "wikitext-2-raw" / "train.txt"


def unigram_ppl(tokenizer, paragraph_ids: list[int]) -> tuple[float, str]:
    """Add-one-smoothed unigram perplexity: fitted on WikiText-2 train when present, else on the
    paragraph itself (an oracle that knows the paragraph's own token frequencies: a harder bar)."""
    if WIKITEXT_TRAIN.exists():
        train = detokenize_wikitext(WIKITEXT_TRAIN.read_text()[:2_000_000])  # the text the model was trained on
        counts = Counter(tokenizer.encode(train, add_special_tokens=False).ids)
        source = "wikitext-2 train"
    else:
        counts, source = Counter(paragraph_ids), "the paragraph itself"
    V, total = tokenizer.get_vocab_size(), sum(counts.values())
    nll = -sum(math.log((counts[t] + 1) / (total + V)) for t in paragraph_ids)
    return math.exp(nll / len(paragraph_ids)), source


def test_shipped_checkpoint_is_listed_valid():
    info = {i.id: i for i in list_checkpoints()}["gpt-wikitext2"]
    assert info.ok, info.error
    assert info.family.runner == "decoder"
    assert (SHIPPED / "model.safetensors").stat().st_size <= 30 * 2**20  # fp16; small enough for git


def test_shipped_checkpoint_beats_unigram_and_completes_fluently():
    model, tok = load_gpt(SHIPPED)
    # the fixture is in WikiText's tokenised form; the model reads plain English (docs/TRAINING.md)
    paragraph = detokenize_wikitext((FIXTURES / "heldout_paragraph.txt").read_text())
    ids = tok.encode(paragraph, add_special_tokens=False).ids
    x = torch.tensor([[eos_id(tok)] + ids[:-1]])
    with torch.no_grad():
        model_ppl = math.exp(F.cross_entropy(model(x).logits[0], torch.tensor(ids)).item())
    baseline, source = unigram_ppl(tok, ids)
    assert model_ppl < baseline / 3, f"model ppl {model_ppl:.1f} vs unigram ({source}) {baseline:.1f}"

    prompt = " The church was built in the"
    out = model.generate(torch.tensor([tok.encode(prompt).ids]), SamplingParams(max_new_tokens=30, temperature=0))
    text = tok.decode(out[0].tolist())
    words = text.split()
    assert len(words) >= 5, text
    assert sum(w.isalpha() or w in ",.'\"" or w.isdigit() for w in words) / len(words) > 0.7, text


def test_shipped_model_card_reports_perplexities():
    card = (SHIPPED / "README.md").read_text()
    assert "word-level ppl" in card and "Command: `python -m training gpt" in card
    assert Path(SHIPPED / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_shipped_attention_variants_restore_their_settings_and_generate():
    """The experiment's variant checkpoints (gpt-wikitext2-VARIANT) load as the variant they were trained as."""
    folders = sorted(STORE_ROOT.glob("gpt-wikitext2-*"))
    assert len(folders) >= 2, "at least two attention-variant checkpoints are shipped"
    for folder in folders:
        model, tok = load_gpt(folder)
        settings = variant_overrides(folder.name.removeprefix("gpt-wikitext2-"))
        assert {k: getattr(model.config, k) for k in settings} == settings, folder.name
        prompt = torch.tensor([tok.encode(" The church was built in the").ids])
        out = model.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0))
        assert out.shape[1] > 0, folder.name


def test_shipped_completions_read_as_english_and_end_with_their_paragraph():
    """Trained on detokenised WikiText with one document per paragraph: no ' @,@ ' or ' , ' in what it
    writes, EOS ends some 128-token completions by itself, and an EOS bias of -8 makes it go on."""
    model, tok = load_gpt(SHIPPED)
    plain, longer = eos_lengths(model, tok, "The castle was built in", biases=(0.0, -8.0), seeds=20)
    for text in plain.samples:
        for artefact in (" @-@ ", " @,@ ", " @.@ ", " , ", " 's ", " ."):
            assert artefact not in text, (artefact, text)
    assert plain.ended_share >= 0.2, plain
    assert longer.ended_share <= 0.1, longer
    assert longer.mean_tokens > plain.mean_tokens
