"""The inspection endpoints over HTTP: /attention (JSON in bertviz's shape, PNG) and /fill-mask, on tiny
models built on the fly."""

import pytest
import torch


@pytest.fixture
def client(store_client):
    return store_client  # the app over the shared store (conftest.py), built once for the session


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-mlm-softmax0", "tiny-mlm-softmax1"])
def test_attention_json_in_bertviz_shape(client, model):
    r = client.post("/attention", json={"model": model, "text": "The castle was built", "layers": [1], "heads": [0, 2]})
    assert r.status_code == 200, r.text
    body = r.json()
    T = len(body["tokens"])
    att = body["attention"]
    assert (
        len(att) == 1
        and len(att[0]) == 1
        and len(att[0][0]) == 2
        and len(att[0][0][0]) == T
        and len(att[0][0][0][0]) == T
    )
    sums = body["row_sums"][0]
    if body["attention_variant"] == "softmax1":
        assert all(s < 1 for s in sums)
    else:
        assert all(abs(s - 1) < 1e-4 for s in sums)
    if model == "tiny-gpt":  # causal: nothing above the diagonal
        assert all(att[0][0][0][i][j] == 0 for i in range(T) for j in range(i + 1, T))


def test_attention_png_and_bad_indices(client):
    r = client.post("/attention", json={"model": "tiny-gpt", "text": "The castle", "format": "png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.content[:4] == b"\x89PNG"
    r = client.post("/attention", json={"model": "tiny-gpt", "text": "The castle", "layers": [7]})
    assert r.status_code == 422 and r.json()["field"] == "layers"
    r = client.post("/attention", json={"model": "tiny-gpt", "text": "word " * 100})
    assert r.status_code == 422 and "at most 48" in r.json()["error"]


@pytest.mark.parametrize("layers", [1, 3])
def test_attention_png_survives_mathtext_tokens(layers):
    """Token labels come from client text: '$\\frac{$' must be drawn as text, not parsed as mathtext."""
    from server.features.readouts import attention_png

    tokens = ["$\\frac{$", "$x$", "ok"]
    result = {"weights": torch.rand(layers, 2, 3, 3), "tokens": tokens, "layers": list(range(layers)),
              "heads": [0, 1], "model": "m", "attention_variant": "softmax0"}  # fmt: skip
    assert attention_png(result)[:4] == b"\x89PNG"
    single = {**result, "weights": result["weights"][:1, :1], "layers": [0], "heads": [0]}
    assert attention_png(single)[:4] == b"\x89PNG"


def test_fill_mask_pipeline_format_and_both_variants(client):
    r = client.post("/fill-mask", json={"inputs": "The castle was <mask> in 1350 .", "variant": "both", "top_k": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert list(results) == ["tiny-mlm-softmax0", "tiny-mlm-softmax1"]
    for cands in results.values():
        assert len(cands) == 3 and cands[0]["score"] >= cands[1]["score"] >= cands[2]["score"]
        assert set(cands[0]) == {"score", "token", "token_str", "sequence"}
        assert "<mask>" not in cands[0]["sequence"]
    two = client.post("/fill-mask", json={"inputs": "<mask> castle <mask> .", "top_k": 2}).json()["results"]
    assert len(two["tiny-mlm-softmax0"]) == 2 and len(two["tiny-mlm-softmax0"][0]) == 2  # one list per mask
    targeted = client.post("/fill-mask", json={"inputs": "The <mask> .", "targets": ["castle", "river"]}).json()
    assert len(targeted["results"]["tiny-mlm-softmax0"]) == 2


def test_fill_mask_matches_the_transformers_pipeline(client, store):
    import transformers

    pipe = transformers.pipeline("fill-mask", model=str(store / "tiny-mlm-softmax1"))
    ref = pipe("The castle was <mask> in 1350 .", top_k=3)
    ours = client.post(
        "/fill-mask", json={"inputs": "The castle was <mask> in 1350 .", "variant": "softmax1", "top_k": 3}
    )
    got = ours.json()["results"]["tiny-mlm-softmax1"]
    assert [c["token"] for c in got] == [c["token"] for c in ref]
    assert all(abs(a["score"] - b["score"]) < 1e-5 for a, b in zip(got, ref, strict=True))
    assert [c["sequence"] for c in got] == [c["sequence"] for c in ref]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": "no mask here"}, "inputs"),
        ({"inputs": "<mask> " * 30}, "inputs"),
        ({"inputs": "a <mask>", "top_k": 0}, "top_k"),
        ({"inputs": "a <mask>", "model": "tiny-gpt"}, "model"),
        ({"inputs": "a <mask>", "variant": "softmax2"}, "variant"),
    ],
)
def test_fill_mask_bad_input(client, body, field):
    r = client.post("/fill-mask", json=body)
    assert 400 <= r.status_code < 500 and r.json()["field"] == field, r.text
