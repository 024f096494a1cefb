"""Corpora as token streams.

A corpus is read from a folder of `{split}.txt` files (e.g. ../shared/data/wikitext-2-raw) or, when
online, from a Hugging Face dataset ("Salesforce/wikitext:wikitext-2-raw-v1"). It is split into
documents, each followed by the end-of-text token, and concatenated into one stream that training
cuts into fixed windows. Nothing is padded: the original project padded every line with pad = EOS
tokens and taught its model to stop early.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, get_args

import torch
from tokenizers import Tokenizer

WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")  # " = Title = " starts an article; " = = Sec = = " does not
HEADING = re.compile(r"^ ?=[ =]*[^=].*= ?$")  # a heading line, tokenised (" = = Sec = = ") or not ("== Sec ==")

# WikiText's tokenisation, undone line by line (in this order): split numbers, then punctuation spacing
_DETOKENIZE_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r" @([-,.])@ "), r"\1"),  # 3 @,@ 500 -> 3,500; role @-@ playing -> role-playing
    (re.compile(r" ([,.;:!?%)\]}])"), r"\1"),  # no space before closing punctuation
    (re.compile(r"([(\[{$]) "), r"\1"),  # none after opening brackets or a dollar sign
    (re.compile(r" (n't|'s|'re|'ve|'ll|'d|'m|'t)\b"), r"\1"),  # the city 's -> the city's; don 't -> don't
    (re.compile(r"(\w) ' (?=\w)"), r"\1' "),  # plural possessive: players ' turns -> players' turns
    (re.compile(r" ([°])"), r"\1"),
]
_QUOTE = re.compile(r'(^| )" ')  # candidates for an opening double quote


def prepare_text(raw: str, detokenize: bool) -> str:
    """A split as the model sees it: WikiText's tokenisation undone, or the raw text."""
    return detokenize_wikitext(raw) if detokenize else raw


def _join_quotes(line: str) -> str:
    """Rejoin WikiText's spaced double quotes pairwise in a line: 'a " b c " d' -> 'a "b c" d'."""
    parts = line.split(' " ')
    if len(parts) < 3:
        return line
    out = parts[0]
    for i, part in enumerate(parts[1:]):
        out += (' "' if i % 2 == 0 else '" ') + part  # odd quotes open, even quotes close
    return out


def _detokenize_line(line: str) -> str:
    line = _join_quotes(f" {line.strip()} ").strip()
    for pattern, repl in _DETOKENIZE_RULES:
        line = pattern.sub(repl, line)
    return line


def _heading(line: str) -> str:
    """' = = Early life ( 1900 ) = = ' -> '== Early life (1900) =='."""
    level = line.strip().split(" ").count("=") // 2
    title = _detokenize_line(line.strip().strip("= "))
    return f"{'=' * level} {title} {'=' * level}"


def detokenize_wikitext(text: str) -> str:
    """WikiText's tokenised text as plain English: '3 @,@ 500' -> '3,500', 'city 's' -> "city's",
    ' , ' -> ', ', spaced quotes rejoined, ' = = Sec = = ' -> '== Sec =='; line breaks are kept."""
    lines = []
    for line in text.split("\n"):
        if not line.strip():
            lines.append("")
            continue
        lines.append(_heading(line) if HEADING.match(line) else _detokenize_line(line))
    return "\n".join(lines)


class DataSourceError(RuntimeError):
    """The corpus cannot be read (missing file, unknown dataset, offline)."""


def read_split(source: str, split: str) -> str:
    """Raw text of one split ("train", "valid", "test") from a folder or a Hugging Face dataset id."""
    path = Path(source)
    if path.is_dir():
        f = path / f"{split}.txt"
        if not f.is_file():
            raise DataSourceError(f"{f}: no such file (a corpus folder holds train.txt, valid.txt, test.txt)")
        return f.read_text(encoding="utf-8")
    if path.suffix == ".txt" or "/" not in source and ":" not in source:
        raise DataSourceError(
            f"{source}: not a corpus folder, and not a dataset id like 'Salesforce/wikitext:wikitext-2-raw-v1'"
        )
    return _read_hf_dataset(source, split)


def _read_hf_dataset(dataset_id: str, split: str) -> str:
    name, _, config = dataset_id.partition(":")
    try:
        import datasets
    except ImportError:
        raise DataSourceError(f"{dataset_id}: reading a Hugging Face dataset needs `pip install datasets`") from None
    hf_split = {"valid": "validation"}.get(split, split)
    try:
        ds = datasets.load_dataset(name, config or None, split=hf_split)
    except Exception as e:  # offline, unknown id, unknown split: all reported the same way
        raise DataSourceError(
            f"{dataset_id}: could not load split {hf_split!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Offline? Pass a local folder with train.txt/valid.txt/test.txt instead."
        ) from None
    return "".join(line if line.endswith("\n") else line + "\n" for line in ds["text"])


# articles at ' = Title = ' lines; WikiText body lines (headings joined to the line after them, or documents of
# their own); blank-line blocks; lines
DocMode = Literal["wikitext", "wikitext-paragraph", "wikitext-paragraph-headings-apart", "paragraph", "line"]


def split_documents(text: str, mode: DocMode = "wikitext") -> list[str]:
    """Cut raw text into documents: WikiText articles (at ' = Title = ' lines), WikiText paragraphs (each
    body line, after the headings above it, or with every heading a document of its own), blank-line
    blocks, or lines."""
    if mode == "wikitext":
        docs, current = [], []
        for line in text.splitlines(keepends=True):
            if WIKITEXT_TITLE.match(line.rstrip("\n")) and any(s.strip() for s in current):
                docs.append("".join(current))
                current = []
            current.append(line)
        docs.append("".join(current))
    elif mode in ("wikitext-paragraph", "wikitext-paragraph-headings-apart"):
        docs, headings = [], []
        for line in text.splitlines():
            if not line.strip():
                continue
            if HEADING.match(line) and mode == "wikitext-paragraph":
                headings.append(line.strip())
            else:
                docs.append("\n".join([*headings, line.strip()]))
                headings = []
    elif mode == "paragraph":
        docs = re.split(r"\n\s*\n", text)
    elif mode == "line":
        docs = text.splitlines()
    else:
        raise ValueError(f"unknown document mode {mode!r}: one of {', '.join(get_args(DocMode))}")
    return [d for d in docs if d.strip()]


def encode_documents(docs: list[str], tokenizer: Tokenizer, eos_id: int) -> torch.Tensor:
    """One flat (N,) int64 stream: doc tokens, EOS, doc tokens, EOS, ..."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(
    stream: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (B, context) inputs and next-token targets from random offsets of the stream."""
    starts = torch.randint(0, len(stream) - context - 1, (batch_size,), generator=generator)
    x = torch.stack([stream[s : s + context] for s in starts.tolist()])
    y = torch.stack([stream[s + 1 : s + 1 + context] for s in starts.tolist()])
    return x, y
