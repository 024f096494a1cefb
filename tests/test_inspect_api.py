"""/inspect/logit-lens, /inspect/ablate and /inspect/patch over HTTP, on the tiny store's models."""

import math
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

from model_store.store import write_checkpoint
from models.tokenizer import eos_id
from server.api.app import create_app
from server.config import Settings
from tests.conftest import error_of, tiny_gpt

TEXT = "The castle was built in the"


@pytest.fixture(scope="module")
def interp_store(store, tmp_path_factory, tiny_tokenizer):
    """The tiny store's masked LM, and a tiny GPT whose weights are large enough that a head or a token
    changes its answer measurably (the shared one's initial weights barely do)."""
    root = tmp_path_factory.mktemp("interp-store")
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=48)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else None
    write_checkpoint(root / "tiny-gpt", model, tiny_tokenizer, card="# t\n", metrics={}, dtype=torch.float32)
    shutil.copytree(store / "tiny-mlm-softmax1", root / "tiny-mlm-softmax1")
    return root


@pytest.fixture(scope="module")
def client(interp_store):
    """float32, so that /score (the served weights) and the lens (float32 from the checkpoint) read the same."""
    settings = Settings(store=interp_store, device="cpu", dtype="float32", ready_after="all")  # as on any machine
    with TestClient(create_app(settings)) as c:
        yield c


def post(client, route, **body):
    return client.post(f"/inspect/{route}", json=body)


def test_logit_lens_has_a_layer_per_block_and_its_last_is_the_models_prediction(client, tiny_tokenizer):
    lens = post(client, "logit-lens", model="tiny-gpt", text=TEXT, top_k=3)
    assert lens.status_code == 200, lens.text
    body = lens.json()
    T = len(body["tokens"])
    assert len(body["layers"]) == 2 + 1 and all(len(layer) == T for layer in body["layers"])
    for layer in body["layers"]:
        for top in layer:
            probs = [p["prob"] for p in top]
            assert len(top) == 3 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    # /score reads a text after the end-of-text token: the lens of that token + the text, position j, is
    # /score's distribution for the text's token j
    eos = tiny_tokenizer.id_to_token(eos_id(tiny_tokenizer))
    after_eos = post(client, "logit-lens", model="tiny-gpt", text=eos + TEXT, top_k=3).json()
    assert len(after_eos["tokens"]) == T + 1 and after_eos["tokens"][1:] == body["tokens"]  # the EOS id first
    score = client.post("/score", json={"model": "tiny-gpt", "text": TEXT, "top_n_tokens": 3}).json()
    for j, scored in enumerate(score["tokens"]):
        lensed = after_eos["layers"][-1][j]
        assert [t for t, _ in scored["top_tokens"]] == [p["token"] for p in lensed]
        assert all(
            math.isclose(lp, math.log(p["prob"]), abs_tol=1e-4)
            for (_, lp), p in zip(scored["top_tokens"], lensed, strict=True)
        )


def test_the_served_dtype_does_not_change_what_the_lens_reads(client, interp_store):
    """A bf16 server looks inside a float32 copy of the checkpoint's weights: the same answer."""
    with TestClient(create_app(Settings(store=interp_store, dtype="bfloat16", models=["tiny-gpt"]))) as bf16:
        got = bf16.post("/inspect/logit-lens", json={"text": TEXT}).json()
    want = post(client, "logit-lens", model="tiny-gpt", text=TEXT).json()
    assert [[[p["id"] for p in top] for top in layer] for layer in got["layers"]] == [
        [[p["id"] for p in top] for top in layer] for layer in want["layers"]
    ]


def test_a_masked_lm_gets_the_lens_through_its_mlm_head(client):
    text = "La <mask> estas granda."
    lens = post(client, "logit-lens", model="tiny-mlm-softmax1", text=text, top_k=1).json()
    filled = client.post("/fill-mask", json={"inputs": text, "model": "tiny-mlm-softmax1", "top_k": 1}).json()
    mask = lens["tokens"].index("<mask>")
    assert lens["layers"][-1][mask][0]["id"] == filled["results"]["tiny-mlm-softmax1"][0]["token"]
    assert len(lens["layers"]) == 2 + 1


def test_ablating_heads_changes_the_prediction_and_each_head_alone_agrees(client):
    lens = post(client, "logit-lens", model="tiny-gpt", text=TEXT).json()
    one = post(client, "ablate", model="tiny-gpt", text=TEXT, heads=[[1, 2]])
    assert one.status_code == 200, one.text
    one = one.json()
    assert [p["id"] for p in one["base"]] == [p["id"] for p in lens["layers"][-1][-1]]  # the unablated model
    assert one["kl"] > 0 and one["ablated"] != one["base"]
    each = post(client, "ablate", model="tiny-gpt", text=TEXT, heads="each").json()
    assert len(each["each"]) == 2 and all(len(row) == 4 for row in each["each"])
    assert all(kl >= 0 for row in each["each"] for kl in row)
    assert each["each"][1][2] == pytest.approx(one["kl"], abs=1e-5)


def test_patching_the_only_changed_token_before_block_0_restores_the_clean_answer(client, tiny_tokenizer):
    clean, corrupt = "The town was built in", "The river was built in"
    ids = [tiny_tokenizer.encode(t, add_special_tokens=False).ids for t in (clean, corrupt)]
    assert len(ids[0]) == len(ids[1])
    changed = [p for p, (a, b) in enumerate(zip(*ids, strict=True)) if a != b]
    assert len(changed) == 1  # one position differs: patching it before block 0 makes the clean input
    r = post(client, "patch", model="tiny-gpt", clean=clean, corrupt=corrupt, answer=" the", foil=" of")
    assert r.status_code == 200, r.text
    body = r.json()
    T = len(body["tokens"])
    assert len(body["grid"]) == 2 and all(len(row) == T for row in body["grid"])
    assert body["clean"] != pytest.approx(body["corrupt"], abs=1e-4)
    assert body["grid"][0][changed[0]] == pytest.approx(body["clean"], abs=1e-4)
    same = [p for p in range(T) if p != changed[0]]
    assert all(body["grid"][0][p] == pytest.approx(body["corrupt"], abs=1e-4) for p in same)  # nothing to patch


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        ("logit-lens", {"model": "nope", "text": "x"}, 404, "model"),
        ("logit-lens", {"text": ""}, 422, "text"),
        ("logit-lens", {"text": "castle " * 200}, 422, "text"),
        ("logit-lens", {"text": "x", "top_k": 11}, 422, "top_k"),
        ("ablate", {"text": TEXT, "heads": [[2, 0]]}, 422, "heads[0]"),
        ("ablate", {"text": TEXT, "heads": [[0, 0], [0, 4]]}, 422, "heads[1]"),
        ("ablate", {"text": TEXT, "heads": [[0]]}, 422, "heads[0]"),
        ("ablate", {"text": TEXT, "heads": []}, 422, "heads"),
        ("ablate", {"text": TEXT, "heads": "all"}, 422, "heads"),
        ("patch", {"clean": "The castle", "corrupt": "The castle was", "answer": " the", "foil": " a"}, 422, "corrupt"),
        (
            "patch",
            {"clean": "The town", "corrupt": "The river", "answer": " the castle", "foil": " a"},
            422,
            "answer",
        ),
        ("patch", {"clean": "The town", "corrupt": "The river", "answer": " the", "foil": ""}, 422, "foil"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(client, route, body, status, field):
    r = post(client, route, **body)
    assert r.status_code == status, r.text
    assert error_of(r)["field"] == field


def test_a_request_over_the_cost_cap_is_refused_with_the_limit(interp_store):
    with TestClient(create_app(Settings(store=interp_store, dtype="float32", max_inspect_tokens=50))) as small:
        r = small.post("/inspect/ablate", json={"text": TEXT, "heads": "each"})
        assert r.status_code == 422 and error_of(r)["field"] == "heads"
        assert "limit is 50" in error_of(r)["error"]
        assert small.post("/inspect/logit-lens", json={"text": TEXT}).status_code == 200  # 3 x its tokens fit
    with TestClient(create_app(Settings(store=interp_store, dtype="float32", max_inspect_tokens=10))) as smaller:
        r = smaller.post("/inspect/logit-lens", json={"text": TEXT})  # an unembedding per layer: 3 passes
        assert r.status_code == 422 and "3 forward passes" in error_of(r)["error"]


def test_hooks_go_on_a_copy_that_shares_the_served_weights(client):
    """The background compiler runs the served module on its own thread: hooks never touch it."""
    from server.features import inspect as inspecting

    m = client.app.state.registry.get("tiny-gpt")
    looked = client.app.state.registry.compute.call(inspecting.decoder_of, m)
    assert looked is not m.model and looked.lm_head.weight is m.model.lm_head.weight
