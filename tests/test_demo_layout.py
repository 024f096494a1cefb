"""The demo page's layout in a real browser (Debian's chromium through Playwright): it fits a laptop's
and a phone's window on every tab, with every tab's result on screen."""

import shutil

import pytest

from model_store.store import write_checkpoint
from models.tokenizer import eos_id
from scripts.processes import http_server
from tests.conftest import tiny_gpt
from tests.test_demo_page import TOKEN, browser, finished, login, shot  # noqa: F401 (the page's fixtures)

pytestmark = pytest.mark.browser

# The shipped store's longest model label, "gpt-wikitext2-dual-relative (softmax0, 2 self + 2 relational heads)",
# and then some: a <select> is as wide as its longest option, which made the page 518 px wide on a phone.
LONG_MODEL = "gpt-wikitext2-dual-relative"

# What sticks out past the window's right edge, widest first: the innermost visible elements whose box ends
# past it and that no scrolling ancestor clips (a table in an overflow-x: auto box scrolls there, not the page).
OFFENDERS = """() => {
  const clipped = e => {
    for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
      if (getComputedStyle(a).overflowX !== "visible") return true;
    return false;
  };
  const past = e => e.getBoundingClientRect().right > window.innerWidth + 0.5 && !clipped(e);
  const shown = e => e.getClientRects().length > 0 && getComputedStyle(e).visibility !== "hidden";
  const name = e => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "")
    + [...e.classList].map(c => "." + c).join("");
  return [...document.querySelectorAll("body *")].filter(e => shown(e) && past(e))
    .filter(e => ![...e.children].some(c => shown(c) && past(c)))
    .map(e => ({ e, r: e.getBoundingClientRect() }))
    .sort((a, b) => b.r.width - a.r.width).slice(0, 5)
    .map(({ e, r }) => `${name(e)} (${Math.round(r.width)} px wide, ends at ${Math.round(r.right)} px)`);
}"""


@pytest.fixture(scope="module")
def server(demo_store, tmp_path_factory, tiny_tokenizer):
    """The demo store plus a tiny dual-attention GPT named like the shipped one: the longest model label."""
    root = tmp_path_factory.mktemp("layout-store") / "store"
    shutil.copytree(demo_store, root)
    vocab, eos = tiny_tokenizer.get_vocab_size(), eos_id(tiny_tokenizer)
    dual = tiny_gpt(
        vocab_size=vocab, eos_token_id=eos, n_head=2, n_relational_head=2, positions="rope", context_length=256
    )
    write_checkpoint(root / LONG_MODEL, dual, tiny_tokenizer, card="# dual\n", metrics={})
    with http_server(root, api_token=TOKEN) as (base, _):
        yield base


def show_result(page, tab: str) -> None:
    """Run the tab's request and wait for its result (the card tab runs when chosen)."""
    if tab == "complete":
        page.select_option("#gen-model", LONG_MODEL)  # its context holds a long unbroken word (a URL, say)
        page.fill("#prompt", "See https://example.org/" + "averyverylongpathsegment" * 6)
        page.fill("#max_new_tokens", "8")
        page.click("#generate")
        finished(page)
    elif tab == "fillmask":
        page.click("#fill")
        page.wait_for_selector(".candidates li")
    elif tab == "attention":
        page.click("#show-attention")
        page.wait_for_selector("#heatmap .cell")
    elif tab == "inside":  # a long text's lens: the table scrolls in its own box, not the page
        page.fill("#in-text", "The castle was built in the year " * 3)
        page.click("#look")
        page.wait_for_selector("#inside-result table")
    elif tab == "card":  # tiny-gpt's card: a table and a 770-px-wide image
        page.select_option("#card-model", "tiny-gpt")
        page.wait_for_function("document.querySelector('#card-body img')?.naturalWidth > 100")


@pytest.mark.parametrize("width,height", [(1280, 800), (390, 844)])
def test_the_page_fits_its_window(browser, server, width, height, tmp_path):  # noqa: F811 (the imported fixtures)
    """No sideways scrolling on a laptop or a phone: every tab, its result, the share link and the API panel
    are at most as wide as the window; a failure names what sticks out, widest first."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.goto(server + "/")
    login(page)
    try:
        page.wait_for_selector("#examples-complete .example")
        options = "[...document.querySelectorAll('#gen-model option')]"
        page.wait_for_function(f"{options}.some(o => o.value === '{LONG_MODEL}')")
        page.click("#share")  # the share link's box opens in the header and stays
        page.wait_for_selector("#share-box:not([hidden])")
        tabs = page.eval_on_selector_all("nav .tab", "bs => bs.map(b => b.dataset.tab)")
        assert set(tabs) >= {"complete", "fillmask", "attention", "inside", "card"}, tabs
        for tab in tabs:
            page.click(f"button[data-tab={tab}]")
            assert page.is_visible(f"section#{tab}.panel.active")
            for shown_now in (False, True):  # the tab as it opens, then with its result
                if shown_now:
                    show_result(page, tab)
                overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
                state = "with its result" if shown_now else "as it opens"
                assert overflow <= 0, (
                    f"the {tab} tab ({state}) is {overflow} px wider than a {width}-px window; "
                    f"sticking out, widest first: {page.evaluate(OFFENDERS)}"
                )
        shot(page, f"card-{width}px", tmp_path)  # the last tab, to look at ($DEMO_SCREENSHOTS)
    finally:
        context.close()
