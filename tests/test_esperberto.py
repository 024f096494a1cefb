import json
import math

import pytest
import torch
from scipy.stats import kurtosis as scipy_kurtosis
from transformers import AutoModelForMaskedLM

from models.esperberto import build_model, make_config, save_model, softmax1_attention
from tests.conftest import TINY_WIKI
from training.esperberto.data import encode_blocks, read_corpus, split_lines, train_roberta_tokenizer
from training.esperberto.study import Moments, activation_study, excess_kurtosis, parameter_kurtosis
from training.esperberto.train import MLMTrainConfig, evaluate_mlm, shuffle_inner, train_mlm

PRESETS = ["tiny", "rotary-tiny"]  # RoBERTa (the original study's) and ModernBERT (the shipped one)


def tiny(variant: str, seed: int = 0, preset: str = "tiny"):
    return build_model(make_config(preset, variant, vocab_size=120), seed=seed).eval()


@pytest.fixture(scope="module")
def mlm_tokenizer():
    train, _ = split_lines(read_corpus(str(TINY_WIKI)), 4)
    return train_roberta_tokenizer(train, 300)


@pytest.mark.parametrize("preset", PRESETS)
def test_both_variants_start_from_identical_weights(preset):
    a, b = tiny("softmax0", preset=preset), tiny("softmax1", preset=preset)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.config._attn_implementation == "sdpa" and b.config._attn_implementation == "softmax1"


@pytest.mark.parametrize("preset", PRESETS)
def test_softmax1_model_output_differs_from_softmax0_with_same_weights(preset):
    ids = torch.randint(5, 120, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = tiny("softmax0", preset=preset), tiny("softmax1", preset=preset)
        # at initialisation attention adds little to the logits: the variants differ by ~1e-4, float32's
        # rounding by ~1e-7 (the same model twice: equal)
        assert torch.allclose(a(ids).logits, tiny("softmax0", preset=preset)(ids).logits, atol=1e-6)
        assert not torch.allclose(a(ids).logits, b(ids).logits, atol=1e-5)


def test_softmax1_attention_matches_hand_computation():
    module = torch.nn.Module().eval()
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (B=1, H=1, T=2, D=2)
    k = torch.tensor([[[[1.0, 1.0], [2.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    mask = torch.tensor([[[[0.0, torch.finfo(torch.float32).min]] * 2]])  # key 1 is padding
    out, w = softmax1_attention(module, q, k, v, mask, scaling=1.0)
    # query 0 sees key 0 only: score 1 -> e/(1+e); query 1: score 1 -> e/(1+e)
    p = math.e / (1 + math.e)
    torch.testing.assert_close(w[0, 0], torch.tensor([[p, 0.0], [p, 0.0]]))
    torch.testing.assert_close(out[0, :, 0], torch.tensor([[p * 1, p * 2], [p * 1, p * 2]]))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", ["softmax0", "softmax1"])
def test_padding_does_not_change_real_token_logits(variant, preset):
    model = tiny(variant, preset=preset)
    ids = torch.randint(5, 120, (1, 8))
    padded = torch.cat([ids, torch.full((1, 4), model.config.pad_token_id)], dim=1)
    mask = torch.cat([torch.ones(1, 8), torch.zeros(1, 4)], dim=1).long()
    with torch.no_grad():
        ref = model(ids).logits
        out = model(padded, attention_mask=mask).logits[:, :8]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("preset", PRESETS)
def test_save_load_round_trip_keeps_the_variant(tmp_path, preset):
    model = tiny("softmax1", seed=3, preset=preset)
    save_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["attention_variant"] == "softmax1" and config["attn_implementation"] == "softmax1"
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == "softmax1"
    assert loaded.config.attention_variant == "softmax1"
    ids = torch.randint(5, 120, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_kurtosis_matches_scipy():
    x = torch.distributions.StudentT(5.0).sample((4000,))
    assert math.isclose(excess_kurtosis(x), scipy_kurtosis(x.numpy(), fisher=True, bias=True), rel_tol=1e-6)
    m = Moments()
    for chunk in x.split(700):
        m.add(chunk)
    assert math.isclose(m.kurtosis(), scipy_kurtosis(x.numpy(), fisher=True, bias=True), rel_tol=1e-6)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", ["softmax0", "softmax1"])
def test_hooks_see_every_layer_and_every_position(variant, preset):
    model = tiny(variant, preset=preset)
    blocks = torch.randint(5, 120, (5, 16))
    r = activation_study(model, blocks, batch_size=2)
    n_layer = model.config.num_hidden_layers
    assert all(len(v) == n_layer for v in r["activations"].values())
    assert r["activation_elements"] == blocks.numel() * model.config.hidden_size  # all samples, not the first
    nothing = torch.tensor(r["nothing_mass"])
    assert nothing.shape == (n_layer, model.config.num_attention_heads)
    if variant == "softmax0":
        assert nothing.abs().max() < 1e-6
    else:
        assert (nothing > 0).all()
    assert model.config._attn_implementation == ("sdpa" if variant == "softmax0" else "softmax1")  # restored
    assert len(parameter_kurtosis(model)["LayerNorm Weight"]) == n_layer


def test_tiny_mlm_run_lowers_loss(tmp_path, mlm_tokenizer):
    mlm_tokenizer.save_pretrained(tmp_path / "tok")
    cfg = MLMTrainConfig(
        data=str(TINY_WIKI),
        out=str(tmp_path / "run"),
        variant="softmax1",
        preset="rotary-tiny",
        tokenizer=str(tmp_path / "tok"),
        block_size=32,
        holdout_every=4,
        batch_size=8,
        max_steps=40,
        lr=3e-3,
        warmup_steps=4,
        eval_steps=20,
        bf16=False,
        export=str(tmp_path / "store"),
    )
    metrics = train_mlm(cfg, command="test")
    _, valid = split_lines(read_corpus(str(TINY_WIKI)), 4)
    blocks = encode_blocks(valid, mlm_tokenizer, 32)
    untrained = evaluate_mlm(
        build_model(make_config("rotary-tiny", "softmax1", vocab_size=len(mlm_tokenizer))), mlm_tokenizer, blocks
    )
    assert metrics["heldout"]["mlm_loss"] < untrained["mlm_loss"] - 0.5
    assert (tmp_path / "store" / "manifest.json").exists()
    card = (tmp_path / "store" / "README.md").read_text()
    assert "top-5 accuracy" in card and "| `Mi <mask> vin.` |" in card
    rows = [json.loads(line) for line in (tmp_path / "run" / "heldout_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [20, 40] and all("order_gap" in r for r in rows)
    best = min(rows, key=lambda r: r["valid_loss"])
    assert metrics["best_step"] == best["step"]  # the kept checkpoint is the best one, not the last
    assert (tmp_path / "store" / "heldout_log.jsonl").read_text().count("\n") == 2  # the curve's data ships too
    exported = AutoModelForMaskedLM.from_pretrained(tmp_path / "store")
    assert exported.config._attn_implementation == "softmax1"


def test_shuffle_inner_keeps_special_tokens_and_token_label_pairs():
    ids = torch.arange(24).view(2, 12)
    labels = torch.where(ids % 3 == 0, ids + 100, -100)
    sid, slab = shuffle_inner(ids, labels, seed=1)
    assert torch.equal(sid[:, [0, -1]], ids[:, [0, -1]])
    assert not torch.equal(sid, ids)
    for row in range(2):
        assert sorted(sid[row].tolist()) == ids[row].tolist()
        assert torch.equal(slab[row], torch.where(sid[row] % 3 == 0, sid[row] + 100, -100))


def test_order_gap_is_zero_without_positions_and_positive_with_them(mlm_tokenizer):
    """A model that cannot see order has no gap; the metric is not noise around a constant."""
    _, valid = split_lines(read_corpus(str(TINY_WIKI)), 4)
    blocks = encode_blocks(valid, mlm_tokenizer, 32)
    model = build_model(make_config("rotary-tiny", "softmax0", vocab_size=len(mlm_tokenizer)), seed=0)
    with torch.no_grad():
        for layer in model.model.layers:  # sharp attention, so that what a token attends to matters
            layer.attn.Wqkv.weight.mul_(20)
            layer.attn.Wo.weight.mul_(50)

    # a random model's gap on a few dozen masked tokens has either sign and any size (0.003 on one CPU,
    # -0.0007 on another): its mean size over several masks and shuffles is what is not noise
    def gaps() -> list[float]:
        return [abs(evaluate_mlm(model, mlm_tokenizer, blocks, seed=seed)["order_gap"]) for seed in range(4)]

    with_rope = gaps()
    with torch.no_grad():
        model.model.rotary_emb.full_attention_inv_freq.zero_()  # rotation by angle 0: no positions
    without = gaps()
    assert max(without) < 1e-4
    assert sum(with_rope) / len(with_rope) > 1e-3


def test_rotary_preset_is_global_attention_with_the_studied_biases():
    config = make_config("rotary-small", "softmax1")
    assert config.layer_types == ["full_attention"] * config.num_hidden_layers
    assert config.attention_bias and config.norm_bias and config.mlp_bias
    assert config.rope_parameters["full_attention"]["rope_theta"] == 10_000.0


@pytest.mark.parametrize("preset", PRESETS)
def test_masked_positions_loss_equals_the_models_own_mlm_loss(preset, tmp_path):
    """The trainer's shortcut (LM head on masked positions only) is the same loss, not an approximation."""
    from transformers import TrainingArguments

    from training.esperberto.train import MaskedPositionsTrainer

    model = build_model(make_config(preset, "softmax1", vocab_size=300), seed=0).eval()  # no dropout
    ids = torch.randint(5, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    inputs = {"input_ids": ids, "labels": labels}
    trainer = MaskedPositionsTrainer(model=model, args=TrainingArguments(tmp_path, use_cpu=True, report_to=[]))
    ours = trainer.compute_loss(model, inputs)
    torch.testing.assert_close(ours, model(**inputs).loss)


def test_bf16_training_autocasts_the_encoder(tmp_path):
    """accelerate autocasts model.forward only; the masked-positions loss calls the encoder directly."""
    from transformers import TrainingArguments

    from training.esperberto.train import MaskedPositionsTrainer

    model = build_model(make_config("rotary-tiny", "softmax0", vocab_size=300), seed=0)
    args = TrainingArguments(tmp_path, use_cpu=True, bf16=True, report_to=[])
    trainer = MaskedPositionsTrainer(model=model, args=args)
    dtypes = []
    hook = model.model.layers[0].mlp.Wi.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    ids = torch.randint(5, 300, (2, 16))
    trainer.compute_loss(model, {"input_ids": ids, "labels": ids})
    hook.remove()
    assert dtypes == [torch.bfloat16]


def test_sinusoidal_position_init_is_the_scaled_table_for_both_variants():
    models = [build_model(make_config("tiny", v), seed=3, position_init="sinusoidal") for v in ("softmax0", "softmax1")]
    table = models[0].roberta.embeddings.position_embeddings.weight
    torch.testing.assert_close(table, models[1].roberta.embeddings.position_embeddings.weight)
    assert torch.all(table[1] == 0)  # the padding position stays zero
    # position p's row: sin/cos of p / 10000^(2i/C), scaled to the embeddings' init std
    p, C = 7, table.shape[1]
    expected = torch.tensor(
        [
            math.sin(p / 10000 ** (2 * (i // 2) / C)) if i % 2 == 0 else math.cos(p / 10000 ** (2 * (i // 2) / C))
            for i in range(C)
        ]
    )
    torch.testing.assert_close(table[p], expected * 0.02 * math.sqrt(2))
    random = build_model(make_config("tiny", "softmax0"), seed=3).roberta.embeddings.position_embeddings.weight
    assert not torch.allclose(random[2:], table[2:])


def test_kurtosis_command_writes_the_study_for_both_variants(store, tmp_path):
    import shutil

    from training.__main__ import main

    folders = []
    for v in ("softmax0", "softmax1"):
        folder = shutil.copytree(store / f"tiny-mlm-{v}", tmp_path / "store" / v)
        row = {"train_loss": 5.0, "valid_loss": 4.0, "top1_accuracy": 0.1, "order_gap": 0.5}
        (folder / "heldout_log.jsonl").write_text("".join(json.dumps({"step": s, **row}) + "\n" for s in (10, 20)))
        folders.append(str(folder))
    main(["kurtosis", *folders, "--data", str(TINY_WIKI), "--holdout-every", "4", "--block-size", "32", "--out",
          str(tmp_path)])  # fmt: skip
    report = (tmp_path / "kurtosis.md").read_text()
    assert "`model.layers.{i}.attn.Wo`" in report and "| softmax1 | — | — | — | — | 4.44 |" in report
    data = json.loads((tmp_path / "kurtosis.json").read_text())
    assert set(data) == {"softmax0", "softmax1"}
    assert len(data["softmax1"]["activations"]["Dense"]) == 2  # one value per layer
    pngs = ("kurtosis_parameters", "kurtosis_activations", "heldout_curves")
    assert all((tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG" for name in pngs)
    assert "![held-out curves](heldout_curves.png)" in report


@pytest.mark.parametrize("preset", PRESETS)
def test_fill_mask_equals_the_transformers_pipeline(preset, mlm_tokenizer):
    from transformers import pipeline

    from models.esperberto.fill_mask import fill_mask, target_ids

    model = build_model(make_config(preset, "softmax1", vocab_size=len(mlm_tokenizer)), seed=2).eval()
    text = "The <mask> was built in the <mask> century."
    ours = fill_mask(model, mlm_tokenizer, mlm_tokenizer(text, return_tensors="pt")["input_ids"][0], top_k=4)
    theirs = pipeline("fill-mask", model=model, tokenizer=mlm_tokenizer)(text, top_k=4)
    assert [[c["token"] for c in row] for row in ours] == [[c["token"] for c in row] for row in theirs]
    for a, b in zip(sum(ours, []), sum(theirs, []), strict=True):
        assert a["sequence"] == b["sequence"] and math.isclose(a["score"], b["score"], rel_tol=1e-4)
    targets = target_ids(mlm_tokenizer, ["castle", "12th"])
    restricted = fill_mask(model, mlm_tokenizer, mlm_tokenizer(text, return_tensors="pt")["input_ids"][0], 5, targets)
    assert all(len(row) == len(targets) and {c["token"] for c in row} == set(targets.tolist()) for row in restricted)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_softmax1_checkpoint_never_loads_silently_as_softmax(preset, tmp_path):
    """Without `import training.esperberto` (which registers softmax1), loading must fail, not fall back."""
    import subprocess
    import sys

    save_model(tiny("softmax1", preset=preset), tmp_path)
    code = (
        "import sys; from transformers import AutoModelForMaskedLM\n"
        f"m = AutoModelForMaskedLM.from_pretrained({str(tmp_path)!r})\n"
        "print(m.config._attn_implementation); sys.exit(3)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode not in (0, 3), out.stdout  # 3: it loaded, with some other attention
    assert "softmax1" in out.stderr


def test_presets_are_the_command_lines_choices():
    from typing import get_args

    from models.esperberto.model import PRESETS, Preset

    assert set(get_args(Preset)) == set(PRESETS)
