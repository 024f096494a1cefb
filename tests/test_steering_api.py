"""`steer` on the completion routes, vectors from contrasting prompts, and llama.cpp's control-vector files."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from model_store.control_vectors import read_control_vector
from tests.conftest import error_of

WIDTH = 32  # the store's tiny-gpt: d_model 32, two blocks, so blocks 1..1 take a vector
PROMPT = "The castle was built"


@pytest.fixture(scope="module")
def steer_store(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("steer-store") / "store"
    shutil.copytree(store / "tiny-gpt", root / "tiny-gpt")
    return root


@pytest.fixture(scope="module")
def client(steer_store):
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    with TestClient(create_app(Settings(store=steer_store, models=["tiny-gpt"]))) as c:
        yield c


def vector(seed: int = 0) -> list[float]:
    return torch.randn(WIDTH, generator=torch.Generator().manual_seed(seed)).tolist()


def generate(client, steer=None, **extra) -> dict:
    parameters = {"max_new_tokens": 12, "eos_bias": -1e9, "details": True, **extra}
    if steer is not None:
        parameters["steer"] = steer
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()


def ids(body: dict) -> list[int]:
    return [t["id"] for t in body["details"]["tokens"]]


def test_steer_changes_the_completion_the_same_way_on_every_route(client):
    steer = [{"layer": 1, "vector": vector(), "scale": 6.0}]
    plain, steered = generate(client), generate(client, steer)
    assert ids(steered) != ids(plain)
    assert ids(generate(client, steer)) == ids(steered)  # deterministic
    assert ids(generate(client, [{"layer": 1, "vector": vector(), "scale": 0.0}])) == ids(plain)  # scale 0: plain
    completion = client.post(
        "/v1/completions",
        json={
            "model": "tiny-gpt",
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "eos_bias": -1e9,
            "steer": steer,
        },
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == steered["generated_text"]


def test_a_vector_from_contrasting_prompts_is_kept_by_name_and_exported_as_a_control_vector(client, tmp_path):
    pairs = [
        {"positive": "The weather was lovely and warm", "negative": "The weather was awful and cold"},
        {"positive": "She was happy", "negative": "She was sad"},
    ]
    made = client.post("/inspect/steering-vector", json={"pairs": pairs, "name": "mood"})
    assert made.status_code == 200, made.text
    layers = made.json()["layers"]
    assert list(layers) == ["1"] and len(layers["1"]) == WIDTH
    pca = client.post("/inspect/steering-vector", json={"pairs": pairs, "method": "pca"}).json()["layers"]["1"]
    mean = torch.tensor(layers["1"])
    assert torch.nn.functional.cosine_similarity(torch.tensor(pca), mean, dim=0) > 0  # signed towards the positives
    assert "mood" in client.get("/inspect/steering-vectors").json()["vectors"]
    by_name = generate(client, [{"name": "mood", "scale": 4.0}])
    by_value = generate(client, [{"layer": 1, "vector": layers["1"], "scale": 4.0}])
    assert ids(by_name) == ids(by_value)
    exported = client.get("/inspect/steering-vector/mood.gguf")
    assert exported.status_code == 200
    (tmp_path / "mood.gguf").write_bytes(exported.content)
    read = read_control_vector(tmp_path / "mood.gguf")
    assert list(read) == [1] and torch.equal(read[1], mean)  # float32 both ways: the same values


def llama_cpp_control_vector(path, directions: dict[int, np.ndarray], hint: str = "tiny-gpt"):
    """A file as llama.cpp's cvector-generator writes it (gguf-py's writer, architecture controlvector)."""
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", hint)
    writer.add_uint32("controlvector.layer_count", len(directions))
    for block, v in directions.items():
        writer.add_tensor(f"direction.{block}", v.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_cpp_control_vector_file_added_to_the_store_steers_by_name(
    client, steer_store, tmp_path, capsys, monkeypatch
):
    from server.cli import store

    direction = np.array(vector(5), dtype=np.float32)
    llama_cpp_control_vector(tmp_path / "calm.gguf", {1: direction})
    llama_cpp_control_vector(tmp_path / "wide.gguf", {1: np.zeros(WIDTH + 1, dtype=np.float32)})
    llama_cpp_control_vector(tmp_path / "zero.gguf", {0: direction})
    monkeypatch.setenv("TINYSERVE_STORE", str(steer_store))
    store(["add-vector", str(tmp_path / "calm.gguf"), "calm", "--model", "tiny-gpt"])
    for bad, rule in [("wide", "33 wide; the model's is 32"), ("zero", "count from 1")]:
        with pytest.raises(SystemExit) as exit:
            store(["add-vector", str(tmp_path / f"{bad}.gguf"), bad, "--model", "tiny-gpt"])
        assert exit.value.code == 2 and rule in capsys.readouterr().err
    with pytest.raises(SystemExit):
        store(["add-vector", str(tmp_path / "calm.gguf"), "../escape", "--model", "tiny-gpt"])
    assert (steer_store / "tiny-gpt" / "vectors" / "calm.gguf").is_file()
    assert not (steer_store / "tiny-gpt" / "vectors" / "wide.gguf").exists()
    by_name = generate(client, [{"name": "calm", "scale": 3.0}])
    assert ids(by_name) == ids(generate(client, [{"layer": 1, "vector": direction.tolist(), "scale": 3.0}]))
    assert ids(by_name) != ids(generate(client))


@pytest.mark.parametrize(
    ("steer", "status", "field", "says"),
    [
        ([{"layer": 0, "vector": [0.1] * WIDTH}], 422, "parameters.steer[0].layer", "1..1"),
        ([{"layer": 2, "vector": [0.1] * WIDTH}], 422, "parameters.steer[0].layer", "out of range"),
        ([{"layer": 1, "vector": [0.1] * 3}], 422, "parameters.steer[0].vector", "32 wide"),
        ([{"vector": [0.1] * WIDTH}], 422, "parameters.steer[0].layer", "needs the block"),
        ([{"name": "no-such-vector"}], 404, "parameters.steer[0].name", "no vector"),
        ([{"layer": 1}], 422, "steer", "exactly one of vector and name"),
        ([{"name": "../../etc/passwd"}], 422, "steer", "pattern"),
    ],
)
def test_a_bad_steer_is_a_4xx_naming_its_field(client, steer, status, field, says):
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"steer": steer}})
    assert response.status_code == status, response.text
    error = error_of(response)
    assert field in (error["field"] or "") and says in error["error"], error


def test_a_scale_that_is_not_finite_is_refused(client):
    body = '{"inputs": "The castle", "parameters": {"steer": [{"layer": 1, "vector": [0.1], "scale": Infinity}]}}'
    response = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422 and "scale" in response.text


def test_steering_vector_requests_are_checked(client):
    pairs = [{"positive": "a", "negative": "b"}]
    bad = client.post("/inspect/steering-vector", json={"pairs": pairs, "layers": [0, 1]})
    assert bad.status_code == 422 and error_of(bad)["field"] == "layers" and "out of range" in error_of(bad)["error"]
    one = client.post("/inspect/steering-vector", json={"pairs": pairs, "layers": [1, 1]})
    assert one.status_code == 200 and list(one.json()["layers"]) == ["1"]
    assert client.post("/inspect/steering-vector", json={"pairs": []}).status_code == 422
    missing = client.get("/inspect/steering-vector/unknown.gguf")
    assert missing.status_code == 404


def test_a_chat_and_a_response_are_steered_alike(tools_client):
    """The tiny Hermes Llama (tests/tool_models.py: 32 wide, two blocks)."""
    steer = [{"layer": 1, "vector": torch.randn(32, generator=torch.Generator().manual_seed(2)).tolist(), "scale": 8.0}]
    messages = [{"role": "user", "content": "Say something"}]
    body = {"model": "tiny-hermes", "messages": messages, "max_tokens": 10, "temperature": 0}
    plain = tools_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    chat = tools_client.post("/v1/chat/completions", json={**body, "steer": steer})
    assert chat.status_code == 200, chat.text
    steered = chat.json()["choices"][0]["message"]["content"]
    assert steered != plain
    response = tools_client.post(
        "/v1/responses",
        json={"model": "tiny-hermes", "input": messages, "max_output_tokens": 10, "temperature": 0, "steer": steer},
    )
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == steered


def test_an_echoed_prompt_is_scored_with_its_steer(client):
    """/v1/completions' echo scores the prompt as the steered request reads it: a scale of 0 scores as plain."""

    def echoed(scale: float) -> list[float]:
        body = {"model": "tiny-gpt", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
                "steer": [{"layer": 1, "vector": vector(), "scale": scale}]}  # fmt: skip
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["token_logprobs"][1:]

    plain, steered = echoed(0.0), echoed(6.0)
    assert max(abs(a - b) for a, b in zip(plain, steered, strict=True)) > 0.1
    assert echoed(0.0) == plain
