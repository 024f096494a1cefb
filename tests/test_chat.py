"""/v1/chat/completions with the checkpoint's chat template (a tiny random Llama with a ChatML template
made here), through the `openai` client unchanged; /tokenize and /detokenize."""

import json

import pytest
from fastapi.testclient import TestClient

from model_store.ingest import add_checkpoint
from server.api.app import create_app
from server.config import Settings
from tests.conftest import error_of
from tests.test_families import VOCAB, families

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]


def chatml_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    words = ["system", "user", "assistant", *(f"w{i}" for i in range(5, VOCAB - 3))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(special)
    return tok


@pytest.fixture(scope="module")
def chat_store(store, tmp_path_factory):
    import shutil

    import torch
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("chat")
    config_class, model_class, kwargs = families()["llama"]
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    model.save_pretrained(root / "src" / "tiny-chat")
    PreTrainedTokenizerFast(
        tokenizer_object=chatml_tokenizer(), bos_token="<s>", eos_token="<|im_end|>", chat_template=CHATML
    ).save_pretrained(root / "src" / "tiny-chat")
    add_checkpoint(root / "src" / "tiny-chat", "tiny-chat", root / "store")
    shutil.copytree(store / "tiny-gpt", root / "store" / "tiny-gpt")
    return root


@pytest.fixture(scope="module")
def client(chat_store):
    with TestClient(create_app(Settings(store=chat_store / "store", dtype="float32", ready_after="all"))) as c:
        yield c


def openai_client(client):
    from openai import OpenAI

    return OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)


def test_the_prompt_is_the_template_rendered_as_transformers_renders_it(client, chat_store):
    from transformers import AutoTokenizer

    from server.api.schemas.chat import ChatCompletionRequest
    from server.features.chat import prepare_chat

    registry = client.app.state.registry
    body = ChatCompletionRequest(model="tiny-chat", messages=MESSAGES)
    job = prepare_chat(registry, client.app.state.settings, "tiny-chat", MESSAGES, body).job
    expected = AutoTokenizer.from_pretrained(chat_store / "src" / "tiny-chat").apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    assert job.prompt_ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert job.params.stop_token_ids == [4]  # <|im_end|>: the end of the assistant's turn


def test_the_openai_client_chats_and_streams_the_same_reply(client):
    oai = openai_client(client)
    reply = oai.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 5
    chunks = list(oai.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_the_end_of_turn_token_ends_the_reply(client):
    oai = openai_client(client)
    reply = oai.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=20, temperature=0,
                                        logit_bias={"4": 100}, logprobs=True, top_logprobs=2)  # fmt: skip
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == ""
    assert reply.usage.completion_tokens == 0


def test_never_stop_holds_for_the_end_of_turn_token_too(client):
    """eos_bias -1e9 ("never stop") and min_new_tokens apply to every token that ends a reply."""
    oai = openai_client(client)
    for extra in ({"eos_bias": -1e9}, {"min_new_tokens": 5}):
        reply = oai.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=5, temperature=0,
                                            logit_bias={"4": 50}, extra_body=extra)  # fmt: skip
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_logprobs_and_n_replies(client):
    oai = openai_client(client)
    reply = oai.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, n=2, seed=3,
                                        logprobs=True, top_logprobs=2, logit_bias={"4": -100})  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)


def test_v1_models_says_which_models_chat(client):
    listed = {m["id"]: m["chat"] for m in client.get("/v1/models").json()["data"]}
    assert listed == {"tiny-chat": True, "tiny-gpt": False}


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"model": "tiny-gpt", "messages": MESSAGES}, 400, "model"),  # no template: no made-up one
        ({"model": "nope", "messages": MESSAGES}, 404, "model"),
        ({"model": "tiny-chat", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ({"model": "tiny-chat", "messages": []}, 400, "messages"),
        ({"model": "tiny-chat", "messages": MESSAGES, "top_logprobs": 9}, 400, "top_logprobs"),
    ],
)
def test_bad_chat_requests_are_4xx_in_openais_shape(client, body, status, field):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert "error" in r.json() and error_of(r)["field"] == field


def test_tokenize_and_detokenize_round_trip(client):
    tokens = client.post("/tokenize", json={"model": "tiny-chat", "text": "w5 w6 w7"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["token_strs"][-1] == "w7"
    back = client.post("/detokenize", json={"model": "tiny-chat", "tokens": tokens["tokens"]}).json()
    assert back["prompt"].endswith("w5 w6 w7")
    bad = client.post("/detokenize", json={"model": "tiny-chat", "tokens": [5, 10**6]})
    assert bad.status_code == 422 and error_of(bad)["field"] == "tokens[1]"
    assert json.loads(client.post("/tokenize", json={"text": ""}).text)["field"] == "text"


def test_tokenize_takes_vllms_prompt_field_or_text(client):
    """vLLM's /tokenize names the text `prompt`; ours took `text`: either one, never both or neither."""
    by_prompt = client.post("/tokenize", json={"model": "tiny-chat", "prompt": "w5 w6 w7"})
    by_text = client.post("/tokenize", json={"model": "tiny-chat", "text": "w5 w6 w7"})
    assert by_prompt.status_code == 200 and by_prompt.json() == by_text.json()
    for body in ({"model": "tiny-chat"}, {"model": "tiny-chat", "prompt": "w5", "text": "w5"}):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 422 and "exactly one of prompt" in r.json()["error"], r.text
