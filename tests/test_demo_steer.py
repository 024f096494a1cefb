"""The demo page's Steer row: a vector from two contrasting prompts, the steered completion beside the plain one,
and the request the API panel shows."""

import pytest

from tests.test_demo_page import browser, finished, page, server, snippet  # noqa: F401

pytestmark = pytest.mark.browser


def test_a_steered_completion_is_shown_beside_the_plain_one(page):  # noqa: F811
    page.select_option("#gen-model", "tiny-gpt")
    assert page.is_hidden("#steer-prompts") and page.is_hidden("#plain-box")
    page.fill("#prompt", "The castle was")
    page.fill("#seed", "3")
    page.fill("#temperature", "0")
    page.select_option("#steer", "contrast")
    assert page.is_visible("#steer-prompts") and page.is_visible("#steer-layer")
    page.fill("#steer-scale", "16")
    page.dispatch_event("#steer-scale", "input")
    page.click("#generate")
    try:
        finished(page)
    except Exception:
        raise AssertionError(f"{page.text_content('#error')!r} {page.text_content('#finish-reason')!r}") from None
    page.wait_for_function("document.querySelector('#completion-plain').textContent.length > 0", timeout=30_000)
    steered = page.text_content("#completion .generated")
    plain = page.text_content("#completion-plain")
    assert page.is_visible("#plain-box") and steered and plain.startswith("The castle was")
    assert plain != "The castle was" + steered  # the steer changed the greedy completion
    curl = snippet(page, "curl")
    assert '"steer"' in curl and "page-contrast" in curl and "16" in curl
    assert "steer=" in snippet(page, "cog")
    page.select_option("#steer", "")
    assert page.is_hidden("#steer-prompts")
