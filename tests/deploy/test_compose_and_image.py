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
from transformers import AutoModelForCausalLM

from backend.model.gguf_conversion import omitted_weights
from inference_api.__main__ import parse_args as parse_api_args
from proxy.__main__ import parse_args as parse_proxy_args
from tests.conftest import ROOT
from tests.deploy.test_kubernetes import assert_downloads_once, run_download

# Compose's interpolation: $$, ${VAR}, $VAR, and ${VAR:-default}, ${VAR-default}, ${VAR:+alternative},
# ${VAR+alternative}, ${VAR:?error}, ${VAR?error} (none nested: the files use none).
VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-+?])([^}]*))?\}|(\w+))")


def interpolate(value, env: dict[str, str]):
    """A compose file's value as compose reads it, with the environment `env`."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(1):
            return "$"
        name = match.group(2) or match.group(5)
        operator, argument, found = match.group(3), match.group(4), env.get(name)
        present = bool(found) if operator and operator.startswith(":") else found is not None
        if operator in (":-", "-"):
            return found if present else argument
        if operator in (":+", "+"):
            return argument if present else ""
        if operator in (":?", "?") and not present:
            raise ValueError(argument)
        return found or ""

    return VARIABLE.sub(one, value)


def compose(name: str = "docker-compose.yml", env: dict[str, str] | None = None) -> dict:
    """A compose file as compose reads it, with `env` (JWT_SECRET alone by default) for the environment;
    a command given as a string split into arguments as compose splits it (no shell)."""
    env = {"JWT_SECRET": "s"} if env is None else env
    loaded = interpolate(yaml.safe_load((ROOT / name).read_text()), env)
    for service in loaded.get("services", {}).values():
        if isinstance(service.get("command"), str):
            service["command"] = shlex.split(service["command"])
    return loaded


def raw_compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def module_args(command: list[str], module: str) -> list[str]:
    assert command[:3] == ["python", "-m", module], command
    return command[3:]


def test_only_the_proxy_is_published_and_the_api_server_is_on_an_internal_network():
    services = compose()["services"]
    assert set(services) == {"inference", "proxy", "model-download"}
    assert "ports" not in services["inference"] and "ports" not in services["model-download"]
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
    secret = raw_compose()["services"]["proxy"]["environment"]["JWT_SECRET"]
    match = re.fullmatch(r"\$\{JWT_SECRET:\?(.+)\}", secret)
    assert match, secret  # ${VAR:?message}: compose stops with the message when it is unset
    assert ".env" in match.group(1)


def test_the_mock_and_gpu_overrides():
    mock = compose("docker-compose.mock.yml")["services"]["inference"]
    assert parse_api_args(module_args(mock["command"], "inference_api")).backend.mock
    gpu = compose("docker-compose.gpu.yml")["services"]["inference"]
    assert gpu["build"]["args"]["DEVICE"] == "cuda"
    # model-download shares the API server's image (and its build): nothing more to build or pull.
    for name in ("docker-compose.yml", "docker-compose.gpu.yml"):
        services = compose(name)["services"]
        assert services["model-download"]["image"] == services["inference"]["image"]
        assert services["model-download"]["build"] == services["inference"]["build"]
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
    """The build step's shell, as the CPU image runs it, then as the CUDA one does: a converted copy
    without the layers the default model's blocks serve on a CPU, then the whole copy a GPU reads, which
    transformers loads with every weight read."""
    run = next(line for line in dockerfile() if "backend.prepare" in line).removeprefix("RUN ")
    steps = [step.strip() for step in run.split("&&")]
    assert steps[1] == "python -m backend.prepare $whole"
    prepare = " && ".join(steps[:2]).replace("python -m", f"{shlex.quote(sys.executable)} -m")
    env = dict(os.environ, INFERENCE_CACHE_DIR=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    for device in ("cpu", "cuda"):
        result = subprocess.run(
            ["sh", "-c", prepare],
            env=dict(env, DEVICE=device),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        (converted,) = (tmp_path / "converted").glob("SmolLM2-135M-Instruct-*")
        # On a CPU, its 30 layers' 7 projections each (Q4_1), the blocks'; on a GPU, none
        left_out = omitted_weights(converted)
        assert len(left_out) == (30 * 7 if device == "cpu" else 0), device
        assert all(name.endswith("_proj.weight") for name in left_out)
    _, info = AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_image_copies_everything_its_commands_import():
    copied = {line.split()[1] for line in dockerfile() if line.startswith("COPY ")}
    assert {"backend", "inference_api", "proxy", "gunicorn.conf.py", "requirements.txt"} <= copied


# MODEL=... docker compose up: that model, downloaded once into a volume, served with the hub off.

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"


def test_without_model_the_api_server_runs_the_image_default_as_before():
    inference = compose(env={"JWT_SECRET": "s"})["services"]["inference"]
    assert "--model" not in inference["command"]
    assert parse_api_args(module_args(inference["command"], "inference_api")).backend.model is None
    for empty in ({"MODEL": ""}, {"MODEL": "", "HF_TOKEN": ""}):
        assert compose(env={"JWT_SECRET": "s", **empty})["services"]["inference"] == inference


def test_with_model_the_api_server_serves_it_from_the_volume_with_the_hub_off():
    services = compose(env={"JWT_SECRET": "s", "MODEL": MODEL})["services"]
    inference = services["inference"]
    api = parse_api_args(module_args(inference["command"], "inference_api"))
    (volume,) = inference["volumes"]
    name, folder, mode = volume.split(":")
    assert api.backend.model == f"{folder}/{MODEL}" and mode == "ro"
    assert api.served_model_names == (MODEL,)  # called by its hub id, as with --model HUB_ID
    assert inference["environment"]["HF_HUB_OFFLINE"] == "1"
    assert inference["networks"] == ["internal"]  # still no way out
    assert inference["depends_on"] == {"model-download": {"condition": "service_completed_successfully"}}
    download = services["model-download"]
    assert download["environment"]["MODEL"] == MODEL
    assert download["volumes"] == [f"{name}:{folder}"]
    assert download["networks"] == ["public"]  # the one with a way out, to the hub
    assert download["restart"] == "no" and download["healthcheck"] == {"disable": True}
    assert name in compose()["volumes"]


def test_hf_token_reaches_only_the_download():
    services = compose(env={"JWT_SECRET": "s", "MODEL": MODEL, "HF_TOKEN": "hf_x"})["services"]
    assert services["model-download"]["environment"]["HF_TOKEN"] == "hf_x"
    assert "HF_TOKEN" not in services["inference"]["environment"]


def test_the_model_download_runs_once_and_does_nothing_without_model(tmp_path):
    command = compose(env={"JWT_SECRET": "s", "MODEL": MODEL})["services"]["model-download"]["command"]
    assert command[:2] == ["sh", "-c"]
    assert_downloads_once(command[2], tmp_path)
    assert run_download(command[2], tmp_path / "none", "") == (0, [])


def test_the_image_has_a_models_folder_its_user_owns():
    run = next(line for line in dockerfile() if "useradd" in line)
    assert "mkdir /models" in run and re.search(r"chown -R app [^&]*/models\b", run)
