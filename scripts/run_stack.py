#!/usr/bin/env python
"""`make run`: the API server and the JWT proxy in front of it, with a token to try them.

    .venv/bin/python scripts/run_stack.py [--port 8000] [--proxy-port 8080] [--proxy-host 127.0.0.1]
                                          [inference_api options, e.g. --mock or --model PATH]
    make run ARGS="--mock --port 8500 --proxy-port 8580"

Starts `python -m inference_api` on 127.0.0.1:PORT (internal) and
`python -m proxy` on PROXY_HOST:PROXY_PORT in front of it (the defaults
also come from INFERENCE_PORT, PROXY_HOST and PROXY_PORT), after checking
that both ports are free. It waits until the model is loaded, then prints
the URL and a ready-to-paste curl line carrying a freshly issued token.
JWT_SECRET comes from the environment or .env; if there is none, one is
generated and saved to .env so that tokens stay valid across restarts. If
either piece fails, the other is stopped too and the reason is printed last
(exit status 1); Ctrl-C stops both (status 0). Every other option goes to
inference_api (`python -m inference_api --help`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
from dotenv import dotenv_values

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jwt_util import encode  # noqa: E402


class PieceFailed(RuntimeError):
    """One of the two servers could not start or stopped on its own."""


def jwt_secret() -> str:
    secret = os.environ.get("JWT_SECRET") or dotenv_values(".env").get("JWT_SECRET")
    if secret:
        return secret
    secret = secrets.token_hex(32)
    with open(".env", "a") as env_file:
        env_file.write(f"JWT_SECRET={secret}\n")
    print("run: no JWT_SECRET was set; generated one and saved it to .env", flush=True)
    return secret


def build_parser() -> argparse.ArgumentParser:
    """`make run`'s own options (docs/configuration.md lists each); the rest go to inference_api."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Other options go to inference_api: see python -m inference_api --help.",
    )
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("INFERENCE_PORT", "8000")), help="the API's port"
    )
    parser.add_argument("--proxy-port", type=int, default=int(os.environ.get("PROXY_PORT", "8080")))
    parser.add_argument("--proxy-host", default=os.environ.get("PROXY_HOST", "127.0.0.1"))
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, api_options = parser.parse_known_args(argv)
    if "--host" in api_options:
        parser.error(
            "the API listens on 127.0.0.1 behind the proxy; --proxy-host sets where the proxy listens"
        )
    return args, api_options


def check_free(host: str, port: int, what: str) -> None:
    """A port already taken is a clear error before anything starts."""
    with socket.socket() as probe:
        # As the servers bind: a port whose last connections linger in TIME_WAIT is free to them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise PieceFailed(
                f"port {port} on {host} for {what} is not free ({error.strerror}): is another "
                f"`make run` running? Pick another with --{'proxy-' if what == 'the proxy' else ''}port."
            ) from None


def wait_ready(url: str, process: subprocess.Popen, what: str, headers: dict[str, str] | None = None) -> None:
    while True:
        if process.poll() is not None:
            raise PieceFailed(f"{what} exited with code {process.returncode} before it was ready")
        try:
            if requests.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    args, api_options = parse_args(sys.argv[1:])
    processes: list[subprocess.Popen] = []

    def interrupted(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also where a shell started it with SIGINT ignored
    try:
        check_free("127.0.0.1", args.port, "inference_api")
        check_free(args.proxy_host, args.proxy_port, "the proxy")
        serve(args, api_options, processes)
    except PieceFailed as failure:
        stop_all(processes)
        sys.exit(f"run: {failure}")  # the reason, last
    except KeyboardInterrupt:
        stop_all(processes)
        print("run: stopped", file=sys.stderr)


def serve(args: argparse.Namespace, api_options: list[str], processes: list[subprocess.Popen]) -> None:
    secret = jwt_secret()
    env = dict(os.environ, JWT_SECRET=secret, PYTHONPATH=str(ROOT))
    api_url = f"http://127.0.0.1:{args.port}"
    # Each in a session of its own: Ctrl-C reaches this script alone, which stops them in order,
    # instead of every process at once (and a traceback from each).
    api_command = [sys.executable, "-m", "inference_api", "--host", "127.0.0.1", "--port", str(args.port)]
    processes.append(subprocess.Popen([*api_command, *api_options], env=env, start_new_session=True))
    proxy_command = [sys.executable, "-m", "proxy", "--host", args.proxy_host, "--port", str(args.proxy_port)]
    processes.append(
        subprocess.Popen([*proxy_command, "--upstream", api_url], env=env, start_new_session=True)
    )
    api, proxy = processes
    token = encode(
        secret, {"team_id": "local", "token_id": f"make-run-{int(time.time())}"}, expires_in=24 * 3600
    )
    url = f"http://{args.proxy_host}:{args.proxy_port}"
    wait_ready(f"{api_url}/ready", api, "inference_api")
    # Through the proxy with the token: proves the whole path before printing it.
    wait_ready(f"{url}/ready", proxy, "the proxy", {"Authorization": f"Bearer {token}"})
    model = requests.get(f"{api_url}/ready", timeout=5).json()["model"]
    body = '{"text": "Once upon a time", "max_tokens": 64}'
    curl = (
        f"curl -N {url}/predictions/{model} -H {shlex.quote('Authorization: Bearer ' + token)} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    print(f"\nServing {model} at {url} (token valid for 24 hours). Try:\n\n{curl}\n", flush=True)
    pid, status = os.wait()  # until either one exits; Ctrl-C and SIGTERM raise KeyboardInterrupt
    what = "inference_api" if pid == api.pid else "the proxy"
    raise PieceFailed(
        f"{what} exited on its own (status {os.waitstatus_to_exitcode(status)}); the other was stopped"
    )


if __name__ == "__main__":
    main()
