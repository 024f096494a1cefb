"""/v1/responses through the `openai` tools_client unchanged (create, stream, json_schema, function tools,
previous_response_id), on the tiny tool-calling Llama of tests/tool_models.py."""

import json

import jsonschema
import openai
import pytest

from tests.test_chat import openai_client
from tests.test_tools_api import WEATHER

TOOL = {"type": "function", "name": "get_weather", "description": "The forecast.", "parameters": WEATHER}
CHOICE = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
JSON_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": CHOICE, "strict": True}}


def test_a_plain_response_is_a_message_item_and_its_stream_the_same_text_in_openais_order(tools_client):
    api = openai_client(tools_client)
    plain = api.responses.create(model="tiny-hermes", input="Hello", max_output_tokens=12, temperature=0)
    assert plain.object == "response" and plain.status == "incomplete"  # cut by max_output_tokens
    assert plain.incomplete_details.reason == "max_output_tokens" and plain.usage.output_tokens == 12
    [message] = plain.output
    assert message.type == "message" and message.role == "assistant" and plain.output_text
    events = list(api.responses.create(model="tiny-hermes", input="Hello", max_output_tokens=12, temperature=0,
                                       stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(events[2].item.id, 0, 0)}
    assert "".join(e.delta for e in deltas) == plain.output_text == events[-1].response.output[0].content[0].text


def test_a_json_schema_format_gives_valid_json_and_the_stream_helper_the_same_response(tools_client):
    api = openai_client(tools_client)
    kwargs = dict(model="tiny-hermes", input="Is it sunny?", text=JSON_FORMAT, temperature=1.0, extra_body={"seed": 5})
    plain = api.responses.create(**kwargs)
    assert plain.status == "completed"
    jsonschema.validate(json.loads(plain.output_text), CHOICE)
    with api.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_text == plain.output_text and final.status == plain.status
    assert [item.type for item in final.output] == [item.type for item in plain.output]


def test_a_function_call_its_output_and_the_answer_by_previous_response_id(tools_client):
    api = openai_client(tools_client)
    first = api.responses.create(model="tiny-hermes", input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                 parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 2})  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = list(api.responses.create(model="tiny-hermes", input="Weather in Paris?", tools=[TOOL], stream=True,
                                         tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                         extra_body={"seed": 2}))  # fmt: skip
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and streamed[-1].type == "response.completed"
    second = api.responses.create(model="tiny-hermes", previous_response_id=first.id, tools=[TOOL],
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "Sunny, 21 C"}], max_output_tokens=4, temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id
    # the stored conversation came back: the call and its output are in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + len("Sunny, 21 C")
    assert api.responses.retrieve(first.id).output[0].call_id == call.call_id


def test_unknown_or_unstored_responses_are_404s_naming_the_field(tools_client):
    api = openai_client(tools_client)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        api.responses.create(model="tiny-hermes", input="Hi", previous_response_id="resp_missing")
    unstored = api.responses.create(model="tiny-hermes", input="Hi", max_output_tokens=2, store=False)
    assert tools_client.get(f"/v1/responses/{unstored.id}").status_code == 404


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "tool_call_id"),
    ],
)  # fmt: skip
def test_bad_responses_requests_are_4xx_naming_the_field(tools_client, change, field):
    r = tools_client.post("/v1/responses", json={"model": "tiny-hermes", "input": "Hi", **change})
    assert 400 <= r.status_code < 500 and field in r.text, r.text
