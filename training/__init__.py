"""Builds the checkpoints: the from-scratch GPT, EsperBERTo, their tokenizers, data and reports."""

from pathlib import Path

# the corpora (../shared/data next to the repository; see its README for sources and licenses)
SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
WIKITEXT2 = SHARED_DATA / "wikitext-2-raw"  # the GPT's corpus
