"""Tool calling in /v1/chat/completions through the `openai` tools_client and LangChain, on tiny random Llamas whose
templates (tests/tool_models.py) teach Hermes `<tool_call>` blocks or Llama 3's JSON: every call parses and
validates, streamed or not; content given as parts; bad tools refused by name."""

import json
from typing import Literal

import jsonschema
import pytest

from tests.test_chat import openai_client

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                    "additionalProperties": False}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid(call) -> bool:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return True


def test_with_tool_choice_required_every_sampled_call_parses_and_validates(tools_client):
    api = openai_client(tools_client)
    for seed in range(20):
        out = api.chat.completions.create(model="tiny-hermes", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, seed=seed)  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function" and valid(call)
        assert choice.message.content is None


def test_a_named_function_is_the_one_called_in_either_format(tools_client):
    api = openai_client(tools_client)
    for model in ("tiny-hermes", "tiny-llama3"):
        named = {"type": "function", "function": {"name": "get_weather"}}
        out = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=3,
                                          tool_choice=named)  # fmt: skip
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls and all(valid(c) for c in calls)
        assert {c.function.name for c in calls} == {"get_weather"}


@pytest.mark.parametrize(("model", "opener"), [("tiny-hermes", "<tool_call>"), ("tiny-llama3", "<|python_tag|>")])
def test_with_auto_a_call_the_model_opens_is_completed_under_the_schema(tools_client, model, opener):
    """The marker (Hermes's added token, Llama's special tag) forced by logit_bias: from there on the grammar holds
    the call to a tool's schema."""
    api = openai_client(tools_client)
    marker = tools_client.post("/tokenize", json={"model": model, "prompt": opener}).json()["tokens"]
    assert len(marker) == 1  # one token
    free = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=20)
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason in ("stop", "length")
    for seed in range(4):
        out = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                          parallel_tool_calls=False, logit_bias={str(marker[0]): 100})  # fmt: skip
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and valid(calls[0])


def test_streamed_calls_reassemble_to_the_unstreamed_ones(tools_client):
    api = openai_client(tools_client)
    for model in ("tiny-hermes", "tiny-llama3"):
        kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7)
        whole = api.chat.completions.create(**kwargs).choices[0]
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in api.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                reasons.append(choice.finish_reason)
                for d in choice.delta.tool_calls or []:
                    if d.id is not None:  # a call's first chunk carries its id, type and name
                        assert d.type == "function" and d.function.name
                        calls[d.index] = {"name": d.function.name, "arguments": ""}
                    calls[d.index]["arguments"] += d.function.arguments or ""
        want = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
        assert [calls[i] for i in sorted(calls)] == want and reasons[-1] == "tool_calls"


def test_a_two_turn_tool_loop_renders_the_call_and_its_result_back(tools_client):
    api = openai_client(tools_client)
    first = api.chat.completions.create(model="tiny-hermes", messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]  # fmt: skip
    second = api.chat.completions.create(model="tiny-hermes", messages=history, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=8)  # fmt: skip
    assert second.choices[0].message.content is not None and second.choices[0].message.tool_calls is None
    from server.api.schemas.chat import ChatCompletionRequest
    from server.features.chat import prepare_chat

    body = ChatCompletionRequest(model="tiny-hermes", messages=history, tools=TOOLS)
    state = tools_client.app.state
    turn = prepare_chat(state.registry, state.settings, "tiny-hermes", body.model_dump(exclude_none=True)["messages"],
                        body)  # fmt: skip
    prompt = tools_client.post("/detokenize", json={"model": "tiny-hermes", "tokens": turn.job.prompt_ids}).json()
    text = prompt.get("text", prompt.get("prompt", ""))
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text and '"get_weather"' in text  # the tools too


def test_content_given_as_text_parts_is_the_same_prompt(tools_client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "it?"}]}]
    plain = [{"role": "user", "content": "What is it?"}]
    got = [tools_client.post("/v1/chat/completions", json={"model": "tiny-hermes", "messages": m, "max_tokens": 4,
                                                     "temperature": 0}).json() for m in (parts, plain)]  # fmt: skip
    assert got[0]["usage"] == got[1]["usage"] and got[0]["choices"] == got[1]["choices"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "42"}]}, "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"model": "tiny-plain", "tools": TOOLS}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_4xx_naming_the_field(tools_client, change, field):
    body = {"model": "tiny-hermes", "messages": ASK, **change}
    r = tools_client.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.text


def test_a_langchain_agent_calls_a_tool_and_answers(tools_client):
    """LangChain's ChatOpenAI with bind_tools, unchanged: the model's call runs the tool, whose result goes back."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran = []

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:  # a random model ends no free string
        """The forecast for a city."""
        ran.append(city)
        return f"Sunny in {city}"

    llm = ChatOpenAI(model="tiny-hermes", base_url=f"{tools_client.base_url}/v1", api_key="unused",
                     http_client=tools_client, temperature=0, max_tokens=200)  # fmt: skip
    agent = llm.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = agent.invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    messages += [reply, get_weather.invoke(reply.tool_calls[0])]  # a ToolMessage answering the call
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert ran and isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in (
        "stop", "length", "tool_calls")  # fmt: skip
