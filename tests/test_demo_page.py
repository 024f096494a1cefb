"""The demo page in a real headless Chromium (Debian's `chromium`, driven by Playwright) against the
real server process on tiny models: completion streams, fill-mask side by side, the attention explorer,
the model card, the API panel's snippets run in a shell, shared links and examples, errors shown as the
API's message. Screenshots go to $DEMO_SCREENSHOTS (default: the test's tmp dir).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qsl

import httpx
import playwright.sync_api as playwright_api  # a dev dependency: the browser tests are never skipped
import pytest

from scripts.cog_predict import SCHEMA_PATH, parse_inputs
from scripts.processes import REPO, http_server
from tests.conftest import DEMO_CARD, DEMO_TOKEN

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.browser


TOKEN, CARD = DEMO_TOKEN, DEMO_CARD


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server  # the demo store's server process (conftest.py), one for the session's browser tests


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:  # `make test` installs it; a bare pytest run says what is missing instead of skipping
        pytest.fail("the browser tests need Debian's chromium: apt-get install chromium (make test does)", False)
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server, tmp_path):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.goto(server + "/")
    login(page)
    yield page
    context.close()


def login(page) -> None:
    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")
    page.wait_for_function("document.querySelectorAll('#gen-model option').length > 0")


def finished(page) -> None:
    page.wait_for_function(
        "['length', 'eos_token', 'stop_sequence'].includes(document.querySelector('#finish-reason').textContent)",
        timeout=30_000,
    )


def snippet(page, kind: str) -> str:
    return page.text_content(f"#snippets .snippet[data-kind={kind}] pre")


def python(code: str) -> str:
    """A Python snippet as a shell command: pasted into `python -` through a here-document."""
    return f"python - <<'EOF'\n{code}\nEOF"


def run_in_shell(command: str) -> str:
    """A snippet pasted into bash, with the token in the environment and the repo's venv first on PATH."""
    env = {**os.environ, "TINYSERVE_API_TOKEN": TOKEN, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def shot(page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("DEMO_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=folder / f"demo-{name}.png", full_page=True)
    assert (folder / f"demo-{name}.png").stat().st_size > 10_000


def test_page_and_assets_work_offline(server):
    import httpx

    html = httpx.get(server + "/").text
    assert "/static/demo.js" in html and "/static/demo.css" in html
    assert "http://" not in html.replace(server, "") and "https://" not in html  # nothing from a CDN
    modules = ("demo.js", "api.js", "complete.js", "requests.js", "snippets.js", "share.js", "card.js", "attention.js")
    for asset in (*modules, "demo.css", "examples.json"):
        response = httpx.get(f"{server}/static/{asset}")
        assert response.status_code == 200
        assert "https://" not in response.text
    assert httpx.post(server + "/generate", json={"inputs": "x"}).status_code == 401  # the API still needs it
    assert httpx.get(server + "/models/tiny-gpt/card").status_code == 401  # the card too


def test_completion_streams_into_the_page(page, tmp_path):
    page.fill("#prompt", "The castle was")
    page.fill("#max_new_tokens", "30")
    page.fill("#eos_bias", "-20")  # the tiny model should not stop early
    page.fill("#seed", "7")
    # count the separate updates of the output (one per streamed token event; a burst of events read
    # in one network chunk comes to the observer as one callback with many records)
    page.evaluate(
        """() => { window.updates = 0; new MutationObserver((records) => { window.updates += records.length; })
            .observe(document.querySelector('#completion .generated'), {childList: true, characterData: true,
            subtree: true}); }"""
    )
    page.click("#generate")
    page.wait_for_function(
        "['length', 'eos_token', 'stop_sequence'].includes(document.querySelector('#finish-reason').textContent)",
        timeout=30_000,
    )
    assert page.text_content("#finish-reason") == "length"
    assert int(page.text_content("#gen-count")) == 30
    assert len(page.text_content("#completion .generated")) > 0
    assert page.evaluate("window.updates") >= 10  # rendered event by event, not once at the end
    assert page.is_hidden("#error")
    shot(page, "completion", tmp_path)


def test_fill_mask_side_by_side(page, tmp_path):
    page.click("button[data-tab=fillmask]")
    page.fill("#mask-text", "The <mask> was built.")
    page.fill("#mask-topk", "4")
    page.click("#fill")
    page.wait_for_selector(".candidates[data-model=tiny-mlm-softmax1]")
    columns = page.query_selector_all(".candidates")
    assert [c.get_attribute("data-model") for c in columns] == ["tiny-mlm-softmax0", "tiny-mlm-softmax1"]
    for c in columns:
        assert len(c.query_selector_all("li")) == 4
        assert "%" in c.query_selector("li .label").text_content()
    shot(page, "fill-mask", tmp_path)


def test_attention_heatmap_hover_and_png(page, tmp_path):
    page.click("button[data-tab=attention]")
    page.select_option("#att-model", "tiny-gpt")
    page.select_option("#att-layer", "1")
    page.select_option("#att-head", "0")
    page.fill("#att-text", "The castle was built")
    page.click("#show-attention")
    page.wait_for_selector("#heatmap .cell")
    n_tokens = len(page.query_selector_all("#heatmap .key"))
    cells = page.query_selector_all("#heatmap .cell")
    assert n_tokens > 1 and len(cells) == n_tokens * n_tokens
    weights = [float(c.get_attribute("data-weight")) for c in cells]
    assert weights[1] == 0.0  # causal: the first token cannot see the second
    assert abs(sum(weights[:n_tokens]) - 1.0) < 1e-3  # a softmax row
    cells[n_tokens + 1].hover()
    assert "→" in page.text_content("#hover-info")
    page.wait_for_selector("#png-link:not([hidden])")
    png_size = page.evaluate("async () => (await (await fetch(document.querySelector('#png-link').href)).blob()).size")
    assert png_size > 1000
    shot(page, "attention", tmp_path)


def test_bad_input_shows_the_api_message(page):
    page.click("button[data-tab=fillmask]")
    page.fill("#mask-text", "No mask in this sentence.")
    page.click("#fill")
    page.wait_for_selector("#error:not([hidden])")
    assert "inputs: no <mask> token" in page.text_content("#error")
    assert "Traceback" not in page.text_content("#error")


def test_model_labels_name_the_attention_variant_and_relational_heads(browser, tmp_path_factory, tiny_tokenizer):
    from model_store.store import write_checkpoint
    from models.tokenizer import eos_id
    from tests.conftest import tiny_gpt

    root = tmp_path_factory.mktemp("variant-store")
    vocab, eos = tiny_tokenizer.get_vocab_size(), eos_id(tiny_tokenizer)
    dual = tiny_gpt(vocab_size=vocab, eos_token_id=eos, n_head=2, n_relational_head=2, positions="rope")
    write_checkpoint(root / "tiny-dual", dual, tiny_tokenizer, card="# dual\n", metrics={})
    with http_server(root) as (base, _):
        page = browser.new_page()
        page.goto(base + "/")
        page.wait_for_function("document.querySelectorAll('#att-head option').length > 0")
        label = page.locator("#gen-model option").first.text_content()
        assert "rope positions" in label and "2 self + 2 relational heads" in label, label
        heads = page.locator("#att-head option").all_text_contents()
        assert heads == ["0", "1", "2 (relational)", "3 (relational)"]
        page.close()


def show_layer(page, model: str, layer: int, text: str) -> None:
    page.click("button[data-tab=attention]")
    page.select_option("#att-model", model)
    page.select_option("#att-layer", str(layer))
    page.fill("#att-text", text)
    page.click("#show-attention")
    page.wait_for_selector("#head-grid .head-cell")


def test_attention_explorer_shows_every_head_of_the_layer(page, server):
    heads = httpx.get(server + "/models/tiny-gpt", headers={"Authorization": f"Bearer {TOKEN}"}).json()["heads"]
    show_layer(page, "tiny-gpt", 1, "The castle was built")
    cells = page.query_selector_all("#head-grid .head-cell")
    assert len(cells) == heads > 1
    assert [c.get_attribute("aria-pressed") for c in cells] == ["true"] + ["false"] * (heads - 1)
    assert all(c.query_selector("canvas") for c in cells)
    first = [c.get_attribute("data-weight") for c in page.query_selector_all("#heatmap .cell")]
    cells[1].focus()  # the keyboard enlarges a head too
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#att-head').value === '1'")
    assert page.get_attribute("#head-grid .head-cell[data-head='1']", "aria-pressed") == "true"
    assert "head 1" in page.text_content("#hover-info")
    assert [c.get_attribute("data-weight") for c in page.query_selector_all("#heatmap .cell")] != first
    # hovering a token highlights its row and column (and both labels)
    n = len(page.query_selector_all("#heatmap .key"))
    page.hover("#heatmap .key[data-k='2']")
    assert len(page.query_selector_all("#heatmap .cell.hl")) == 2 * n - 1
    assert (
        page.query_selector("#heatmap .query.hl").text_content()
        == page.query_selector("#heatmap .key.hl").text_content()
    )
    # softmax0: no share on nothing is claimed
    assert page.query_selector("#head-grid .head-cell[data-nothing]") is None


def test_softmax1_heads_show_their_mass_on_nothing(page, server):
    show_layer(page, "tiny-mlm-softmax1", 0, "La suno brilas.")
    assert page.query_selector("#head-grid .head-cell[data-nothing]") is not None
    api = httpx.post(
        server + "/attention",
        json={"model": "tiny-mlm-softmax1", "text": "La suno brilas.", "layers": [0]},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()
    shown = [float(c.get_attribute("data-nothing")) for c in page.query_selector_all("#head-grid .head-cell")]
    assert shown == pytest.approx([1 - s for s in api["row_sums"][0]], abs=1e-4)
    assert "on nothing" in page.text_content("#head-grid .head-cell")
    shot(page, "attention-grid", Path(os.environ.get("DEMO_SCREENSHOTS", "/tmp")))


def test_model_card_tab_renders_the_card_and_its_image(page, server):
    page.select_option("#gen-model", "tiny-gpt")
    page.click("button[data-tab=card]")
    page.wait_for_selector("#card-body h1")
    assert page.text_content("#card-body h1") == "tiny gpt"
    assert page.query_selector_all("#card-body table td")[0].text_content() == "valid"
    page.wait_for_function("document.querySelector('#card-body img').naturalWidth > 100")  # fetched with the token
    assert "<script>" in page.text_content("#card-body")  # shown as text, never run
    assert page.evaluate("window.cardScriptRan") is None
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert (
        httpx.get(server + "/models/tiny-gpt/card/loss_curve.png", headers=auth).headers["content-type"] == "image/png"
    )
    for name in ("secret.png", "config.json", "model.safetensors", "..loss_curve.png"):
        response = httpx.get(f"{server}/models/tiny-gpt/card/{name}", headers=auth)
        assert response.status_code == 404 and response.json()["field"] == "name", name
    outside = httpx.get(f"{server}/models/tiny-gpt/card/..%2F..%2Ftiny-mlm-softmax0%2FREADME.md", headers=auth)
    assert outside.status_code == 404 and "tiny softmax0" not in outside.text


def complete_seeded(page, prompt: str, max_new_tokens: int, seed: int, **sliders: str) -> str:
    """A seeded completion of tiny-gpt through the page (EOS bias -20: the tiny model runs to the limit)."""
    page.select_option("#gen-model", "tiny-gpt")
    page.fill("#prompt", prompt)
    for field, value in {
        "max_new_tokens": str(max_new_tokens),
        "eos_bias": "-20",
        "seed": str(seed),
        **sliders,
    }.items():
        page.fill(f"#{field}", value)
    page.click("#generate")
    finished(page)
    return page.text_content("#completion .generated")


def test_api_snippets_run_in_a_shell_and_reproduce_the_page(page):
    on_page = complete_seeded(page, "The castle was", 12, 5, temperature="0.9", top_k="20")
    curl = json.loads(run_in_shell(snippet(page, "curl")))
    assert curl["generated_text"] == on_page
    assert run_in_shell(python(snippet(page, "openai"))) == on_page + "\n"
    hf = snippet(page, "inference-client")
    assert "no argument for eos_bias=-20" in hf  # says what it cannot send
    assert run_in_shell(python(hf)).strip() != ""
    cog = shlex.split(snippet(page, "cog").replace("\\\n", " "))
    assert cog[:2] == ["cog", "run"]  # cog 0.23 renamed predict to run
    inputs = parse_inputs([cog[i + 1] for i in range(2, len(cog), 2)], json.loads(SCHEMA_PATH.read_text()))
    assert inputs == {
        "prompt": "The castle was",
        "model": "tiny-gpt",
        "max_new_tokens": 12,
        "temperature": 0.9,
        "top_k": 20,
        "top_p": 0.95,
        "seed": 5,
        "eos_bias": -20.0,
    }
    assert TOKEN not in page.text_content("#snippets")  # the token stays in the environment

    page.click("button[data-tab=fillmask]")
    page.fill("#mask-text", "La <mask> brilas.")
    result = json.loads(run_in_shell(snippet(page, "curl")))
    assert set(result["results"]) == {"tiny-mlm-softmax0", "tiny-mlm-softmax1"}
    printed = run_in_shell(python(snippet(page, "httpx")))
    assert "tiny-mlm-softmax1" in printed

    page.click("button[data-tab=attention]")
    page.select_option("#att-model", "tiny-gpt")
    page.fill("#att-text", "The castle")
    result = json.loads(run_in_shell(snippet(page, "curl")))
    assert result["model"] == "tiny-gpt" and len(result["attention"][0][0]) > 1  # every head of the layer
    assert "tiny-gpt" in run_in_shell(python(snippet(page, "httpx")))

    page.click("button[data-tab=card]")  # the card of the model on screen, as JSON
    page.wait_for_selector("#card-body h1")
    assert json.loads(run_in_shell(snippet(page, "curl")))["card"] == CARD
    shot(page, "api", Path(os.environ.get("DEMO_SCREENSHOTS", "/tmp")))


def test_shared_link_restores_the_inputs_and_the_seeded_output(page, browser, server):
    original = complete_seeded(page, "The king's castle & the town", 10, 42)
    page.click("#share")
    link = page.input_value("#share-link")
    assert link.startswith(server + "/#") and TOKEN not in link
    state = dict(parse_qsl(link.split("#", 1)[1]))
    assert state["prompt"] == "The king's castle & the town" and state["seed"] == "42"

    context = browser.new_context()
    other = context.new_page()
    other.goto(link)
    login(other)  # the recipient types their token: the link never carries it
    finished(other)
    assert other.input_value("#prompt") == "The king's castle & the town"
    assert other.input_value("#max_new_tokens") == "10" and other.input_value("#eos_bias") == "-20"
    assert other.text_content("#completion .generated") == original
    context.close()


def test_examples_load_into_the_form_and_run(page):
    examples = json.loads((REPO / "server" / "api" / "static" / "examples.json").read_text())
    assert {"complete", "fillmask", "attention"} <= set(examples)
    page.click("button[data-tab=fillmask]")
    buttons = page.query_selector_all("#examples-fillmask .example")
    assert [b.text_content() for b in buttons] == [e["title"] for e in examples["fillmask"]]
    buttons[0].click()
    page.wait_for_selector(".candidates li")
    assert page.input_value("#mask-text") == dict(parse_qsl(examples["fillmask"][0]["link"][1:]))["text"]
    page.click("button[data-tab=complete]")
    page.click("#examples-complete .example >> nth=0")
    finished(page)
    assert page.input_value("#prompt") == dict(parse_qsl(examples["complete"][0]["link"][1:]))["prompt"]
