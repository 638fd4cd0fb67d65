#!/usr/bin/env python
"""`make run`: the API server and the JWT proxy in front of it, with a token to try them.

    .venv/bin/python scripts/run_stack.py [--port 8000] [--proxy-port 8080] [--proxy-host 127.0.0.1]
                                          [--proxy-health-port N]
                                          [inference_api options, e.g. --mock or --model PATH]
    make run ARGS="--mock --port 8500 --proxy-port 8580"
    make run PROXY_ARGS="--max-body-bytes 4000000"      # any other option of python -m proxy

Starts `python -m inference_api` on 127.0.0.1:PORT (internal) and
`python -m proxy` on PROXY_HOST:PROXY_PORT in front of it (the defaults
also come from INFERENCE_PORT, PROXY_HOST and PROXY_PORT), after checking
that both ports are free. It waits until the model is loaded, then prints
the URL and a ready-to-paste curl line carrying a freshly issued token.
JWT_SECRET comes from the environment or .env; if there is none, one is
generated and saved to .env so that tokens stay valid across restarts. If
either piece fails, the other is stopped too and the reason is printed last
(exit status 1); Ctrl-C stops both (status 0). Every other option goes to
inference_api (`python -m inference_api --help`), which checks them first:
one it refuses stops this before either piece starts (status 2).

The teams' settings (docs/proxy.md): where the working directory has a
`teams/` folder, the proxy reads `teams/limits.toml` (per-team limits) and
`teams/revoked.txt` (revoked token ids), each again whenever it changes,
created later included; PROXY_TEAM_LIMITS and PROXY_REVOKED_TOKENS name
other files. `--proxy-health-port` (or PROXY_HEALTH_PORT) opens the proxy's
port for /health and its per-team /metrics; PROXY_ARGS adds any other
option of `python -m proxy`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
from dotenv import dotenv_values

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from jwt_util import encode  # noqa: E402

from inference_api.__main__ import check_models  # noqa: E402
from inference_api.__main__ import parse_args as parse_api_options  # noqa: E402


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
    parser.add_argument(
        "--proxy-health-port",
        type=int,
        default=int(os.environ.get("PROXY_HEALTH_PORT", "0")),
        help="the proxy's port for /health and its per-team /metrics (default: none)",
    )
    return parser


TEAMS = Path("teams")  # in the working directory: where `make run` runs, the checkout


def team_files() -> dict[str, str]:
    """The proxy's team files: those the environment names, else the `teams/` folder's where there is
    one (each passed even before it exists: the proxy picks it up when it is created)."""
    folder = TEAMS.resolve() if TEAMS.is_dir() else None
    files = {
        "--team-limits": os.environ.get("PROXY_TEAM_LIMITS") or (folder and str(folder / "limits.toml")),
        "--revoked-tokens": os.environ.get("PROXY_REVOKED_TOKENS")
        or (folder and str(folder / "revoked.txt")),
    }
    return {option: path for option, path in files.items() if path}


def proxy_options(args: argparse.Namespace) -> list[str]:
    """`python -m proxy`'s options past its address and upstream: the team files, the health port, and
    PROXY_ARGS (shell words) last, so that they can override the others."""
    options = [word for option, path in team_files().items() for word in (option, path)]
    if args.proxy_health_port:
        options += ["--health-port", str(args.proxy_health_port)]
    return options + shlex.split(os.environ.get("PROXY_ARGS", ""))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, api_options = parser.parse_known_args(argv)
    if "--host" in api_options:
        parser.error(
            "the API listens on 127.0.0.1 behind the proxy; --proxy-host sets where the proxy listens"
        )
    # What inference_api would refuse (a --model that is not there, say) stops this before either piece
    # starts, with its message last, instead of after a proxy started for nothing.
    check_models(parse_api_options(api_options))
    return args, api_options


def check_free(host: str, port: int, what: str, option: str) -> None:
    """A port already taken is a clear error before anything starts."""
    with socket.socket() as probe:
        # As the servers bind: a port whose last connections linger in TIME_WAIT is free to them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise PieceFailed(
                f"port {port} on {host} for {what} is not free ({error.strerror}): is another "
                f"`make run` running? Pick another with {option}."
            ) from None


class Relay:
    """A piece's log, passed on to this script's standard error as it comes, keeping the reason it gave
    last for stopping (gunicorn's CRITICAL lines), so that a failure can end on it rather than on the
    lines shutting down prints after it."""

    MARK = "[CRITICAL] "
    # The API server's own "ready on URL; try:" and its curl line, which has no token and skips the
    # proxy: under `make run` the one to use is the proxy's, printed once both are ready.
    OWN_TRY = "; try:"
    OWN_CURL = "  curl -N "

    def __init__(self, process: subprocess.Popen):
        self.reason = ""
        self.thread = threading.Thread(target=self._relay, args=(process.stderr,), daemon=True)
        self.thread.start()

    def _relay(self, stream) -> None:
        for line in stream:
            if line.startswith(self.OWN_CURL):
                continue
            if "ready on http" in line and line.rstrip().endswith(self.OWN_TRY):
                line = line.rstrip()[: -len(self.OWN_TRY)] + " (inside; the proxy's URL follows)\n"
            sys.stderr.write(line)
            sys.stderr.flush()
            if self.MARK in line:
                self.reason = line.split(self.MARK, 1)[1].strip()

    def why(self) -> str:
        """': the reason' once the piece's output has ended, or '' if it gave none."""
        self.thread.join(5)
        return f": {self.reason}" if self.reason else ""


def wait_ready(
    url: str,
    process: subprocess.Popen,
    what: str,
    headers: dict[str, str] | None = None,
    relay: Relay | None = None,
) -> None:
    while True:
        if process.poll() is not None:
            why = relay.why() if relay else ""
            raise PieceFailed(f"{what} exited with code {process.returncode} before it was ready{why}")
        try:
            if requests.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def stop_all(processes: list[subprocess.Popen]) -> None:
    """Each piece's own shutdown first (SIGTERM to its gunicorn master), then whatever is left of its
    process group: a worker or backend that outlived its master (a master killed while it booted, a
    backend still loading when its worker exited) would otherwise hold this script's output open, and
    whoever reads it to the end, for ever."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        end_group(process.pid)


def end_group(group: int) -> None:
    """SIGKILL to what is left of a session this script started (its leader's pid names it)."""
    with contextlib.suppress(ProcessLookupError):  # nothing left: the usual case
        os.killpg(group, signal.SIGKILL)


def main() -> None:
    args, api_options = parse_args(sys.argv[1:])
    processes: list[subprocess.Popen] = []

    def interrupted(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also where a shell started it with SIGINT ignored
    try:
        check_free("127.0.0.1", args.port, "inference_api", "--port")
        check_free(args.proxy_host, args.proxy_port, "the proxy", "--proxy-port")
        if args.proxy_health_port:
            check_free(
                args.proxy_host, args.proxy_health_port, "the proxy's health port", "--proxy-health-port"
            )
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
    api_process = subprocess.Popen(
        [*api_command, *api_options], env=env, start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    processes.append(api_process)
    relay = Relay(api_process)
    proxy_command = [sys.executable, "-m", "proxy", "--host", args.proxy_host, "--port", str(args.proxy_port)]
    proxy_command += ["--upstream", api_url, *proxy_options(args)]
    processes.append(subprocess.Popen(proxy_command, env=env, start_new_session=True))
    api, proxy = processes
    token = encode(
        secret, {"team_id": "local", "token_id": f"make-run-{int(time.time())}"}, expires_in=24 * 3600
    )
    # Listening on every interface: the curl line goes to this machine, and teammates get its name.
    everywhere = args.proxy_host in ("0.0.0.0", "::", "")
    url = f"http://{'127.0.0.1' if everywhere else args.proxy_host}:{args.proxy_port}"
    wait_ready(f"{api_url}/ready", api, "inference_api", relay=relay)
    # Through the proxy with the token: proves the whole path before printing it.
    wait_ready(f"{url}/ready", proxy, "the proxy", {"Authorization": f"Bearer {token}"})
    model = requests.get(f"{api_url}/ready", timeout=5).json()["model"]
    body = '{"text": "Once upon a time", "max_tokens": 64}'
    curl = (
        f"curl -N {url}/predictions/{model} -H {shlex.quote('Authorization: Bearer ' + token)} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    print(f"\nServing {model} at {url} (token valid for 24 hours). Try:\n\n{curl}\n", flush=True)
    if everywhere:
        print(
            f"Other machines: http://{socket.getfqdn()}:{args.proxy_port} (TLS: docs/deploy.md)", flush=True
        )
    print(teams_note(args, api_url), flush=True)
    pid, status = os.wait()  # until either one exits; Ctrl-C and SIGTERM raise KeyboardInterrupt
    what = "inference_api" if pid == api.pid else "the proxy"
    raise PieceFailed(
        f"{what} exited on its own (status {os.waitstatus_to_exitcode(status)}); the other was stopped"
    )


def teams_note(args: argparse.Namespace, api_url: str) -> str:
    """Where the teams' settings and figures are, under the curl line."""
    files = team_files()
    if files:
        lines = [
            f"Team limits: {files.get('--team-limits', 'none')}; revoked token ids: "
            f"{files.get('--revoked-tokens', 'none')} (each read again when it changes)."
        ]
    else:
        lines = [
            "Teams: no teams/ folder here, so no limits and no revoked tokens (docs/proxy.md, 'Per team')."
        ]
    lines.append(f"Each team's tokens: {api_url}/metrics (this machine only).")
    if args.proxy_health_port:
        lines.append(f"Each team's requests and refusals: http://127.0.0.1:{args.proxy_health_port}/metrics.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
