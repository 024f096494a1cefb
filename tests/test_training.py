import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from model_store.store import load_gpt
from models.gpt import GPTConfig
from tests.conftest import REPO, TINY_WIKI
from training.card import rewrite_card
from training.trainer import TrainConfig, lr_at, train

pytestmark = pytest.mark.slow

TINY_MODEL = dict(vocab_size=300, n_layer=2, n_head=4, d_model=32, d_ff=64, context_length=32, dropout=0.0)


def tiny_train_config(out, **overrides) -> TrainConfig:
    base = dict(
        data=str(TINY_WIKI),
        out=str(out),
        model=GPTConfig(**TINY_MODEL),
        batch_size=8,
        max_steps=60,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=5,
        eval_interval=20,
        eval_batches=2,
        save_interval=20,
    )
    base.update(overrides)
    return TrainConfig(**base)


def read_log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_tiny_run_lowers_loss_and_exports_a_servable_checkpoint(tmp_path):
    metrics = train(tiny_train_config(tmp_path, export=str(tmp_path / "store" / "tiny")), command="test")
    log = read_log(tmp_path)
    uniform = math.log(300)  # an untrained model's loss is about log(vocab)
    assert log[-1]["valid_loss"] < log[0]["valid_loss"] < uniform
    assert log[-1]["valid_loss"] < uniform - 1.0
    assert metrics["test"]["word_ppl"] > metrics["test"]["token_ppl"] > 1  # more tokens than words
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    card = (tmp_path / "store" / "tiny" / "README.md").read_text()
    assert "word-level ppl" in card and "Command: `test`" in card
    assert "## Samples" in card and "| eos_bias | mean completion length" in card  # what a user sees
    model, tok = load_gpt(tmp_path / "store" / "tiny")
    assert model.config.vocab_size == tok.get_vocab_size()
    rewrite_card(tmp_path, tmp_path / "store" / "tiny", note="Replaces nothing.")
    assert "## Notes\n\nReplaces nothing." in (tmp_path / "store" / "tiny" / "README.md").read_text()
    load_gpt(tmp_path / "store" / "tiny")  # the manifest still matches


def test_a_run_can_start_from_a_shipped_checkpoint_at_a_longer_context(tmp_path):
    rope = GPTConfig(**{**TINY_MODEL, "positions": "rope"})
    store = tmp_path / "store" / "a"
    train(tiny_train_config(tmp_path / "a", model=rope, export=str(store), final_eval=False, max_steps=40))
    shipped, _ = load_gpt(store)
    longer = replace(rope, context_length=64)  # RoPE holds no weight per position
    b = tiny_train_config(tmp_path / "b", model=longer, init_from=str(store), max_steps=20)
    for other in (replace(longer, positions="learned"), replace(longer, d_model=64)):
        with pytest.raises(ValueError, match="--init-from"):
            train(replace(b, model=other))
    train(replace(b, lr=0.0, min_lr=0.0, final_eval=False))  # no updates: the weights stay the shipped ones
    started = torch.load(tmp_path / "b" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    assert all(torch.equal(started[k], v) for k, v in shipped.state_dict().items())
    assert read_log(tmp_path / "b")[0]["valid_loss"] < math.log(300) - 1.0  # trained from the first step
    assert not (tmp_path / "b" / "tokenizer.json").exists()  # the shipped checkpoint's tokenizer


def test_runs_are_reproducible_and_resumable(tmp_path):
    dropout = GPTConfig(**{**TINY_MODEL, "dropout": 0.1})  # resuming must also continue the dropout RNG
    a = train(tiny_train_config(tmp_path / "a", model=dropout, max_steps=40, final_eval=False))
    b_cfg = tiny_train_config(
        tmp_path / "b", model=GPTConfig(**{**TINY_MODEL, "dropout": 0.1}), max_steps=40, final_eval=False
    )
    assert train(replace(b_cfg, stop_at=20)) == {}  # stop ...
    b = train(b_cfg)  # ... and resume
    assert a["final_valid_loss"] == b["final_valid_loss"]
    assert [e["valid_loss"] for e in read_log(tmp_path / "a")] == [e["valid_loss"] for e in read_log(tmp_path / "b")]
    wa = torch.load(tmp_path / "a" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    wb = torch.load(tmp_path / "b" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_learning_rate_schedule_warms_up_then_decays():
    cfg = tiny_train_config("unused", max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert abs(lr_at(100, cfg) - 0.1) < 1e-9


def test_two_process_ddp_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",  # a free rendezvous port, not a fixed one another run may hold
        "-m",
        "training",
        "gpt",
        "--data",
        str(TINY_WIKI),
        "--out",
        str(tmp_path),
        "--vocab-size",
        "300",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--d-model",
        "16",
        "--context-length",
        "16",
        "--batch-size",
        "4",
        "--max-steps",
        "6",
        "--eval-interval",
        "3",
        "--save-interval",
        "3",
        "--eval-batches",
        "1",
        "--device",
        "cpu",
        "--no-final-eval",
    ]
    # its own process group, its output in files: on a timeout the ranks go with the launcher (subprocess.run kills
    # only the launcher, then waits for the pipes its ranks still hold: a rank stuck at exit hung the suite once)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            returncode = launcher.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            pytest.fail(f"the DDP run took over 240 s: {err.read_text()[-3000:]}")
    assert returncode == 0, err.read_text()[-3000:]
    log = read_log(tmp_path)
    assert [e["step"] for e in log] == [3, 6]  # written once, by rank 0
    assert (tmp_path / "model" / "model.safetensors").exists()
    printed = out.read_text()
    assert "16 tokens/step" not in printed and "128 tokens/step" in printed  # 2 ranks x 4 x 16


def test_patience_stops_the_run_and_ships_the_best_checkpoint(tmp_path):
    # a learning rate this high makes the validation loss rise after its first dip; the run must stop
    # within `patience` evaluations of its best and export the best weights, not the last
    cfg = tiny_train_config(tmp_path, lr=0.5, min_lr=0.5, warmup_steps=1, max_steps=200, eval_interval=5, patience=2)
    metrics = train(cfg)
    log = read_log(tmp_path)
    best = min(log, key=lambda e: e["valid_loss"])
    assert log[-1]["step"] < 200 and log[-1]["step"] == best["step"] + 2 * 5
    assert metrics["best_step"] == best["step"] and metrics["best_valid_loss"] == best["valid_loss"]
    model, _ = load_gpt(tmp_path / "model")
    stored = torch.load(tmp_path / "best.pt", map_location="cpu", weights_only=True)["model"]
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, stored[name].half().float())


def test_detokenized_paragraph_run_counts_words_in_the_raw_split_and_resumes_its_ema(tmp_path):
    cfg = tiny_train_config(tmp_path / "a", detokenize=True, doc_mode="wikitext-paragraph", ema_decay=0.9, max_steps=40)
    a = train(cfg)
    assert a["test"]["words"] == len((TINY_WIKI / "test.txt").read_text().split())  # raw words, not detokenised
    log = read_log(tmp_path / "a")
    assert all("ema_valid_loss" in e for e in log)
    assert a["weights"] == (
        "ema" if min(e["ema_valid_loss"] for e in log) < min(e["valid_loss"] for e in log) else "raw"
    )
    b_cfg = replace(cfg, out=str(tmp_path / "b"))
    train(replace(b_cfg, stop_at=20))
    b = train(b_cfg)
    assert [e["ema_valid_loss"] for e in read_log(tmp_path / "b")] == [e["ema_valid_loss"] for e in log]
    assert a["best_valid_loss"] == b["best_valid_loss"]
