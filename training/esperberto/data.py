"""Esperanto corpus, its byte-level BPE tokenizer (RoBERTa's special tokens), and fixed-length MLM blocks.

The corpus is every `*.txt` in a folder (../shared/data/esperanto: one paragraph per line) or, when
online, the original study's Hugging Face dataset `chriswmurphy/esperanto`. Every `holdout_every`-th
line goes to the validation split, so the split is deterministic and never trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import RobertaTokenizer

from training.data import DataSourceError, _read_hf_dataset
from training.tokenizer import train_bpe

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, as in RoBERTa


def read_corpus(source: str) -> list[str]:
    """Non-empty lines of every *.txt in a folder (sorted by name), or of an HF dataset's train split."""
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DataSourceError(f"{path}: no *.txt files")
        text = "".join(f.read_text(encoding="utf-8") for f in files)
    elif "/" in source and not path.suffix:
        text = _read_hf_dataset(source, "train")
    else:
        raise DataSourceError(f"{source}: not a folder of .txt files, nor a dataset id like 'chriswmurphy/esperanto'")
    return [line.strip() for line in text.splitlines() if line.strip()]


def split_lines(lines: list[str], holdout_every: int = 50) -> tuple[list[str], list[str]]:
    """(train, valid): line i is held out when i % holdout_every == 0."""
    train = [ln for i, ln in enumerate(lines) if i % holdout_every]
    valid = [ln for i, ln in enumerate(lines) if i % holdout_every == 0]
    return train, valid


def train_roberta_tokenizer(lines: list[str], vocab_size: int) -> RobertaTokenizer:
    """Byte-level BPE with RoBERTa's special tokens, as a transformers RobertaTokenizer."""
    bpe = json.loads(train_bpe(lines, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS).to_str())["model"]
    # "<mask>" swallows the space before it, as in RoBERTa: "La suno <mask>." masks the word " brilas"
    mask = AddedToken("<mask>", lstrip=True, rstrip=False, special=True, normalized=False)
    return RobertaTokenizer(vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]], mask_token=mask)


def encode_blocks(lines: list[str], tokenizer: RobertaTokenizer, block_size: int) -> torch.Tensor:
    """(N, block_size) blocks: <s> tokens </s>, cut from the stream of all lines, each ending in </s>.

    Grouping lines instead of padding each one keeps every position a real token (as run_mlm does).
    """
    stream: list[int] = []
    for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    inner = block_size - 2
    n = len(stream) // inner
    body = torch.tensor(stream[: n * inner], dtype=torch.long).view(n, inner)
    bos = torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long)
    eos = torch.full((n, 1), tokenizer.eos_token_id, dtype=torch.long)
    return torch.cat([bos, body, eos], dim=1)
