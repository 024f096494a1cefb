"""`python -m server`: flags and TINYSERVE_* variables come from the one Settings class."""

import subprocess
import sys

import pytest

from server.__main__ import parse_settings
from server.config import Settings
from tests.conftest import REPO


def test_flags_override_the_environment_and_defaults_come_from_settings(monkeypatch):
    monkeypatch.setenv("TINYSERVE_PORT", "7000")
    monkeypatch.setenv("TINYSERVE_MAX_QUEUE", "5")
    s = parse_settings(["--port", "9000", "--models", "a,b", "--truncate-prompt"])
    assert (s.port, s.max_queue, s.models, s.truncate_prompt) == (9000, 5, ["a", "b"], True)
    assert parse_settings([]).max_batch_size == Settings.model_fields["max_batch_size"].default


@pytest.mark.parametrize("argv", [["--bogus", "1"], ["--port", "0"], ["--port", "many"]])
def test_unknown_or_invalid_options_fail_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and argv[0] in err  # names the option


def test_help_lists_every_option_with_its_environment_variable():
    out = subprocess.run(
        [sys.executable, "-m", "server", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text and f"TINYSERVE_{name.upper()}" in text, name


def test_tinyserve_dispatches_to_each_modules_own_parser(capsys):
    from server.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train"])  # what to train is required
    assert exit_info.value.code == 2 and "gpt, esperberto, tokenizer" in capsys.readouterr().err
    for argv, prog in ((["train", "esperberto", "--help"], "python -m training esperberto"),
                       (["kurtosis", "--help"], "python -m training kurtosis"),
                       (["serve", "--help"], "python -m server")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0 and f"usage: {prog}" in capsys.readouterr().out, argv


def test_serve_ray_has_its_own_parser(capsys):
    pytest.importorskip("ray", reason="the [ray] extra is part of the test install (make test)")
    from server.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve-ray", "--help"])
    assert exit_info.value.code == 0 and "usage: tinyserve serve-ray" in capsys.readouterr().out


def test_serve_ray_without_ray_says_which_extra_in_one_line(capsys, monkeypatch):
    from server.cli import main

    monkeypatch.setitem(sys.modules, "server.ray_serve", None)  # as if `ray` were not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-ray"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "serve-ray needs Ray Serve, the [ray] extra" in err and "Traceback" not in err
