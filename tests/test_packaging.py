"""Packaging stays consistent: one pinned requirements list for pip, Cog and Docker; a lint-clean Dockerfile."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import yaml

from server.__main__ import parse_settings

REPO = Path(__file__).resolve().parent.parent


def requirement_lines() -> list[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def test_requirements_are_exact_pins_with_the_project_torch():
    reqs = requirement_lines()
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+(\[[a-z,]+\])?==[0-9][0-9A-Za-z.]*", r) for r in reqs), reqs
    assert "torch==2.13.0" in reqs and "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_installed_package_declares_requirements_txt():
    declared = {r for r in requires("tinyserve") if "extra ==" not in r}
    assert declared == set(requirement_lines())


def test_cog_yaml_builds_the_predictor_on_the_same_requirements():
    cog = yaml.safe_load((REPO / "cog.yaml").read_text())
    assert cog["run"] == "predict.py:Runner" and (REPO / "predict.py").exists()
    from predict import Runner
    from server.config import default

    assert Runner.run.__cog_concurrent_max__ == default("max_batch_size")  # predictions at once: the engine's batch
    assert cog["build"] == {"gpu": True, "python_version": "3.11", "python_requirements": "requirements.txt"}


def test_dockerfile_installs_the_requirements_and_copies_what_the_server_imports():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+-runtime-ubuntu22\.04$", text, re.M)  # GPU by default
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "-c constraints.txt -r requirements.txt" in text and "COPY requirements.txt constraints.txt ./" in text
    copied = set(re.findall(r"^COPY --chown=tinyserve:tinyserve (\S+)/ \1/$", text, re.M))
    assert copied == {"models", "model_store", "server"}
    # and those are all that `python -m server` imports of the project (no training/, scripts/)
    probe = (
        "import sys; from server.__main__ import parse_settings; from server.api.app import create_app; "
        "create_app(parse_settings([]));"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in {'training', 'scripts', 'bench'}}))"
    )
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]", imported.stdout + imported.stderr
    assert re.search(r"^USER 10001$", text, re.M) and "HEALTHCHECK" in text and "/health" in text
    assert "EXPOSE 8000" in text
    # the image runs the server's own entry point (its drain limit outlasts the stream grace), on port 8000
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert cmd[:3] == ["python", "-m", "server"]
    settings = parse_settings(cmd[3:])
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
