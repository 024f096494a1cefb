"""`python -m training`: flags, defaults and help come from the config dataclasses, once."""

import dataclasses

import pytest

from models.gpt import GPTConfig
from training.__main__ import build_parser, configs, gpt_train_config
from training.esperberto.train import MLMTrainConfig
from training.experiments import ExperimentConfig
from training.trainer import TrainConfig


def test_gpt_flags_fill_the_train_and_model_configs_and_keep_their_defaults():
    args = build_parser().parse_args(
        [
            "gpt",
            "--out",
            "runs/x",
            "--variant",
            "rope",
            "--n-layer",
            "3",
            "--d-model",
            "96",
            "--max-steps",
            "7",
            "--no-final-eval",
            "--amp",
            "bf16",
            "--vocab-size",
            "512",
            "--patience",
            "4",
        ]  # fmt: skip
    )
    cfg = gpt_train_config(args)
    assert (cfg.out, cfg.max_steps, cfg.final_eval, cfg.amp, cfg.patience) == ("runs/x", 7, False, "bf16", 4)
    m = cfg.model
    assert (m.n_layer, m.d_model, m.d_ff, m.positions, m.vocab_size) == (3, 96, 4 * 96, "rope", 512)
    for f in dataclasses.fields(TrainConfig):  # everything not given is the dataclass's own default
        if f.name not in {"out", "max_steps", "final_eval", "amp", "patience", "model"}:
            assert getattr(cfg, f.name) == f.default, f.name
    assert m.n_head == GPTConfig().n_head and m.dropout == GPTConfig().dropout


def test_dual_variants_split_the_heads():
    cfg = gpt_train_config(build_parser().parse_args(["gpt", "--out", "r", "--variant", "dual-relative"]))
    assert (cfg.model.n_head, cfg.model.n_relational_head) == (4, 4)


def test_esperberto_and_experiments_flags_come_from_their_configs():
    args = build_parser().parse_args(["esperberto", "--variant", "softmax1", "--out", "r", "--bf16", "--threads", "1"])
    (cfg,) = configs(args, MLMTrainConfig)
    assert (cfg.variant, cfg.bf16, cfg.threads, cfg.lr) == ("softmax1", True, 1, MLMTrainConfig.lr)
    args = build_parser().parse_args(["experiments", "--steps", "9", "--variants", "dot", "rope"])
    (exp,) = configs(args, ExperimentConfig)
    assert (exp.max_steps, exp.variants, exp.export) == (9, ["dot", "rope"], [])


@pytest.mark.parametrize(
    "argv",
    [
        ["gpt", "--out", "r", "--positions", "alibi"],  # not a choice
        ["gpt", "--out", "r", "--n-layers", "3"],  # not a flag
        ["gpt", "--n-layer", "3"],  # --out is required
        ["esperberto", "--out", "r"],  # --variant is required
        ["experiments", "--variants", "nope"],
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `python -m training ...` command in README.md, docs/ and the model cards, continuations joined."""
    import re
    import shlex

    from tests.conftest import REPO

    files = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("model_store/*/README.md")]
    found = []
    for f in files:
        text = f.read_text().replace("\\\n", " ")
        for m in re.finditer(r"python -m training ([a-z]+ [^`\n]*)", text):
            line = re.split(r"\s&(?:\s|$)|;", m.group(1))[0]
            if "PROMPT" in line or "..." in line or "--help" in line:
                continue  # a template, or help
            found.append((f"{f.relative_to(REPO)}: {line[:60]}", shlex.split(line.replace("$v", "softmax0"))))
    return found


@pytest.mark.parametrize("where, argv", documented_commands())
def test_documented_commands_parse(where, argv):
    build_parser().parse_args(argv)


@pytest.mark.parametrize("command", ["gpt", "esperberto", "experiments", "tokenizer", "eval", "complete", "pilots"])
def test_every_help_renders(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0 and f"python -m training {command}" in capsys.readouterr().out
