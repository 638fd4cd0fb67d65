"""docker-compose.yml, its overrides and the Dockerfile say what SPEC §6 and the deploy issue ask.

No Docker engine runs where the tests run, so these read the files: ports,
networks, secrets, and that every command they run is one the project's own
parsers accept, the same commands the end-to-end tests run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from inference_api.__main__ import parse_args as parse_api_args
from proxy.__main__ import parse_args as parse_proxy_args
from tests.conftest import ROOT


def compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def module_args(command: list[str], module: str) -> list[str]:
    assert command[:3] == ["python", "-m", module], command
    return command[3:]


def test_only_the_proxy_is_published_and_the_api_server_is_on_an_internal_network():
    services = compose()["services"]
    assert set(services) == {"inference", "proxy"}
    assert "ports" not in services["inference"]
    assert services["proxy"]["ports"] == ["8080:8080"]
    assert services["inference"]["networks"] == ["internal"]
    assert compose()["networks"]["internal"]["internal"] is True
    assert set(services["proxy"]["networks"]) == {"internal", "public"}


def test_the_proxy_forwards_to_the_api_server_by_its_service_name_and_port():
    services = compose()["services"]
    api = parse_api_args(module_args(services["inference"]["command"], "inference_api"))
    proxy = parse_proxy_args(module_args(services["proxy"]["command"], "proxy"))
    assert api.host == "0.0.0.0" and proxy.host == "0.0.0.0"
    assert proxy.upstreams == (f"http://inference:{api.port}",)
    assert proxy.port == 8080
    # The image's HEALTHCHECK asks /health on $PORT: each service sets its own (the proxy its probe port,
    # plain HTTP and answering under any load).
    assert services["inference"]["environment"]["PORT"] == str(api.port)
    assert services["proxy"]["environment"]["PORT"] == str(proxy.health_port) != "0"


def test_jwt_secret_comes_from_env_and_compose_refuses_to_start_without_it():
    secret = compose()["services"]["proxy"]["environment"]["JWT_SECRET"]
    match = re.fullmatch(r"\$\{JWT_SECRET:\?(.+)\}", secret)
    assert match, secret  # ${VAR:?message}: compose stops with the message when it is unset
    assert ".env" in match.group(1)


def test_the_mock_and_gpu_overrides():
    mock = compose("docker-compose.mock.yml")["services"]["inference"]
    assert parse_api_args(module_args(mock["command"], "inference_api")).backend.mock
    gpu = compose("docker-compose.gpu.yml")["services"]["inference"]
    assert gpu["build"]["args"]["DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def dockerfile(stage: str = "server") -> list[str]:
    """A stage's instructions (`FROM ... AS stage` and what follows it), continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    starts = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        if lines[start].endswith(f" AS {stage}"):
            return lines[start:end]
    raise AssertionError(f"the Dockerfile has no stage {stage}")


def test_the_api_server_is_the_default_image_and_the_proxy_a_stage_of_its_own():
    text = (ROOT / "Dockerfile").read_text()
    stages = [line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["proxy", "server"]  # `docker build .` builds the last one
    services = compose()["services"]
    assert services["proxy"]["build"]["target"] == "proxy"
    assert services["inference"]["build"]["target"] == "server"
    assert services["proxy"]["image"] != services["inference"]["image"]


@pytest.mark.parametrize("stage", ["server", "proxy"])
def test_the_image_runs_as_a_non_root_user_with_a_healthcheck(stage):
    lines = dockerfile(stage)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK ") and "/health" in line for line in lines)


def test_the_image_builds_for_cpu_by_default_and_cuda_by_argument():
    lines = dockerfile()
    assert "ARG DEVICE=cpu" in lines
    install = next(line for line in lines if "torch==2.13.0" in line)
    assert '"$DEVICE" = "cuda"' in install and "whl/cpu" in install


def test_the_image_default_command_is_the_compose_api_command():
    cmd = next(line for line in dockerfile() if line.startswith("CMD "))
    assert yaml.safe_load(cmd.removeprefix("CMD ")) == compose()["services"]["inference"]["command"]


def test_the_build_step_that_prepares_the_model_works_offline(tmp_path):
    prepare = next(line for line in dockerfile() if "backend.prepare" in line)
    command = shlex.split(prepare.removeprefix("RUN ").split("&&")[0])
    assert command == ["python", "-m", "backend.prepare"]
    env = dict(os.environ, INFERENCE_CACHE_DIR=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, *command[1:]], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert list((tmp_path / "converted").glob("SmolLM2-135M-Instruct-*/model.safetensors"))


def test_the_image_copies_everything_its_commands_import():
    copied = {line.split()[1] for line in dockerfile() if line.startswith("COPY ")}
    assert {"backend", "inference_api", "proxy", "gunicorn.conf.py", "requirements.txt"} <= copied
