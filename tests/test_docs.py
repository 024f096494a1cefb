"""The docs name files that exist: every repository path in README.md and docs/ (code spans, prose, links), and
the request paths of docs/ARCHITECTURE.md in the order a request meets them."""

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
TOP = ("server", "models", "model_store", "training", "tests", "bench", "scripts", "docs", "deploy", ".ci", ".cog")
ROOT_FILES = ("predict.py", "cog.yaml", "Dockerfile", "Makefile", "README.md", "pyproject.toml", "requirements.txt",
              "constraints.txt")  # fmt: skip
# a path that starts at one of the repository's folders (or is one of its root files), as docs write them
PATH = re.compile(
    r"(?<![\w./~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*[\w/]"
    r"|(?:" + "|".join(re.escape(f) for f in ROOT_FILES) + r"))(?![\w*<{-])"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ANCHOR = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")


def named_paths(text: str) -> list[str]:
    """The repository paths a text names; a path through a placeholder (model_store/NAME) or a glob is none."""
    paths = [m.group(1).rstrip(".") for m in PATH.finditer(text)]
    return [p for p in paths if not any(part.isupper() for part in p.split("/"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_doc_names_exists(doc: Path):
    text = doc.read_text()
    missing = [p for p in named_paths(text) if not (REPO / p).exists()]
    links = [link for link in LINK.findall(text) if "://" not in link and not link.startswith("mailto:")]
    missing += [link for link in links if not (doc.parent / link).exists()]
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {sorted(set(missing))}"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_anchor_a_doc_links_is_a_heading_there(doc: Path):
    broken = []
    for target, name in ANCHOR.findall(doc.read_text()):
        linked = (doc.parent / target) if target else doc
        if "://" in target or not linked.is_file():
            continue  # an outside link, or a missing file (the test above names it)
        headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
        if name not in {anchor(h) for h in headings}:
            broken.append(f"{target}#{name}")
    assert not broken, f"{doc.relative_to(REPO)} links anchors with no heading: {broken}"


def test_an_anchor_is_githubs():
    assert anchor("EsperBERTo: `esperberto-softmax0`, `esperberto-softmax1`") == (
        "esperberto-esperberto-softmax0-esperberto-softmax1"
    )
    assert anchor("Cog (Replicate)") == "cog-replicate" and anchor("HTTP path") == "http-path"


def steps(text: str, heading: str) -> str:
    """The numbered steps under a heading."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    lines = text[start : end if end != -1 else None].splitlines()
    return "\n".join(line for line in lines if re.match(r"(\d+\.| {3})", line))


@pytest.mark.parametrize(
    "heading, first, last",
    [
        ("## A request's path: `POST /generate`", "server/api/app.py", "server/api/routers/sse.py"),
        ("## `POST /v1/chat/completions` with a JSON schema", "server/api/app.py", "server/api/routers/sse.py"),
    ],
)
def test_architectures_request_paths_go_from_the_app_to_the_wire(heading, first, last):
    """Each request path names real files, from the app in (the first) to the wire format out (the last), and
    passes every layer of server/ on the way: api, features, serving or engine, execution."""
    paths = [p for p in named_paths(steps((REPO / "docs/ARCHITECTURE.md").read_text(), heading)) if "." in p]
    assert paths[0] == first and paths[-1] == last, paths
    assert all((REPO / p).exists() for p in paths), paths
    layers = [p.split("/")[1] for p in paths if p.startswith("server/") and "/" in p[len("server/") :]]
    assert layers[0] == "api" and {"features", "serving", "engine", "execution"} <= set(layers), layers


def test_the_path_pattern_finds_what_docs_write():
    found = named_paths(
        "see `server/engine/core.py: submit`, server/api/ and predict.py; not ~/.cache/x.py, bench/bench_*.py or"
        " model_store/NAME"
    )
    assert found == ["server/engine/core.py", "server/api/", "predict.py"]
