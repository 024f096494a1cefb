"""The demo page's "Look inside" tab in headless Chromium against the real server on tiny models: the
logit lens table, the each-head ablation grid whose cells ablate a head, patching's heatmap, the API
panel's request for what is on screen, and the API's errors."""

import json

import pytest

from tests.test_demo_page import browser, page, run_in_shell, server, shot, snippet  # noqa: F401

pytestmark = pytest.mark.browser

TEXT = "The town was built in"


def look(page, view: str, **fields) -> None:  # noqa: F811 (the page fixture)
    page.click("button[data-tab=inside]")
    page.select_option("#in-model", "tiny-gpt")
    page.select_option("#in-view", view)
    page.fill("#in-text", TEXT)
    for name, value in fields.items():
        page.fill(f"#in-{name}", value)
    page.click("#look")


def test_the_logit_lens_is_a_layers_by_positions_table_and_its_api_call(page, tmp_path):  # noqa: F811
    look(page, "lens")
    page.wait_for_selector("#inside-result table")
    columns = [c.text_content() for c in page.query_selector_all("#inside-result th.column")]
    rows = [r.text_content() for r in page.query_selector_all("#inside-result th.row-label")]
    assert rows == ["embedding", "after block 0", "after block 1"] and len(columns) > 2
    cells = page.query_selector_all("#inside-result td.value")
    assert len(cells) == len(rows) * len(columns)
    assert all(0 < float(c.get_attribute("data-value")) <= 1 for c in cells)
    assert "%" in cells[-1].get_attribute("title")  # hover: the top-k with probabilities
    assert '"model": "tiny-gpt"' in snippet(page, "httpx") and "/inspect/logit-lens" in snippet(page, "curl")
    assert "task=logit_lens" in snippet(page, "cog")
    answered = json.loads(run_in_shell(snippet(page, "curl")))
    assert answered["tokens"] == columns  # the snippet asks what the page shows
    shot(page, "inside-lens", tmp_path)


def test_each_heads_effect_is_a_grid_whose_cells_ablate_that_head(page, tmp_path):  # noqa: F811
    look(page, "ablate", heads="each")
    page.wait_for_selector("#inside-result td.pick")
    cells = page.query_selector_all("#inside-result td.pick")
    assert len(cells) == 2 * 4  # layers x heads of tiny-gpt
    assert all(float(c.text_content()) >= 0 for c in cells)
    shot(page, "inside-ablate", tmp_path)
    page.click("#inside-result td.pick[data-layer='1'][data-head='2']")
    page.wait_for_selector("#inside-result .inside-list")
    assert page.input_value("#in-heads") == "[[1,2]]"
    assert "KL(base || ablated)" in page.text_content("#inside-info")
    assert len(page.query_selector_all("#inside-result .inside-list")) == 2
    assert "task=ablate" in snippet(page, "cog") and "'heads=[[1,2]]'" in snippet(page, "cog")


def test_patching_is_a_layers_by_positions_heatmap(page, tmp_path):  # noqa: F811
    look(page, "patch", corrupt="The river was built in", answer=" the", foil=" of")
    page.wait_for_selector("#inside-result table")
    rows = [r.text_content() for r in page.query_selector_all("#inside-result th.row-label")]
    columns = page.query_selector_all("#inside-result th.column")
    assert rows == ["before block 0", "before block 1"]
    assert len(page.query_selector_all("#inside-result td.value")) == 2 * len(columns)
    assert "clean and" in page.text_content("#inside-info")
    shot(page, "inside-patch", tmp_path)


def test_a_bad_patch_shows_the_apis_message(page):  # noqa: F811
    look(page, "patch", corrupt="The river was built in the year", answer=" the", foil=" of")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error").startswith("corrupt:")


def test_clicking_heads_in_the_attention_grid_ablates_them(page):  # noqa: F811
    page.click("button[data-tab=attention]")
    page.select_option("#att-model", "tiny-gpt")
    page.fill("#att-text", TEXT)
    page.click("#show-attention")
    page.wait_for_selector("#head-grid .head-cell")
    page.check("#ablate-mode")
    page.click("#head-grid .head-cell[data-head='1']")
    page.wait_for_selector("#ablate-result:not([hidden]) .inside-list")
    assert "KL(base || ablated)" in page.text_content("#ablate-info")
    assert "[[0,1]]" in page.text_content("#ablate-lists").replace(" ", "")  # layer 0 (the first), head 1
    assert "ablated" in page.get_attribute("#head-grid .head-cell[data-head='1']", "class")
    assert page.input_value("#att-head") == "0"  # ablating does not enlarge the head
    page.click("#head-grid .head-cell[data-head='1']")  # again: nothing ablated
    page.wait_for_selector("#ablate-result", state="hidden")
