"""A user's text as a corpus folder the trainer reads: one UTF-8 text file, or a zip of them, split into
paragraphs (blank-line blocks), the last tenth of them held out for validation and test. Empty, binary or
oversized input is refused in one line (ValueError)."""

from __future__ import annotations

import zipfile
from pathlib import Path

MAX_BYTES = 200 * 2**20  # the text the trainer holds in memory, tokenized, at most


def read_texts(path: Path) -> str:
    """The text of a .txt file or of every text file in a zip, one after another."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            names = [i for i in z.infolist() if not i.is_dir()]
            if sum(i.file_size for i in names) > MAX_BYTES:
                raise ValueError(f"text: the zip holds more than {MAX_BYTES >> 20} MB")
            return "\n\n".join(decoded(z.read(i), i.filename) for i in names)
    if path.stat().st_size > MAX_BYTES:
        raise ValueError(f"text: more than {MAX_BYTES >> 20} MB")
    return decoded(path.read_bytes(), path.name)


def decoded(data: bytes, name: str) -> str:
    if b"\x00" in data:
        raise ValueError(f"text: {name} is binary, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text: {name} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def corpus_folder(path: Path, out: Path) -> Path:
    """`out` with train.txt, valid.txt and test.txt (the held-out tenth, as both) from the user's text."""
    paragraphs = [p.strip() for p in read_texts(path).split("\n\n") if p.strip()]
    if len(paragraphs) < 2:
        raise ValueError("text: give at least two paragraphs (blocks separated by a blank line)")
    held = max(1, len(paragraphs) // 10)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n\n".join(paragraphs[:-held]) + "\n")
    for split in ("valid", "test"):
        (out / f"{split}.txt").write_text("\n\n".join(paragraphs[-held:]) + "\n")
    return out
