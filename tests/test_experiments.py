"""The attention-variant experiment runner, on the tiny fixture corpus."""

import json

import pytest
import torch

from model_store.store import load_gpt
from models.gpt import GPTConfig
from tests.conftest import TINY_WIKI, tiny_gpt
from training.experiments import ExperimentConfig, full_pass_loss, leak_free_loss, run_experiments

pytestmark = pytest.mark.slow


def test_leak_free_loss_equals_the_full_pass_only_for_a_causal_model():
    stream = torch.randint(1, 97, (80,), generator=torch.Generator().manual_seed(0))
    causal, leaky = tiny_gpt(), tiny_gpt(masking="zero_after")
    with torch.no_grad():  # sharper attention than the init's near-uniform weights, so the leak shows
        for model in (causal, leaky):
            for block in model.blocks:
                block.attn.qkv.weight.mul_(8)
    causal_gap = abs(leak_free_loss(causal, stream, 79) - full_pass_loss(causal, stream, 79))
    leaky_gap = abs(leak_free_loss(leaky, stream, 79) - full_pass_loss(leaky, stream, 79))
    assert causal_gap < 1e-5  # float noise only
    assert leaky_gap > 1e-3  # 100x the float noise: the leak (a trained model: ~1 nat)


def test_runner_trains_every_variant_alike_and_writes_the_report(tmp_path):
    cfg = ExperimentConfig(
        corpus="wikitext2",
        data=str(TINY_WIKI),
        runs=str(tmp_path / "runs"),
        out=str(tmp_path / "docs"),
        variants=["dot", "zero-mask", "dual-relative"],
        model=GPTConfig(n_layer=1, n_head=4, d_model=16, d_ff=32, context_length=16, dropout=0.0),
        vocab_size=300,
        batch_size=4,
        max_steps=4,
        warmup_steps=1,
        eval_interval=2,
        leak_free_tokens=32,
        train_ppl_chars=2000,
        export=["dual-relative"],
        store=str(tmp_path / "store"),
    )
    results = run_experiments(cfg)
    assert [r["variant"] for r in results] == cfg.variants
    assert results[1]["settings"]["masking"] == "zero_after"
    assert results[2]["settings"]["n_relational_head"] == 2
    assert all(r["step_time_s"] > 0 for r in results)
    assert all(len(r["log"]) == 2 and len(r["sentences"]) == 4 and len(r["samples"]) == 2 for r in results)
    report = (tmp_path / "docs" / "wikitext2.md").read_text()
    assert all(f"| {name} |" in report for name in cfg.variants)
    assert (tmp_path / "docs" / "wikitext2-loss.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "docs" / "wikitext2.json").read_text())
    assert [r["variant"] for r in summary["results"]] == cfg.variants
    served, _ = load_gpt(tmp_path / "store" / "gpt-wikitext2-dual-relative")  # validated: manifest, shapes
    assert served.config.n_relational_head == 2
    # a finished run is reused, not retrained
    again = run_experiments(cfg)
    assert again[0]["train_time_s"] == results[0]["train_time_s"]
