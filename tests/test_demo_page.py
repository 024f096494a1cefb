"""The demo page in a real headless Chromium (Debian's `chromium`, driven by Playwright) against the
real server process on tiny models: completion streams, fill-mask side by side, attention heatmap,
errors shown as the API's message. Screenshots go to $DEMO_SCREENSHOTS (default: the test's tmp dir).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import playwright.sync_api as playwright_api  # a dev dependency: the browser tests are never skipped
import pytest

from scripts.processes import http_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:  # `make test` installs it; a bare pytest run says what is missing instead of skipping
    pytest.fail("the browser tests need Debian's chromium: apt-get install chromium (make test does)", pytrace=False)


@pytest.fixture(scope="module")
def server(store):
    with http_server(store, api_token="demo-secret") as (base, _):
        yield base


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server, tmp_path):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.goto(server + "/")
    page.fill("#token", "demo-secret")
    page.dispatch_event("#token", "change")
    page.wait_for_function("document.querySelectorAll('#gen-model option').length > 0")
    yield page
    context.close()


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
    for asset in ("demo.js", "demo.css"):
        assert httpx.get(f"{server}/static/{asset}").status_code == 200
    assert httpx.post(server + "/generate", json={"inputs": "x"}).status_code == 401  # the API still needs it


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
