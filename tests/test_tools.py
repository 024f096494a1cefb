"""server/features/tools.py: the tool-call grammars as llguidance runs them over a byte vocabulary (call markers as
added tokens and as plain text), the calls read out of a reply, and out of a reply as it streams."""

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from server.features.tools import HERMES, LLAMA3_JSON, CallStream, tool_grammar
from tests.tool_models import MARKERS, byte_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
WRONG = '<tool_call>\n{"name":"nope","arguments":{}}\n</tool_call>'


def accepts(grammar: str, text: str, markers: bool) -> str:
    """"error", or whether the grammar may end after `text` ("open") or must ("end")."""
    tok = byte_tokenizer(markers)
    m = LLMatcher(LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=2),
                  LLMatcher.grammar_from_lark(grammar), log_level=0)  # fmt: skip
    assert not m.is_error(), m.get_error()
    for t in tok.encode(text).ids:
        m.consume_token(t)
        if m.is_error():
            return "error"
    return "end" if m.is_stopped() else "open" if m.is_accepting() else "more"


@pytest.mark.parametrize("markers", [True, False], ids=["added-tokens", "text"])
def test_hermes_grammars_hold_calls_to_the_schemas(markers):
    single = set(MARKERS) if markers else set()
    auto = tool_grammar(HERMES, TOOLS, "auto", True, single)
    assert accepts(auto, "Just text.", markers) == "open"
    assert accepts(auto, "Let me see. " + CALL, markers) == "open"  # another call may follow
    assert accepts(auto, "Let me see. " + WRONG, markers) == "error"  # once opened, a call is a tool's
    one = tool_grammar(HERMES, TOOLS, "auto", False, single)
    assert accepts(one, CALL, markers) == "end" and accepts(one, CALL + "\n" + CALL, markers) == "error"
    required = tool_grammar(HERMES, TOOLS, "required", True, single)
    assert accepts(required, "Text", markers) == "error" and accepts(required, CALL + "\n" + CALL, markers) == "open"
    named = tool_grammar(HERMES, TOOLS, "now", False, single)
    assert accepts(named, CALL, markers) == "error"
    assert accepts(named, '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>', markers) == "end"


def test_the_llama_grammar_reads_a_reply_that_starts_with_a_brace_as_calls():
    auto = tool_grammar(LLAMA3_JSON, TOOLS, "auto", True, set())
    call = '{"name":"now","parameters":{}}'
    assert accepts(auto, "Hello", False) == "open" and accepts(auto, call, False) == "open"
    assert accepts(auto, call + '; {"name":"get_weather","parameters":{"city":"x"}}', False) == "open"
    assert accepts(auto, '{"name":"zz"', False) == "error"
    assert accepts(tool_grammar(LLAMA3_JSON, TOOLS, "required", False, set()), call, False) == "end"
    tagged = tool_grammar(LLAMA3_JSON, TOOLS, "auto", True, {"<|python_tag|>"})  # the tag a special token
    assert accepts(tagged, "<|python_tag|>" + call, True) == "open" and accepts(tagged, "Hello", True) == "open"
    assert accepts(tagged, '<|python_tag|>{"name":"zz"', True) == "error"


def test_calls_are_read_out_of_a_reply_and_the_rest_is_its_text():
    content, calls = HERMES.parse("Checking. " + CALL.replace(":", ": ") + " " + CALL)
    assert content == "Checking." and [c.name for c in calls] == ["get_weather"] * 2
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id
    assert HERMES.parse("<tool_call>\n{broken\n</tool_call>") == ("<tool_call>\n{broken\n</tool_call>", [])
    now = '{"name": "now", "parameters": {}}'
    content, calls = LLAMA3_JSON.parse(f"<|python_tag|>{now}; {now}")
    assert content is None and [c.name for c in calls] == ["now", "now"]
    assert LLAMA3_JSON.parse("Hello {there}") == ("Hello {there}", [])


def test_a_streamed_reply_sends_its_text_at_once_and_each_call_whole():
    text = "Sure, <tool" + CALL[5:] + " done <"
    stream, got = CallStream(HERMES), []
    for i in range(0, len(text), 3):
        got += stream.feed(text[i : i + 3])
    got += stream.close()
    words = [p for p in got if isinstance(p, str)]
    calls = [p for p in got if not isinstance(p, str)]
    assert "".join(words) == "Sure,  done <" and [c.name for c in calls] == ["get_weather"]
    assert not any("<tool" in w for w in words)  # the marker was held back, never sent as text
    two, got = CallStream(HERMES), []
    for ch in CALL + "\n" + CALL + "\n":
        got += two.feed(ch)
    assert [type(p).__name__ for p in got + two.close()] == ["ToolCall", "ToolCall"]  # no blank text between
    llama = CallStream(LLAMA3_JSON)
    assert [p for ch in ' {"name": "now", "parameters": {}}' for p in llama.feed(ch)] == []  # held to the end
    assert [c.name for c in llama.close()] == ["now"]
    text_reply = CallStream(LLAMA3_JSON)
    assert "".join(p for ch in "Hi {x}" for p in text_reply.feed(ch)) == "Hi {x}" and text_reply.close() == []
