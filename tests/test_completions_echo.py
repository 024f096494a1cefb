"""/v1/completions as lm-eval and OpenAI's legacy API use it: token-id prompts, echoed prompt logprobs,
scoring without generating."""

import pytest
import torch
from fastapi.testclient import TestClient

from model_store.store import load_gpt
from server.api.app import create_app
from server.config import Settings
from tests.conftest import error_of

GREEDY = {"model": "tiny-gpt", "temperature": 0, "eos_bias": -1e9}


@pytest.fixture(scope="module")
def client(store):
    with TestClient(create_app(Settings(store=store, max_new_tokens_cap=40))) as c:
        yield c


@pytest.fixture(scope="module")
def gpt(store):
    return load_gpt(store / "tiny-gpt")


def own_logprobs(model, ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """log p(ids[t] | ids[:t]) for t >= 1, and every position's log-softmax, from the model itself."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)], logp


def test_token_id_prompts_complete_like_their_text(client, gpt):
    _, tok = gpt
    text = "The castle was built"
    ids = tok.encode(text, add_special_tokens=False).ids
    as_text = client.post("/v1/completions", json={**GREEDY, "prompt": text, "max_tokens": 5}).json()
    for prompt in (ids, [ids], [ids, ids]):
        r = client.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [as_text["choices"][0]["text"]] * (1 + (len(prompt) == 2))
        assert r.json()["usage"]["prompt_tokens"] == len(ids) * (1 + (len(prompt) == 2))


@pytest.mark.parametrize(
    "prompt, field, words",
    [
        ([5, 6, 10**6], "prompt[2]", "outside the vocabulary"),
        ([[5, 6], [7, 10**6]], "prompt[1][1]", "outside the vocabulary"),
        ([5, -1], "prompt", "prompt[1]: token ids are non-negative"),
        ([[5], []], "prompt", "prompt[1] must be a non-empty string or a non-empty list"),
        ([1.5, 2], "prompt", "must be a non-empty string or a non-empty list of integer token ids"),
        ([True, 2], "prompt", "integer token ids"),
        ({"text": "x"}, "prompt", "must be a string, a list of token ids, or a list of either"),
        ([[1]] * 17, "prompt", "give 1 to 16 prompts"),
        ("", "prompt", "must not be empty"),
    ],
)
def test_bad_prompts_name_the_prompt_and_the_index(client, prompt, field, words):
    r = client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["field"] == field and words in err["error"], err
    assert "function-after" not in err["error"]


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs(client, gpt):
    model, tok = gpt
    text = "The castle was built in 1350 ."
    ids = tok.encode(text, add_special_tokens=False).ids
    body = {**GREEDY, "prompt": text, "echo": True, "logprobs": 2, "max_tokens": 3}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first
    expected, logp = own_logprobs(model, ids)
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    for t in range(1, len(ids)):  # the top alternatives are the model's two most likely tokens there
        top = logp[t - 1].topk(2)
        best = tok.decode([top.indices[0].item()])
        assert next(iter(lp["top_logprobs"][t].items())) == (best, pytest.approx(top.values[0].item(), abs=1e-4))
        assert len(lp["top_logprobs"][t]) == len({tok.decode([i]) for i in top.indices.tolist()})
    # offsets index the returned text: each token's text starts there
    for token, offset in zip(lp["tokens"][: len(ids)], lp["text_offset"], strict=False):
        assert choice["text"][offset : offset + len(token)] == token
    assert lp["text_offset"][len(ids)] == len(text)  # the completion starts after the prompt


def test_max_tokens_zero_with_echo_scores_without_generating(client, gpt):
    model, tok = gpt
    ids = tok.encode("A river runs", add_special_tokens=False).ids
    r = client.post("/v1/completions", json={**GREEDY, "prompt": [ids], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == "A river runs" and c["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(own_logprobs(model, ids)[0], abs=1e-4)
    assert "top_logprobs" not in c["logprobs"]  # logprobs 0: no alternatives
    r = client.post("/v1/completions", json={**GREEDY, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and error_of(r)["field"] == "max_tokens"


def test_streamed_echo_carries_the_prompt_logprobs_first(client):
    body = {**GREEDY, "prompt": "The castle", "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 2
    plain = client.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    import json

    first = json.loads(lines[0][len("data: ") :])["choices"][0]
    assert first["text"] == plain["text"] and first["logprobs"] == plain["logprobs"]


def test_openai_client_echo_logprobs(client, gpt):
    from openai import OpenAI

    model, tok = gpt
    oai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    c = oai.completions.create(model="tiny-gpt", prompt="The castle was", echo=True, logprobs=1, max_tokens=1)
    ids = tok.encode("The castle was", add_special_tokens=False).ids
    lp = c.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(own_logprobs(model, ids)[0], abs=1e-4)


def test_echoed_prompts_longer_than_the_context_are_scored_with_sliding_windows(client, gpt):
    """lm-eval sends windows of its own max_length (2048 unless told): scored whole, each token with
    at least half a context before it; the completion continues from the last tokens that fit."""
    model, tok = gpt
    L = model.config.context_length  # 48
    ids = (tok.encode("The castle was built in 1350 . A river runs north . ", add_special_tokens=False).ids * 20)[:130]
    body = {**GREEDY, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) + 1 and lps[0] is None
    expected = own_logprobs(model, ids[:L])[0]  # the first window: every token its whole past
    for start in range(L // 2, len(ids), L // 2):  # then each token with at least L/2 before it
        window = ids[start : start + L]
        scored = own_logprobs(model, window)[0][L - L // 2 - 1 :]
        expected += scored[: len(ids) - 1 - len(expected)]
        if len(expected) == len(ids) - 1:
            break
    assert lps[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    r = client.post("/v1/completions", json={**GREEDY, "prompt": ids, "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["field"] == "prompt"  # without echo: refused, as before


def test_token_id_prompts_have_a_token_cap_and_text_prompts_a_character_cap(store):
    """Two units, two settings: max_prompt_tokens bounds a prompt of ids, max_prompt_chars a text."""
    settings = Settings(store=store, max_prompt_tokens=8, max_prompt_chars=12)
    with TestClient(create_app(settings)) as client:
        ids = client.post("/v1/completions", json={**GREEDY, "prompt": [5] * 9, "max_tokens": 1})
        text = client.post("/v1/completions", json={**GREEDY, "prompt": "x" * 13, "max_tokens": 1})
        fits = client.post("/v1/completions", json={**GREEDY, "prompt": [5] * 8, "max_tokens": 1})
    assert ids.status_code == 400 and "9 tokens; the limit is 8" in error_of(ids)["error"]
    assert text.status_code == 400 and "13 characters; the limit is 12" in error_of(text)["error"]
    assert fits.status_code == 200, fits.text
