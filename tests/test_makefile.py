"""The Makefile's install picks the torch build for the machine, and `make token` mints a team token."""

from __future__ import annotations

import os
import subprocess
import sys

import jwt

from tests.server_fixture import ROOT

SECRET = "a-test-secret-of-at-least-thirty-two-bytes"


def make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def install_commands(*args: str, path: str | None = None) -> str:
    """What `make install` would run on a fresh venv (dry run, with a stamp that does not exist)."""
    env = {"PATH": path} if path else None
    dry = make("-n", "install", "STAMP=/nonexistent/stamp", *args, env=env)
    assert dry.returncode == 0, dry.stderr
    return dry.stdout


def test_a_machine_without_an_nvidia_driver_gets_the_cpu_build(tmp_path):
    commands = install_commands(path=f"{tmp_path}:/usr/bin:/bin")  # no nvidia-smi on this PATH
    assert "torch==2.13.0+cpu" in commands and "download.pytorch.org/whl/cpu" in commands


def test_a_machine_whose_nvidia_driver_answers_gets_the_cuda_build(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    fake.chmod(0o755)
    commands = install_commands(path=f"{tmp_path}:/usr/bin:/bin")
    assert "pip install --quiet torch==2.13.0\n" in commands and "+cpu" not in commands
    assert "+cpu" in install_commands("TORCH_DEVICE=cpu", path=f"{tmp_path}:/usr/bin:/bin")


def test_make_token_signs_with_the_secret_the_proxy_reads():
    minted = make("token", "TEAM=research", "HOURS=2", env={"JWT_SECRET": SECRET})
    assert minted.returncode == 0, minted.stderr
    claims = jwt.decode(minted.stdout.strip(), SECRET, algorithms=["HS256"])
    assert claims["team_id"] == "research" and claims["token_id"].startswith("research-")
    assert claims["exp"] - claims["iat"] == 2 * 3600
    named = make("token", "TEAM=research", "TOKEN_ID=alice-laptop", env={"JWT_SECRET": SECRET})
    assert jwt.decode(named.stdout.strip(), SECRET, algorithms=["HS256"])["token_id"] == "alice-laptop"


def test_make_token_prints_the_token_alone_when_it_installs_first(tmp_path):
    """After a pull that changed requirements.txt, `make token` installs again before it mints: what the
    install prints (make's commands, pip's output) goes to standard error, so that TOKEN=$(make token
    TEAM=...) is the token. pip here is a stand-in that prints, and the stamp a fresh one."""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "pip: $*"; exit 0; fi\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    fresh = [f"PY={python}", f"STAMP={tmp_path / 'stamp'}"]
    minted = make("token", "TEAM=research", *fresh, env={"JWT_SECRET": SECRET})
    assert minted.returncode == 0, minted.stderr
    assert "pip: -m pip install --quiet -r requirements.txt" in minted.stderr  # it did install first
    assert minted.stdout.count("\n") == 1
    assert jwt.decode(minted.stdout.strip(), SECRET, algorithms=["HS256"])["team_id"] == "research"


def test_make_token_without_a_team_says_how_to_call_it():
    refused = make("token", env={"JWT_SECRET": SECRET})
    assert refused.returncode != 0 and "usage: make token TEAM=" in refused.stderr


def test_make_run_installs_the_serving_set_alone_and_make_test_adds_the_rest():
    fresh = ["STAMP=/nonexistent/stamp", "DEV_STAMP=/nonexistent/dev-stamp"]
    for target in ("run", "token"):
        serving = make("-n", target, "TEAM=t", *fresh)
        assert serving.returncode == 0, serving.stderr
        commands = serving.stdout + serving.stderr  # `make token`'s install writes to standard error
        assert "-r requirements.txt" in commands and "requirements-dev" not in commands
    for target in ("test", "lint", "bench"):
        testing = make("-n", target, *fresh)
        assert testing.returncode == 0, testing.stderr
        assert testing.stdout.index("-r requirements.txt") < testing.stdout.index("-r requirements-dev.txt")
    serving_set = (ROOT / "requirements.txt").read_text()
    for tool in ("pytest", "selenium", "lm-eval", "matplotlib", "ruff"):
        assert f"\n{tool}" not in serving_set  # the test stack stays out of a serving install


def test_make_gpu_folder_fetches_the_gpu_machines_wheels_at_this_projects_versions():
    dry = make("-n", "gpu-folder", "STAMP=/nonexistent/stamp")
    assert dry.returncode == 0, dry.stderr
    assert "--python-version 3.12" in dry.stdout and "-d .gpu/wheels" in dry.stdout
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().split() if "==" in line)
    for name in ("transformers", "tokenizers", "flask", "gunicorn", "llguidance"):
        assert f"{name}=={pins[name]}" in dry.stdout  # what the GPU machine runs is what is tested here
    assert "save_pretrained('.gpu/tokenizer')" in dry.stdout
