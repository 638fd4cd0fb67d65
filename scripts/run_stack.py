#!/usr/bin/env python
"""`make run`: the API server and the JWT proxy in front of it, with a token to try them.

    .venv/bin/python scripts/run_stack.py [inference_api options, e.g. --mock or --model PATH]

Starts `python -m inference_api` on 127.0.0.1:8000 (internal) and
`python -m proxy` on 127.0.0.1:8080 (PROXY_HOST / PROXY_PORT to change),
waits until the model is loaded, then prints the URL and a ready-to-paste
curl line carrying a freshly issued token. JWT_SECRET comes from the
environment or .env; if there is none, one is generated and saved to .env so
that tokens stay valid across restarts. Ctrl-C stops both.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from dotenv import dotenv_values

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jwt_util import encode  # noqa: E402

API_PORT = int(os.environ.get("INFERENCE_PORT", "8000"))
PROXY_HOST = os.environ.get("PROXY_HOST", "127.0.0.1")
PROXY_PORT = int(os.environ.get("PROXY_PORT", "8080"))


def jwt_secret() -> str:
    secret = os.environ.get("JWT_SECRET") or dotenv_values(".env").get("JWT_SECRET")
    if secret:
        return secret
    secret = secrets.token_hex(32)
    with open(".env", "a") as env_file:
        env_file.write(f"JWT_SECRET={secret}\n")
    print("run: no JWT_SECRET was set; generated one and saved it to .env", flush=True)
    return secret


def wait_ready(url: str, process: subprocess.Popen, what: str, headers: dict[str, str] | None = None) -> None:
    while True:
        if process.poll() is not None:
            sys.exit(f"run: {what} exited with code {process.returncode}")
        try:
            if requests.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def main() -> None:
    secret = jwt_secret()
    env = dict(os.environ, JWT_SECRET=secret, PYTHONPATH=str(ROOT))
    api_args = [
        sys.executable,
        "-m",
        "inference_api",
        "--host",
        "127.0.0.1",
        "--port",
        str(API_PORT),
        *sys.argv[1:],
    ]
    api = subprocess.Popen(api_args, env=env)
    proxy_args = [sys.executable, "-m", "proxy", "--host", PROXY_HOST, "--port", str(PROXY_PORT)]
    proxy = subprocess.Popen([*proxy_args, "--upstream", f"http://127.0.0.1:{API_PORT}"], env=env)

    def stop(*_) -> None:
        for process in (proxy, api):
            if process.poll() is None:
                process.terminate()
        for process in (proxy, api):
            process.wait(30)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    token = encode(
        secret, {"team_id": "local", "token_id": f"make-run-{int(time.time())}"}, expires_in=24 * 3600
    )
    url = f"http://{PROXY_HOST}:{PROXY_PORT}"
    wait_ready(f"http://127.0.0.1:{API_PORT}/ready", api, "inference_api")
    # Through the proxy with the token: proves the whole path before printing it.
    wait_ready(f"{url}/ready", proxy, "the proxy", {"Authorization": f"Bearer {token}"})
    model = requests.get(f"http://127.0.0.1:{API_PORT}/ready", timeout=5).json()["model"]
    body = '{"text": "Once upon a time", "max_tokens": 64}'
    curl = (
        f"curl -N {url}/predictions/{model} -H {shlex.quote('Authorization: Bearer ' + token)} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    print(f"\nServing {model} at {url} (token valid for 24 hours). Try:\n\n{curl}\n", flush=True)
    pid, _ = os.wait()  # until either one exits; Ctrl-C and SIGTERM go through stop()
    what = "inference_api" if pid == api.pid else "the proxy"
    print(f"run: {what} exited; stopping", file=sys.stderr)
    stop()


if __name__ == "__main__":
    main()
