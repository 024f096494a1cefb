"""Hostile and malformed requests (the nasty-input corpus): each gets a 4xx naming the problem, never a 5xx."""

import json

import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.config import Settings
from tests.conftest import error_of


@pytest.fixture(scope="module")
def client(store):
    with TestClient(create_app(Settings(store=store, max_new_tokens_cap=16, max_body_bytes=200_000))) as c:
        yield c


RAW_BODIES = [
    b"\xff\xfe\xfa not utf-8",
    b'{"inputs": "\xc3\x28"}',  # invalid UTF-8 inside a JSON string
    b'{"inputs": "a\\u0000b", "parameters": {"max_new_tokens": 2}}',  # NUL byte (valid JSON escape)
    b"[" * 5000 + b"]" * 5000,  # deeply nested
    b'{"inputs": "x", "parameters": {"temperature": NaN, "do_sample": true}}',
    b'{"inputs": "x", "parameters": {"temperature": Infinity, "do_sample": true}}',
    b'{"inputs": "x", "parameters": {"max_new_tokens": "12"}}',  # number as string (strict: refused)
    b'{"inputs": "x", "parameters": {"do_sample": "true"}}',
    b'{"inputs": "x", "parameters": {"max_new_tokens": 1000000000000}}',
    b'{"inputs": "x", "parameters": {"max_new_tokens": 1e30}}',
    b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}',
    b'{"inputs": "x", "parameters": {"seed": -5}}',
    b'{"inputs": "x", "parameters": {"stop": ' + json.dumps(["ab"] * 3000).encode() + b"}}",
    b'{"inputs": 12}',
    b'{"inputs": null}',
    b"{}",
    b"",
    b'{"inputs": "x", "unknown": 1}',
]


@pytest.mark.parametrize("body", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize(
    "path",
    [
        "/generate", "/generate_stream", "/v1/completions", "/fill-mask", "/attention", "/score",
        "/inspect/logit-lens", "/inspect/ablate", "/inspect/patch", "/v1/chat/completions", "/tokenize", "/detokenize",
    ],
)  # fmt: skip
def test_nasty_body_gets_a_clear_4xx(client, path, body):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = error_of(r)
    assert err["error"] and err["error_type"]
    if err["error_type"] == "validation" and not err["error"].startswith("malformed JSON"):
        assert err["field"] and err["error"].startswith(err["field"]), err  # names the field, then the rule


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/attention", {"model": "../../etc/passwd", "text": "x"}, 404, "model"),
        ("/attention", {"model": "/etc/passwd", "text": "x"}, 404, "model"),
        ("/fill-mask", {"inputs": "x", "model": "..%2F..%2Fetc"}, 404, "model"),
        ("/v1/completions", {"model": "tiny-gpt/../../x", "prompt": "x"}, 404, "model"),
        ("/fill-mask", {"inputs": "no mask"}, 422, "inputs"),
        (
            "/attention",
            {"model": "tiny-gpt", "text": "x", "heads": [], "format": "png"},
            422,
            "heads",
        ),  # fuzz-found 500
        ("/attention", {"model": "tiny-mlm-softmax0", "text": "x", "layers": []}, 422, "layers"),
        ("/fill-mask", {"inputs": "<mask> " * 500}, 422, "inputs"),
        ("/attention", {"model": "tiny-gpt", "text": "long " * 1000}, 422, "text"),
        ("/inspect/logit-lens", {"model": "../../etc/passwd", "text": "x"}, 404, "model"),
        ("/inspect/ablate", {"text": "x", "heads": [[0, -1]]}, 422, "heads[0]"),
        ("/inspect/ablate", {"text": "x", "heads": [[0, 1, 2]]}, 422, "heads[0]"),
        ("/inspect/patch", {"clean": "x", "corrupt": "x", "answer": "x", "foil": "x\x00"}, 422, "foil"),
        ("/inspect/logit-lens", {"model": "tiny-mlm-softmax0", "text": "long " * 1000}, 422, "text"),
        ("/generate", {"inputs": "x" * 30_000}, 422, "inputs"),
        ("/generate", {"inputs": "x", "parameters": {"top_k": 0}}, 422, "parameters.top_k"),
        ("/generate", {"inputs": "x", "parameters": {"repetition_penalty": 0}}, 422, "parameters.repetition_penalty"),
        # structured output and chat: a grammar that does not compile, a model without a chat template, a role
        ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(ab"}}}, 422,
         "parameters.grammar.value"),
        ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {"type": 7}}}}, 422,
         "parameters.grammar.value"),
        ("/v1/completions", {"model": "tiny-gpt", "prompt": "x", "structured_outputs": {"grammar": "start: nope"}},
         400, "structured_outputs.grammar"),
        ("/v1/completions", {"model": "tiny-gpt", "prompt": "x", "structured_outputs": {"choice": []}}, 400,
         "structured_outputs.choice"),
        ("/v1/chat/completions", {"model": "tiny-gpt", "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ("/v1/chat/completions", {"model": "tiny-gpt", "messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages.0.role"),
    ],
)  # fmt: skip
def test_named_rejections(client, path, body, status, field):
    r = client.post(path, json=body)
    assert r.status_code == status and error_of(r)["field"] == field, r.text


def test_caps_apply_instead_of_failing(client):
    r = client.post(
        "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 10_000, "eos_bias": -1e9, "details": True}}
    )
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 16  # capped by the server


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"inputs": "a\x00b"}, "inputs"),
        ("/generate", {"inputs": "ab", "parameters": {"stop": ["\x00"]}}, "parameters.stop.0"),
        ("/v1/completions", {"model": "tiny-gpt", "prompt": "a\x00"}, "prompt"),
        ("/fill-mask", {"inputs": "<mask>\x00"}, "inputs"),
        ("/score", {"text": "\x00"}, "text"),
        ("/inspect/logit-lens", {"text": "\x00"}, "text"),
    ],
)
def test_nul_characters_are_refused(client, path, body, field):
    r = client.post(path, json=body)
    invalid = 400 if path.startswith("/v1/") else 422  # OpenAI's status under /v1
    assert r.status_code == invalid and error_of(r)["field"].startswith(field) and "NUL" in error_of(r)["error"], r.text
