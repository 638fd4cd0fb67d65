"""`make run`'s script starts the server and the proxy and prints a curl line that works as printed."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import requests

from scripts.jwt_util import encode
from scripts.run_stack import stop_all
from tests.server_fixture import ROOT, free_port


def test_the_printed_curl_line_streams_through_the_proxy(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("JWT_SECRET", None)
    # Ports as options, as `make run ARGS="--mock --port ..."` passes them: both pieces must follow.
    ports = ["--port", str(free_port()), "--proxy-port", str(free_port())]
    # The API's own options go through, served names too: the curl line names the first.
    names = ["--served-model-name", "SmolLM2-135M-Instruct", "smol"]
    log = open(tmp_path / "run.log", "w")  # noqa: SIM115 (the run writes it until the end)
    run = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "run_stack.py"), "--mock", *names, *ports],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:
        curl_line = None
        for line in run.stdout:
            if line.startswith("curl -N "):
                curl_line = line.strip()
                break
        assert curl_line is not None, "no curl line printed"
        assert "/predictions/SmolLM2-135M-Instruct " in curl_line
        assert "JWT_SECRET=" in (tmp_path / ".env").read_text()  # generated and kept
        result = subprocess.run(
            ["bash", "-c", curl_line + " -sS -w '\\n%{http_code}'"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        text, status = result.stdout.rsplit("\n", 1)
        assert status == "200", result.stdout + result.stderr
        assert len(text.split()) == 64  # the mock writes one word per token
        logged = (tmp_path / "run.log").read_text()
        assert "ready on http" in logged and "curl -N" not in logged  # the proxy's curl line alone
    finally:
        children = psutil.Process(run.pid).children(recursive=True)
        os.kill(run.pid, signal.SIGTERM)
        run.wait(60)
    log.close()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == [], f"left running: {alive}"


def run_to_the_end(tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JWT_SECRET="s" * 32)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_stack.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    left = started_in(tmp_path)
    assert left == [], f"left running after the run ended: {[p.cmdline() for p in left]}"
    return result


def started_in(folder) -> list[psutil.Process]:
    """Processes still running in `folder`, as every process the run starts does (none other does)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.cwd() == str(folder) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_stopping_a_piece_ends_what_outlived_its_leader(tmp_path):
    """A worker left behind by its master (killed while it booted, say) would hold `make run`'s output
    open, and a reader waiting for its end would wait for ever."""
    piece = subprocess.Popen(
        ["bash", "-c", "sleep 300 & echo $! > straggler; exec sleep 300"],
        cwd=tmp_path,
        start_new_session=True,
    )
    while not (tmp_path / "straggler").exists() or not (tmp_path / "straggler").read_text().strip():
        time.sleep(0.05)
    straggler = psutil.Process(int((tmp_path / "straggler").read_text()))
    stop_all([piece])
    assert piece.returncode is not None
    straggler.wait(10)  # raises psutil.TimeoutExpired if it was left running


def test_a_port_in_use_is_a_clear_error_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_to_the_end(
            tmp_path, "--mock", "--port", str(free_port()), "--proxy-port", str(port), timeout=30
        )
    assert result.returncode == 1
    assert f"port {port}" in result.stderr.strip().splitlines()[-1] and "not free" in result.stderr
    assert "Serving" not in result.stdout


def test_a_server_that_cannot_start_stops_the_proxy_and_says_why_last(tmp_path):
    """Its backend failing: a model directory of a type no transformers class is for."""
    (tmp_path / "unknown-type").mkdir()
    (tmp_path / "unknown-type" / "config.json").write_text('{"model_type": "no-such-type"}')
    proxy_port = free_port()
    result = run_to_the_end(
        tmp_path,
        "--model",
        str(tmp_path / "unknown-type"),
        "--port",
        str(free_port()),
        "--proxy-port",
        str(proxy_port),
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("run: inference_api exited with code")
    assert "the backend cannot start (" in last and "no-such-type" in last, last
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", proxy_port))  # the proxy was stopped: its port is free again


def test_an_option_the_server_refuses_stops_the_run_before_anything_starts(tmp_path):
    proxy_port = free_port()
    missing = tmp_path / "no-such-model"
    result = run_to_the_end(tmp_path, "--model", str(missing), "--proxy-port", str(proxy_port), timeout=30)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last == f"python -m inference_api: error: argument --model: model directory {missing} does not exist"
    )
    assert "Starting gunicorn" not in result.stderr + result.stdout


def test_a_teams_folder_sets_limits_and_revocations_and_proxy_args_reach_the_proxy(tmp_path):
    """An admin's first day with `make run` alone: per-team limits and revoked ids from `teams/`, the
    proxy's per-team metrics on its health port, any other proxy option through PROXY_ARGS, and a
    proxy facing other machines whose banner still prints a curl line that works here."""
    teams = tmp_path / "teams"
    teams.mkdir()
    (teams / "limits.toml").write_text("[default]\nrequests_per_minute = 5\n")
    (teams / "revoked.txt").write_text("lost-laptop   # reported 2026-11-26\n")
    secret = "s" * 32
    env = dict(os.environ, PYTHONUNBUFFERED="1", JWT_SECRET=secret, PROXY_ARGS="--max-body-bytes 2000")
    proxy_port, health_port = free_port(), free_port()
    ports = [
        "--port",
        str(free_port()),
        "--proxy-port",
        str(proxy_port),
        "--proxy-health-port",
        str(health_port),
        "--proxy-host",
        "0.0.0.0",  # a team's server: the curl line still works here, and teammates get a name
    ]
    run = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "run_stack.py"), "--mock", *ports],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        printed = []
        for line in run.stdout:
            printed.append(line)
            if line.startswith("Each team's requests and refusals"):
                break
        banner = "".join(printed)
        assert f"Team limits: {teams / 'limits.toml'}; revoked token ids: {teams / 'revoked.txt'}" in banner
        assert f"curl -N http://127.0.0.1:{proxy_port}/" in banner and "Other machines: http://" in banner
        url = f"http://127.0.0.1:{proxy_port}"
        model = requests.get(f"{url}/v1/models", headers=bearer(secret, "admin", "a-1"), timeout=10)
        name = model.json()["data"][0]["id"]

        def predict(headers: dict, text: str = "hi") -> requests.Response:
            body = {"text": text, "max_tokens": 1}
            return requests.post(f"{url}/predictions/{name}", json=body, headers=headers, timeout=30)

        statuses = [predict(bearer(secret, "ops", "ops-1")).status_code for _ in range(7)]
        assert statuses == [200] * 5 + [429] * 2  # the folder's limit, 5 a minute
        revoked = predict(bearer(secret, "research", "lost-laptop"))
        assert revoked.status_code == 401 and "revoked" in revoked.text
        assert predict(bearer(secret, "research", "desk"), text="x" * 3000).status_code == 413  # PROXY_ARGS
        metrics = requests.get(f"http://127.0.0.1:{health_port}/metrics", timeout=10).text
        assert 'proxy_team_requests_total{status="2xx",team="ops"} 5.0' in metrics
        assert 'proxy_team_rejected_total{reason="rate",team="ops"} 2.0' in metrics
    finally:
        children = psutil.Process(run.pid).children(recursive=True)
        os.kill(run.pid, signal.SIGTERM)
        run.wait(60)
    psutil.wait_procs(children, timeout=30)


def bearer(secret: str, team: str, token_id: str) -> dict[str, str]:
    token = encode(secret, {"team_id": team, "token_id": token_id}, expires_in=600)
    return {"Authorization": f"Bearer {token}"}
