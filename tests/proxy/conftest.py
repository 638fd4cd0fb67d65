"""A real proxy process (`python -m proxy` under gunicorn), and a bare upstream showing what it gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jwt
import pytest
import requests
from urllib3.exceptions import InsecureRequestWarning
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from tests.server_fixture import ROOT, RunningServer, free_port, running_server, stop_server

SECRET = "test-secret-" + "x" * 60  # long enough for HS512 too (the wrong-algorithm case)


def token(secret: str = SECRET, algorithm: str = "HS256", **claims) -> str:
    claims = {"team_id": "team-a", "token_id": "tok-1", **claims}
    return jwt.encode(claims, secret, algorithm=algorithm)


def bearer(value: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {value or token()}"}


# The same handle as the inference server's: url, process, log, wait_ready.
RunningProxy = RunningServer


@contextmanager
def running_proxy(
    *upstreams: str,
    args: tuple[str, ...] = (),
    secret: str | None = SECRET,
    tls_cert: Path | None = None,
    trust_tls_cert: bool = True,
) -> Iterator[RunningProxy]:
    """`tls_cert`: the certificate the proxy serves (with --certfile/--keyfile in `args`): the URL is
    https and it is waited on with that certificate as the trusted one (`trust_tls_cert` False: with
    no check of it, for one no client would accept)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("JWT_SECRET", None)
    if secret is not None:
        env["JWT_SECRET"] = secret
    command = [sys.executable, "-m", "proxy", "--port", str(port), *args]
    for upstream in upstreams:
        command += ["--upstream", upstream]
    with tempfile.TemporaryDirectory(prefix="proxy-") as tmp:
        log_path = Path(tmp) / "proxy.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        proxy = RunningProxy(f"{'https' if tls_cert else 'http'}://127.0.0.1:{port}", process, log_path)
        try:
            if tls_cert:
                wait_for_tls(proxy, tls_cert if trust_tls_cert else False, 30)
            else:
                proxy.wait_ready(30, path="/health")
            yield proxy
        finally:
            stop_server(proxy)  # the same SIGTERM-then-clean-up as the inference server


def start_refused(*args: str, cwd: Path) -> str:
    """`python -m proxy ARGS` with a good secret, which must refuse to start (exit 2): what it said."""
    result = subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        env={"JWT_SECRET": SECRET, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    return result.stderr


def wait_for_tls(proxy: RunningProxy, cert: Path | bool, timeout: float) -> None:
    """`cert`: the one to trust, or False to check none."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.process.poll() is not None:
            raise RuntimeError(
                f"the proxy exited with code {proxy.process.returncode}:\n{proxy.log()[-4000:]}"
            )
        try:
            with warnings.catch_warnings():  # unverified on purpose, where asked
                warnings.simplefilter("ignore", InsecureRequestWarning)
                answer = requests.get(f"{proxy.url}/health", verify=str(cert) if cert else False, timeout=2)
            if answer.status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the proxy did not answer over TLS in {timeout} s:\n{proxy.log()[-4000:]}")


class EchoUpstream:
    """An upstream that answers with the headers it got (and /slow, after a long pause)."""

    def __init__(self):
        self.server = make_server("127.0.0.1", free_port(), self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @Request.application
    def app(self, request: Request) -> Response:
        if request.path == "/slow":
            time.sleep(3)
        if request.path == "/set-cookie":  # a cookie meant for one client only
            return Response("{}", content_type="application/json", headers={"Set-Cookie": "session=alice"})
        body = {
            "headers": dict(request.headers),
            "path": request.full_path,
            "body": request.get_data(as_text=True),
        }
        return Response(
            json.dumps(body), content_type="application/json", headers={"Keep-Alive": "timeout=5"}
        )


@pytest.fixture(scope="module")
def echo_upstream():
    upstream = EchoUpstream()
    upstream.thread.start()
    yield upstream
    upstream.server.shutdown()


@pytest.fixture(scope="module")
def mock_server():
    with running_server("--mock", "--rows", "4", "--mock-tokens-per-second", "20") as server:
        yield server


@pytest.fixture(scope="module")
def proxy(mock_server):
    with running_proxy(mock_server.url) as running:
        yield running
