"""Structured output with llguidance: JSON schema, regex, choice and Lark grammar constraints, each the
way its ecosystem asks (TGI's grammar, OpenAI's response_format, vLLM's structured_outputs), on a tiny
random Llama with a byte-level tokenizer and a ChatML template made here."""

import copy
import json
import re

import jsonschema
import pytest
from fastapi.testclient import TestClient

from model_store.ingest import add_checkpoint
from server.api.app import create_app
from server.config import Settings
from tests.conftest import error_of
from tests.test_chat import CHATML, MESSAGES

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tiny_tokenizer, tmp_path_factory):
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("structured")
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    end = tok.token_to_id("<|im_end|>")
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=end, eos_token_id=end)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "src")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML).save_pretrained(
        root / "src"
    )
    add_checkpoint(root / "src", "tiny-json", root / "store")
    with TestClient(create_app(Settings(store=root / "store", dtype="float32", ready_after="all"))) as c:
        yield c


def test_a_json_schema_holds_on_20_seeds_even_with_random_weights(client):
    from openai import OpenAI

    oai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(20):
        reply = oai.chat.completions.create(model="tiny-json", messages=MESSAGES, max_tokens=80, seed=seed,
                                            temperature=1.0, response_format=fmt)  # fmt: skip
        text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reply.choices[0].finish_reason == "stop"  # the grammar completed the reply
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text  # no whitespace between tokens


def test_a_regex_on_generate_is_matched_in_full_and_ends_the_request(client):
    regex = "[a-c]{3}-[0-9]{2}"
    for seed in range(5):
        grammar = {"type": "regex", "value": regex}
        parameters = {"max_new_tokens": 30, "do_sample": True, "seed": seed, "grammar": grammar, "details": True}
        body = {"inputs": "The code is", "parameters": parameters}
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert re.fullmatch(regex, r.json()["generated_text"]), r.json()["generated_text"]
        assert r.json()["details"]["finish_reason"] == "eos_token"


def test_choice_and_lark_grammar_through_structured_outputs(client):
    choices = ["yes", "no", "maybe later"]
    for seed in range(5):
        body = {"model": "tiny-json", "prompt": "Answer:", "max_tokens": 20, "seed": seed,
                "structured_outputs": {"choice": choices}}  # fmt: skip
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices, r.text
    lark = 'start: "a" NUM "b"\nNUM: /[0-9]{2}/'
    body = {"model": "tiny-json", "prompt": "x", "max_tokens": 10, "structured_outputs": {"grammar": lark}}
    assert re.fullmatch("a[0-9]{2}b", client.post("/v1/completions", json=body).json()["choices"][0]["text"])


def test_greedy_constrained_rows_share_a_batch_with_free_ones(client):
    """A greedy JSON request beside free requests: each gets what it gets alone."""
    import concurrent.futures

    free = {"model": "tiny-json", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    constrained = {**free, "max_tokens": 80, "response_format": schema}

    def ask(body):
        return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    alone = [ask(free), ask(constrained)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, [free, constrained, free, constrained]))
    assert together == alone * 2
    jsonschema.validate(json.loads(alone[1]), SCHEMA)


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(ab"}}}, 422,
         "parameters.grammar.value"),
        ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": "{not json"}}}, 422,
         "parameters.grammar.value"),
        ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "ebnf", "value": "x"}}}, 422,
         "parameters.grammar.type"),
        ("/v1/completions", {"model": "tiny-json", "prompt": "x", "structured_outputs": {"regex": "[z-a]"}}, 400,
         "structured_outputs.regex"),
        ("/v1/completions", {"model": "tiny-json", "prompt": "x", "structured_outputs": {"grammar": "start: nope"}},
         400, "structured_outputs.grammar"),
        ("/v1/completions", {"model": "tiny-json", "prompt": "x",
                             "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
        ("/v1/chat/completions", {"model": "tiny-json", "messages": MESSAGES,
                                  "response_format": {"type": "json_schema"}}, 400, "response_format"),
        ("/v1/chat/completions", {"model": "tiny-json", "messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400,
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_bad_constraints_are_4xx_naming_the_field(client, path, body, status, field):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert error_of(r)["field"] == field, r.text


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/generate", {"inputs": "w5", "parameters": {"model": "tiny-json", "grammar": {"type": "regex",
         "value": "w[0-9]"}}}, 422, "parameters.grammar.value"),
        ("/v1/chat/completions", {"model": "tiny-json", "messages": MESSAGES, "response_format": {
         "type": "json_object"}}, 400, "response_format"),
        ("/v1/completions", {"model": "tiny-json", "prompt": "w5", "structured_outputs": {"regex": "w[0-9]"}}, 400,
         "structured_outputs.regex"),
    ],
)  # fmt: skip
def test_every_route_attaches_a_constraint_within_the_time_limit(client, monkeypatch, path, body, status, field):
    """One function attaches a constraint for every route (and Cog): a compile slower than the limit is a 422."""
    import time

    from server.features import constraints

    settings = client.app.state.settings
    monkeypatch.setattr(settings, "grammar_compile_timeout_s", 0.05)
    monkeypatch.setattr(constraints, "compile_matcher", lambda m, c: time.sleep(0.5))
    r = client.post(path, json=body)
    assert r.status_code == status and error_of(r)["field"] == field, r.text
    assert "did not compile within 0.05 s" in error_of(r)["error"]
