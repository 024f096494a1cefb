"""Transformers causal LMs (GPT-2, GPT-NeoX) served through the runner seam next to our own GPT:
added to the store by `tinyserve store add`, with every completion feature, /score and /attention;
and our GPT exported to GPT-NeoX serves the same tokens as our native runner."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from model_store.export import export_hf
from model_store.ingest import add_checkpoint
from model_store.store import CheckpointError, load_causal_lm, write_checkpoint
from models.tokenizer import EOS_TOKEN, eos_id
from server.api.app import create_app
from server.cli import main as tinyserve
from server.config import Settings
from tests.conftest import tiny_gpt

N = 12  # generated tokens per comparison


def save_hf(folder, architecture: str, tokenizer) -> None:
    """A tiny random transformers model of the architecture, saved as a user would (save_pretrained)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    eos, vocab = eos_id(tokenizer), tokenizer.get_vocab_size()
    torch.manual_seed(0)
    if architecture == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=eos,
                            eos_token_id=eos)  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        config = GPTNeoXConfig(vocab_size=vocab, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, bos_token_id=eos,
                               eos_token_id=eos)  # fmt: skip
        model = GPTNeoXForCausalLM(config)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN).save_pretrained(folder)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("hf-store")
    src = tmp_path_factory.mktemp("hf-src")
    for arch in ("gpt2", "neox"):
        save_hf(src / arch, arch, tiny_tokenizer)
        add_checkpoint(src / arch, f"tiny-{arch}", root)
    ours = tiny_gpt(
        vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=64,
        positions="rope",
    )  # fmt: skip
    write_checkpoint(root / "tiny-gpt", ours, tiny_tokenizer, card="# ours\n", metrics={}, dtype=torch.float32)
    add_checkpoint(export_hf(root / "tiny-gpt", src / "exported"), "tiny-gpt-exported", root)
    return root


@pytest.fixture(scope="module")
def client(store):
    with TestClient(create_app(Settings(store=store, max_new_tokens_cap=40))) as c:
        yield c


def greedy_ids(client, model, prompt) -> list[int]:
    """The generated token ids (TGI's details), not re-encoded text: text need not re-tokenize the same."""
    parameters = {"model": model, "max_new_tokens": N, "min_new_tokens": N, "details": True}
    r = client.post("/generate", json={"inputs": prompt, "parameters": parameters})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def complete(client, model, prompt, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "min_new_tokens": N, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def hf_greedy(store, model_id, ids: list[int]) -> list[int]:
    model, _ = load_causal_lm(store / model_id)
    x = torch.tensor([ids])
    return model.generate(x, max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, len(ids) :].tolist()


@pytest.mark.parametrize("model_id", ["tiny-gpt2", "tiny-neox"])
def test_hf_models_are_served_with_transformers_greedy_tokens(client, store, tiny_tokenizer, model_id):
    listed = {m["id"]: m for m in client.get("/models").json()["data"]}
    assert listed[model_id]["kind"] == "causal" and "tiny-gpt" in listed  # served next to our GPT
    assert model_id in [m["id"] for m in client.get("/v1/models").json()["data"]]
    prompt = "The castle was built in"
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False).ids
    assert greedy_ids(client, model_id, prompt) == hf_greedy(store, model_id, ids)
    body = complete(client, model_id, prompt, logprobs=2)
    assert len(body["choices"][0]["logprobs"]["top_logprobs"][0]) >= 1


@pytest.mark.parametrize("model_id", ["tiny-gpt2", "tiny-neox"])
def test_hf_batches_match_running_alone(client, model_id):
    prompts = ["The castle was built in", "A", "The museum was opened in 1850 , by workers"]
    together = [c["text"] for c in complete(client, model_id, prompts)["choices"]]  # one batch on the engine
    alone = [complete(client, model_id, p)["choices"][0]["text"] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("model_id", ["tiny-gpt2", "tiny-neox"])
def test_hf_models_have_every_completion_feature(client, model_id):
    tgi = client.post("/generate", json={"inputs": "The river", "parameters": {
        "model": model_id, "max_new_tokens": 5, "details": True, "eos_bias": -1e9, "top_n_tokens": 2}})  # fmt: skip
    assert tgi.status_code == 200 and tgi.json()["details"]["generated_tokens"] == 5
    assert complete(client, model_id, "The river", eos_bias=100, min_new_tokens=0)["choices"][0]["text"] == ""
    with client.stream("POST", "/v1/completions", json={"model": model_id, "prompt": "The river", "max_tokens": 4,
                                                       "stream": True, "eos_bias": -1e9}) as r:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = complete(client, model_id, "The river")["choices"][0]["text"]
    stop = text[2:5]
    stopped = complete(client, model_id, "The river", stop=[stop])["choices"][0]
    assert stop not in stopped["text"] and text.startswith(stopped["text"])
    scored = client.post("/score", json={"model": model_id, "text": "The castle was built"}).json()
    assert scored["scored_tokens"] == len(scored["tokens"]) and all(t["logprob"] <= 0 for t in scored["tokens"])
    echo = complete(client, model_id, "The castle was built", echo=True, logprobs=0, max_tokens=0, min_new_tokens=0)
    lps = echo["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == len(scored["tokens"])
    att = client.post("/attention", json={"model": model_id, "text": "The castle was built"}).json()
    assert len(att["attention"]) == 2 and len(att["attention"][0][0]) == 4  # layers, [1], heads
    assert all(abs(s - 1) < 1e-4 for layer in att["row_sums"] for s in layer)  # softmax rows


def test_exported_gpt_serves_the_tokens_of_our_native_runner(client):
    prompts = ["The castle was built in", "A river"]
    native = [c["text"] for c in complete(client, "tiny-gpt", prompts)["choices"]]
    exported = [c["text"] for c in complete(client, "tiny-gpt-exported", prompts)["choices"]]
    assert native == exported
    for prompt in prompts:
        assert greedy_ids(client, "tiny-gpt", prompt) == greedy_ids(client, "tiny-gpt-exported", prompt)


def test_store_add_refuses_what_cannot_be_served_safely(tmp_path, tiny_tokenizer):
    src = tmp_path / "src"
    save_hf(src, "gpt2", tiny_tokenizer)
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pickle"):
        add_checkpoint(src, "x", tmp_path / "store")
    (src / "pytorch_model.bin").unlink()
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Model"}}))
    with pytest.raises(CheckpointError, match="remote code"):
        add_checkpoint(src, "x", tmp_path / "store")
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["T5ForConditionalGeneration"]}))
    with pytest.raises(CheckpointError, match="T5ForConditionalGeneration"):
        add_checkpoint(src, "x", tmp_path / "store")
    assert not (tmp_path / "store" / "x").exists()  # nothing half-copied
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="invalid model id"):
        add_checkpoint(src, "../escape", tmp_path / "store")


def test_store_add_command_uses_the_store_setting(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    save_hf(tmp_path / "src", "neox", tiny_tokenizer)
    monkeypatch.setenv("TINYSERVE_STORE", str(tmp_path / "store"))
    tinyserve(["store", "add", str(tmp_path / "src"), "my-neox"])
    assert (tmp_path / "store" / "my-neox" / "manifest.json").exists()
    with pytest.raises(SystemExit) as e:
        tinyserve(["store", "add", str(tmp_path / "src"), "my-neox"])  # already there
    assert e.value.code == 2 and "already in the store" in capsys.readouterr().err


OTHERS = {  # architectures our decoder does not compute: served by transformers, on its per-slot cache
    "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                word_embed_proj_dim=32),
    "phi": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, partial_rotary_factor=0.5),
    "gemma2": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=64, max_position_embeddings=64, sliding_window=48),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(OTHERS))
def test_other_architectures_serve_transformers_greedy_tokens_from_their_slots(tmp_path, tiny_tokenizer, kind):
    from concurrent.futures import ThreadPoolExecutor

    import transformers

    from models.sampling import SamplingParams
    from server.engine.core import GenerationEngine
    from server.execution.loader import load_runner

    eos = eos_id(tiny_tokenizer)
    config = transformers.AutoConfig.for_model(kind, vocab_size=tiny_tokenizer.get_vocab_size(), bos_token_id=eos,
                                               eos_token_id=eos, pad_token_id=eos, **OTHERS[kind])  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # spread the logits: greedy tokens that are not near-ties
        for p in theirs.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(tmp_path / "src")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer, eos_token=EOS_TOKEN).save_pretrained(
        tmp_path / "src"
    )
    folder = add_checkpoint(tmp_path / "src", kind, tmp_path / "store")
    runner = load_runner("transformers", folder, torch.device("cpu"), torch.float32, 4)
    assert runner.facts.context_length == min(64, OTHERS[kind].get("sliding_window", 64))
    engine = GenerationEngine(runner, max_batch_size=4)
    prompts = [tiny_tokenizer.encode(t).ids for t in ("The castle was built in", "A", "The museum was opened in 18")]
    params = SamplingParams(max_new_tokens=N, temperature=0, eos_bias=float("-inf"))
    with torch.no_grad():
        greedy = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False)
        runs = [theirs.generate(torch.tensor([p]), **greedy) for p in prompts]
    want = [run[0, len(p) :].tolist() for run, p in zip(runs, prompts, strict=True)]
    engine.start()
    try:
        solo = [[e.id for e in engine.generate(p, params)[0]] for p in prompts]
        keys = runner.cache.layers[0].key_buffer
        with ThreadPoolExecutor(3) as pool:
            batched = list(pool.map(lambda p: [e.id for e in engine.generate(p, params)[0]], prompts))
    finally:
        engine.stop()
    assert solo == want and batched == want
    assert runner.cache.layers[0].key_buffer is keys  # the slots stay where they are: no copy a step
