"""The proxy's image (the Dockerfile's `proxy` stage) carries no torch and everything the proxy imports
(issue 19, item 9). No Docker engine runs where the tests run: these read the stage, check
requirements-proxy.txt against the imports and the tested environment, and run the proxy from a copy
of exactly what the stage copies, with torch and the server's packages made unimportable."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml

from proxy.__main__ import parse_args as parse_proxy_args
from tests.conftest import ROOT
from tests.deploy.test_compose_and_image import compose, dockerfile, module_args
from tests.proxy.conftest import SECRET, EchoUpstream, bearer
from tests.server_fixture import free_port

PROXY_CODE = [
    *sorted((ROOT / "proxy").glob("*.py")),
    ROOT / "gunicorn_json_errors.py",
    ROOT / "scripts" / "jwt_util.py",
]
# What must never be in the proxy's image, nor imported by it.
HEAVY = {"torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "llguidance"}


def canonicalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def pins(name: str) -> dict[str, str]:
    """A requirements file's exact pins, by canonical distribution name."""
    found = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            distribution, version = line.split("==")
            found[canonicalize_name(distribution)] = version.strip()
    return found


def third_party_imports(paths: list[Path]) -> set[str]:
    modules = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    ours = ("proxy", "gunicorn_json_errors", "__future__")  # the stage copies the first two
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ours}


def test_the_proxy_stage_installs_only_its_requirements_and_copies_only_the_proxy():
    lines = dockerfile("proxy")
    assert not any("torch" in line or "requirements.txt" in line for line in lines)
    runs = [line for line in lines if line.startswith("RUN ")]
    assert runs and "pip install -r requirements-proxy.txt" in runs[0]
    copied = [line.split()[1:] for line in lines if line.startswith("COPY ")]
    assert copied == [
        ["requirements-proxy.txt", "."],
        ["proxy", "proxy"],
        ["gunicorn_json_errors.py", "."],
        ["scripts/jwt_util.py", "scripts/jwt_util.py"],
    ]
    cmd = yaml.safe_load(next(line for line in lines if line.startswith("CMD ")).removeprefix("CMD "))
    assert parse_proxy_args(module_args(cmd, "proxy")).host == "0.0.0.0"


def test_requirements_proxy_pins_every_package_the_proxy_imports_and_no_torch():
    pinned = pins("requirements-proxy.txt")
    assert not {canonicalize_name(name) for name in HEAVY} & set(pinned)
    by_module = importlib.metadata.packages_distributions()
    imported = third_party_imports(PROXY_CODE)
    assert imported & {"flask", "gevent", "gunicorn", "jwt", "requests"}  # the parse found them
    assert not imported & HEAVY
    for module in imported:
        distributions = {canonicalize_name(d) for d in by_module.get(module, [])}
        assert distributions & set(pinned), f"proxy/ imports {module}; requirements-proxy.txt lacks it"
    # The versions the tests ran with, and requirements.txt's where it pins the same package.
    for distribution, version in pinned.items():
        assert importlib.metadata.version(distribution) == version, distribution
        assert pins("requirements.txt").get(distribution, version) == version, distribution


def test_the_proxy_runs_from_what_its_stage_copies_without_torch(tmp_path):
    """The stage's files in a folder of their own (the image's /app), torch and the API server's code
    unimportable: `python -m proxy` (the stage's command) serves a real request, and the token tool
    mints the token (compose's `docker compose exec proxy python scripts/jwt_util.py token`)."""
    app = tmp_path / "app"
    shutil.copytree(ROOT / "proxy", app / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "gunicorn_json_errors.py", app / "gunicorn_json_errors.py")
    (app / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "jwt_util.py", app / "scripts" / "jwt_util.py")
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    blocked = sorted(HEAVY | {"backend", "inference_api"})
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # import fails: the image has none of them\n"
    )
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(blocker),
        "JWT_SECRET": SECRET,
        "PYTHONUNBUFFERED": "1",
    }

    torch = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, timeout=30)
    assert torch.returncode != 0, "the blocker does not block"
    minted = subprocess.run(
        [sys.executable, "scripts/jwt_util.py", "token", "--team", "image"],
        cwd=app,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert minted.returncode == 0, minted.stderr

    upstream = EchoUpstream()
    upstream.thread.start()
    port = free_port()
    command = [sys.executable, "-m", "proxy", "--port", str(port), "--upstream", upstream.url]
    with open(tmp_path / "proxy.log", "wb") as log:
        process = subprocess.Popen(command, cwd=app, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        answer = None
        for _ in range(100):
            try:
                answer = requests.get(
                    f"http://127.0.0.1:{port}/v1/models", headers=bearer(minted.stdout.strip()), timeout=2
                )
                break
            except requests.ConnectionError:
                assert process.poll() is None, (tmp_path / "proxy.log").read_text()[-3000:]
                time.sleep(0.1)
        assert answer is not None and answer.status_code == 200, (tmp_path / "proxy.log").read_text()[-3000:]
        assert answer.json()["headers"]["X-Team-Id"] == "image"
    finally:
        process.terminate()
        process.wait(20)
        upstream.server.shutdown()
    assert not re.search(r"ModuleNotFoundError|ImportError", (tmp_path / "proxy.log").read_text())


def test_the_compose_proxy_runs_the_proxy_image_with_a_probe_port():
    proxy = compose()["services"]["proxy"]
    config = parse_proxy_args(module_args(proxy["command"], "proxy"))
    assert config.health_port and config.health_port != config.port
    assert shlex.join(proxy["command"]).startswith("python -m proxy")
