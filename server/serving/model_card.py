"""Model cards for the demo page: the card's Markdown rendered to HTML, and the images it links to.

A client can read a checkpoint's card and the images the card itself links by a plain file name in
the checkpoint's folder (its loss curve), nothing else of the store: raw HTML in a card is escaped and
links are checked by markdown-it (no `javascript:`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.token import Token

IMAGE_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
}
PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

_markdown = MarkdownIt("commonmark", {"html": False}).enable("table")


def _images(tokens: list[Token]) -> Iterator[Token]:
    for token in tokens:
        if token.type == "image":
            yield token
        if token.children:
            yield from _images(token.children)


def is_card_image_name(name: str) -> bool:
    """A file name in the checkpoint's own folder with an image suffix (no folders, no `..`)."""
    return bool(PLAIN_NAME.match(name)) and ".." not in name and Path(name).suffix.lower() in IMAGE_TYPES


@lru_cache(maxsize=64)  # a served card never changes: parse it once, not per image request
def linked_images(card: str) -> frozenset[str]:
    """The image names the card links to that a client may fetch."""
    srcs = (str(t.attrGet("src")) for t in _images(_markdown.parse(card)))
    return frozenset(src for src in srcs if is_card_image_name(src))


def render_html(card: str, image_url: Callable[[str], str]) -> str:
    """The card as an HTML fragment; its own images point at `image_url(name)`."""
    tokens = _markdown.parse(card)
    for token in _images(tokens):
        src = str(token.attrGet("src"))
        if is_card_image_name(src):
            token.attrSet("src", image_url(src))
    return _markdown.renderer.render(tokens, _markdown.options, {})


def card_image(folder: Path, card: str, name: str) -> Path | None:
    """The path of a linked image that exists, or None (the route answers 404)."""
    if name not in linked_images(card):
        return None
    path = folder / name
    return path if path.is_file() and path.resolve().parent == folder.resolve() else None
