"""The demo page's layout in a real browser (Debian's chromium through Playwright): it fits a laptop's
and a phone's window."""

import pytest

from tests.test_demo_page import browser, demo_store, login, server  # noqa: F401 (the page's fixtures)

# the innermost visible elements that end past the window's right edge (what a failing check names)
WIDEST = """() => {
  const past = e => e.getBoundingClientRect().right > window.innerWidth + 1;
  const name = e => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + (e.className ? "." + e.className : "");
  return [...document.querySelectorAll("body *")].filter(e => past(e) && e.offsetParent !== null)
    .filter(e => ![...e.children].some(past)).slice(0, 6).map(name);
}"""


@pytest.mark.parametrize("width", [1280, 390])
def test_the_page_fits_its_window(browser, server, width):  # noqa: F811 (the imported fixtures)
    """No sideways scrolling on a laptop or a phone: every tab is at most as wide as the window."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    page.goto(server + "/")
    login(page)
    try:
        page.wait_for_selector("#examples-complete .example")
        for tab in ("complete", "fillmask", "attention", "inside"):
            page.click(f"button[data-tab={tab}]")
            if tab == "inside":  # a long text's lens: the table scrolls in its own box, not the page
                page.fill("#in-text", "The castle was built in the year " * 3)
                page.click("#look")
                page.wait_for_selector("#inside-result table")
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{tab} tab is {overflow} px wider than a {width}-px window: {page.evaluate(WIDEST)}"
    finally:
        context.close()
