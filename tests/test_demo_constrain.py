"""The demo page's Constrain field: a completion held to a regex or a list of choices, and the snippets
that send the same constraint."""

import re

import pytest

from tests.test_demo_page import browser, finished, page, server, snippet  # noqa: F401

pytestmark = pytest.mark.browser


def constrain(page, kind: str, text: str) -> str:  # noqa: F811 (the page fixture)
    page.select_option("#gen-model", "tiny-gpt")
    page.fill("#prompt", "The code is")
    page.fill("#seed", "5")
    page.select_option("#constrain", kind)
    page.fill("#constraint", text)
    page.click("#generate")
    finished(page)
    return page.text_content("#completion .generated")


def test_a_regex_constrains_the_streamed_completion_and_its_snippets(page):  # noqa: F811
    assert page.is_hidden("#constraint-box")
    text = constrain(page, "regex", "[a-c]{3}-[0-9]{2}")
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", text), text
    assert page.text_content("#finish-reason") == "eos_token"
    assert '"grammar"' in snippet(page, "curl") and "structured_outputs" in snippet(page, "openai")
    assert "regex=[a-c]{3}-[0-9]{2}" in snippet(page, "cog")


def test_one_of_the_choices(page):  # noqa: F811
    assert constrain(page, "choices", "red\nlight blue\n(green)") in {"red", "light blue", "(green)"}
