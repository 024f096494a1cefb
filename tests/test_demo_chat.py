"""The demo page's chat view: for a model with a chat template, the Completion tab holds a conversation
whose replies stream from /v1/chat/completions, and its snippets send the same conversation."""

import httpx
import pytest

from scripts.processes import http_server
from tests.test_chat import chat_store  # noqa: F401 (a tiny random Llama with a ChatML template)
from tests.test_demo_page import TOKEN, browser, page, shot, snippet  # noqa: F401

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(chat_store):  # noqa: F811 (the page fixture's server: the chat store, and a model that calls tools)
    from model_store.ingest import add_checkpoint
    from tests.tool_models import HERMES_TEMPLATE, save_tool_model

    save_tool_model(chat_store / "src" / "tiny-hermes", HERMES_TEMPLATE, "<|im_end|>")
    add_checkpoint(chat_store / "src" / "tiny-hermes", "tiny-hermes", chat_store / "store")
    with http_server(chat_store / "store", api_token=TOKEN, dtype="float32") as (base, _):
        yield base


def turn(page, message: str) -> None:  # noqa: F811
    page.fill("#prompt", message)
    page.click("#generate")
    page.wait_for_function(
        "['stop', 'length'].includes(document.querySelector('#finish-reason').textContent)", timeout=30_000
    )


def test_a_chat_model_gets_the_chat_view_and_its_replies_are_the_apis(page, server, tmp_path):  # noqa: F811
    page.select_option("#gen-model", "tiny-gpt")
    assert page.is_hidden("#chat-toggle")  # no chat template: completion only
    page.select_option("#gen-model", "tiny-chat")
    assert page.is_visible("#chat-toggle")
    page.check("#chat-mode")
    assert page.is_visible("#chat-clear") and page.is_hidden("#completion")
    assert page.text_content("#prompt-label") == "Message"
    page.fill("#temperature", "0")
    page.fill("#max_new_tokens", "5")
    page.fill("#eos_bias", "-20")  # a random model would often end its turn at once
    turn(page, "w7 w8 w9")
    turns = page.locator("#chat-log .turn")
    assert turns.count() == 2 and page.text_content("#chat-log .turn.user .content") == "w7 w8 w9"
    reply = page.text_content("#chat-log .turn.assistant .content")
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "w7 w8 w9"}], "max_tokens": 5,
            "temperature": 0, "eos_bias": -20}  # fmt: skip
    api = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply == api.json()["choices"][0]["message"]["content"] and reply  # the page sent this request

    page.fill("#prompt", "w10")  # the next request carries the conversation so far
    curl = snippet(page, "curl")
    assert "/v1/chat/completions" in curl and '"role":"assistant"' in curl and reply in curl
    assert "client.chat.completions.create" in snippet(page, "openai")
    assert "messages=" in snippet(page, "cog")
    turn(page, "w10")
    assert turns.count() == 4
    shot(page, "chat", tmp_path)
    page.click("#chat-clear")
    assert turns.count() == 0 and '"role":"assistant"' not in snippet(page, "curl")


def test_a_failed_turn_leaves_the_conversation_as_it_was(page):  # noqa: F811
    page.select_option("#gen-model", "tiny-chat")
    page.check("#chat-mode")
    page.select_option("#constrain", "regex")
    page.fill("#constraint", "(ab")  # does not compile: a 400 naming the field
    page.fill("#prompt", "w7")
    page.click("#generate")
    page.wait_for_function("document.querySelector('#finish-reason').textContent === 'error'", timeout=30_000)
    assert "structured_outputs.regex" in page.text_content("#error")
    assert page.locator("#chat-log .turn").count() == 0 and page.input_value("#prompt") == "w7"


def test_a_tool_call_is_shown_and_the_next_message_answers_it(page, tmp_path):  # noqa: F811
    import json

    from tests.test_tools_api import TOOLS

    page.select_option("#gen-model", "tiny-hermes")
    assert page.is_hidden("#tools-box")  # tools belong to the chat view
    page.check("#chat-mode")
    assert page.is_visible("#tools-box")
    page.fill("#chat-tools", json.dumps(TOOLS))
    page.select_option("#tool-choice", "required")
    page.fill("#temperature", "0")
    page.fill("#max_new_tokens", "200")
    page.fill("#prompt", "Weather in Paris?")
    page.click("#generate")
    page.wait_for_function("document.querySelector('#finish-reason').textContent === 'tool_calls'", timeout=30_000)
    call = page.text_content("#chat-log .turn.assistant .call")
    name, arguments = call.split("(", 1)
    assert name in ("get_weather", "now") and json.loads(arguments[:-1]) is not None
    assert page.text_content("#prompt-label") == f"Result of {name}"
    page.select_option("#tool-choice", "none")
    page.fill("#max_new_tokens", "4")
    page.fill("#prompt", "Sunny, 21 C")
    assert '"tool_call_id"' in snippet(page, "curl") and '"tool_calls"' in snippet(page, "curl")
    assert "tool_choice=none" in snippet(page, "cog")
    page.click("#generate")
    page.wait_for_function(
        "['stop', 'length'].includes(document.querySelector('#finish-reason').textContent)", timeout=30_000
    )
    assert page.text_content("#chat-log .turn.tool .content") == "Sunny, 21 C"
    assert page.locator("#chat-log .turn").count() == 4 and page.text_content("#prompt-label") == "Message"
    shot(page, "chat-tools", tmp_path)
