import pytest
import torch

from models.tokenizer import EOS_TOKEN, eos_id
from tests.conftest import TINY_WIKI
from training.data import (
    DataSourceError,
    detokenize_wikitext,
    encode_documents,
    random_windows,
    read_split,
    split_documents,
)


def test_tokenizer_round_trips_any_text(tiny_tokenizer):
    for text in ["The castle was built in 1350 .", "Ĉu vi parolas Esperanton? ĝis! 🙂", "  tabs\tand\nnewlines  ", ""]:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False).ids
        assert tiny_tokenizer.decode(ids) == text


def test_tokenizer_has_end_of_text_token(tiny_tokenizer):
    eos = eos_id(tiny_tokenizer)
    assert tiny_tokenizer.id_to_token(eos) == EOS_TOKEN
    assert tiny_tokenizer.encode(EOS_TOKEN, add_special_tokens=False).ids == [eos]  # one token, not split


def test_wikitext_documents_split_at_titles_not_sections():
    docs = split_documents(read_split(str(TINY_WIKI), "train"))
    assert len(docs) == 8
    assert all(d.startswith(" = ") and not d.startswith(" = = ") for d in docs)
    assert all(" = = History = = " in d for d in docs)


def test_stream_has_one_eos_after_each_document_and_no_padding(tiny_tokenizer):
    docs = split_documents(read_split(str(TINY_WIKI), "valid"))
    eos = eos_id(tiny_tokenizer)
    stream = encode_documents(docs, tiny_tokenizer, eos)
    assert int((stream == eos).sum()) == len(docs)
    assert stream[-1] == eos
    expected = sum(len(tiny_tokenizer.encode(d, add_special_tokens=False).ids) for d in docs) + len(docs)
    assert len(stream) == expected


def test_random_windows_are_shifted_by_one_and_seeded():
    stream = torch.arange(1000)
    x, y = random_windows(stream, 4, 16, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)
    x2, _ = random_windows(stream, 4, 16, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2)


def test_missing_corpus_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataSourceError, match="train.txt: no such file"):
        read_split(str(tmp_path), "train")
    with pytest.raises(DataSourceError, match="not a corpus folder"):
        read_split(str(tmp_path / "nope.txt"), "train")


@pytest.mark.slow
def test_hf_dataset_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the hub reads the variable once, at import (transformers imported it earlier in the session): without this
    # the call went to the network and waited out its retries (23 s)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataSourceError, match="Salesforce/wikitext:wikitext-2-raw-v1"):
        read_split("Salesforce/wikitext:wikitext-2-raw-v1", "train")


def test_wikitext_detokenizer_gives_plain_english():
    raw = (
        " = Valkyria Chronicles ( 2011 ) = \n \n"
        ' a population of 3 @,@ 500 , the city \'s role @-@ playing game ( see " The Nameless " ) ; it '
        "didn 't cost $ 5 @.@ 5 million : 40 % of the players ' budget . \n"
    )
    assert detokenize_wikitext(raw) == (
        "= Valkyria Chronicles (2011) =\n\n"
        'a population of 3,500, the city\'s role-playing game (see "The Nameless"); it '
        "didn't cost $5.5 million: 40% of the players' budget.\n"
    )


def test_detokenized_tiny_wiki_keeps_no_tokenisation_artefacts():
    text = detokenize_wikitext(read_split(str(TINY_WIKI), "train"))
    for artefact in (" @", " ,", " .", " 's", " )", "( ", " = = "):
        assert artefact not in text, artefact
    assert len(text.split()) < len(read_split(str(TINY_WIKI), "train").split())  # " , " no longer a word


def test_paragraph_documents_keep_headings_with_the_paragraph_after_them():
    text = "= Title =\n\nFirst paragraph.\nSecond paragraph.\n\n== History ==\n\nThird.\n"
    assert split_documents(text, "wikitext-paragraph") == [
        "= Title =\nFirst paragraph.",
        "Second paragraph.",
        "== History ==\nThird.",
    ]
    assert split_documents(text, "wikitext-paragraph-headings-apart") == [
        "= Title =",
        "First paragraph.",
        "Second paragraph.",
        "== History ==",
        "Third.",
    ]
