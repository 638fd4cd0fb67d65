"""What the proxy passes on, and how it streams (SPEC §6)."""

import os
import signal
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from backend.mock import mock_text
from tests.proxy.conftest import bearer, running_proxy, token
from tests.server_fixture import ROOT, free_port, running_server


def test_the_team_comes_from_the_token_and_the_clients_claim_is_dropped(echo_upstream):
    with running_proxy(echo_upstream.url) as proxy:
        response = requests.post(
            f"{proxy.url}/echo?x=1",
            data=b"payload",
            headers={
                **bearer(token(team_id="team-b")),
                "X-Team-ID": "forged",
                "X-Request-ID": "req-42",
                "Connection": "keep-alive, X-Custom-Hop",
                "X-Custom-Hop": "for this connection only",
                "X-Custom": "kept",
            },
            timeout=10,
        )
    assert response.status_code == 200
    seen = {name.lower(): value for name, value in response.json()["headers"].items()}
    assert seen["x-team-id"] == "team-b"
    assert seen["x-request-id"] == "req-42"
    assert seen["x-custom"] == "kept"
    assert "x-custom-hop" not in seen  # named in Connection: hop-by-hop (RFC 9110 §7.6.1)
    assert "authorization" not in seen  # the token stays at the proxy
    assert response.json()["path"] == "/echo?x=1" and response.json()["body"] == "payload"
    assert response.headers["X-Request-ID"] == "req-42"
    assert "Keep-Alive" not in response.headers  # hop-by-hop, from the upstream


def test_a_token_sent_as_x_api_key_stays_at_the_proxy_too(echo_upstream):
    with running_proxy(echo_upstream.url) as proxy:
        response = requests.post(
            f"{proxy.url}/v1/messages", headers={"x-api-key": token(team_id="team-k")}, timeout=10
        )
        assert "team=team-k token=tok-1 POST /v1/messages" in proxy.log()
    assert response.status_code == 200
    seen = {name.lower(): value for name, value in response.json()["headers"].items()}
    assert seen["x-team-id"] == "team-k"
    assert "x-api-key" not in seen and "authorization" not in seen


def test_one_clients_upstream_cookies_never_reach_another(echo_upstream):
    with running_proxy(echo_upstream.url) as proxy:
        alice = requests.get(f"{proxy.url}/set-cookie", headers=bearer(token(team_id="a")), timeout=10)
        assert alice.cookies.get("session") == "alice"  # her own cookie reaches her
        bob = requests.get(f"{proxy.url}/echo", headers=bearer(token(team_id="b")), timeout=10)
    assert "cookie" not in {name.lower() for name in bob.json()["headers"]}


def test_headers_a_response_names_in_connection_stay_with_the_upstream():
    from proxy.forward import client_response_headers

    upstream = {
        "Connection": "close, X-Upstream-Hop",
        "X-Upstream-Hop": "1",
        "Keep-Alive": "5",
        "X-Kept": "2",
    }
    names = {name for name, _ in client_response_headers(upstream, "req-1")}
    assert names == {"X-Kept", "X-Request-ID"}


def test_a_public_path_goes_upstream_with_no_team(echo_upstream):
    # The page needs no token; the client's word for a team is still never passed on.
    with running_proxy(echo_upstream.url) as proxy:
        response = requests.get(f"{proxy.url}/", headers={"X-Team-ID": "forged"}, timeout=10)
        assert "team=- token=- GET /" in proxy.log()
    assert response.status_code == 200
    seen = {name.lower() for name in response.json()["headers"]}
    assert "x-team-id" not in seen and "x-request-id" in seen


def test_the_first_chunk_arrives_when_the_server_sends_it(mock_server):
    # 20 tokens per second: 2,000 tokens take 100 s to write, so a proxy that held the answer back
    # would send nothing within the client's read timeout of 30 s.
    with (
        running_proxy(mock_server.url) as proxy,
        requests.post(
            f"{proxy.url}/predictions/mock",
            json={"text": "hi", "max_tokens": 2000},
            headers=bearer(),
            stream=True,
            timeout=30,
        ) as response,
    ):
        assert response.headers["Transfer-Encoding"] == "chunked"
        chunks = response.iter_content(chunk_size=None)
        received = [next(chunks) for _ in range(10)]
        # Ten pieces while the server still writes the answer: each came as it was sent.
        assert mock_server.metric("inference_active_rows") == 1
    assert mock_text(tuple(b"hi"), 2000).startswith(b"".join(received).decode())


def test_upstream_down_is_a_502_and_too_slow_is_a_504(echo_upstream):
    with running_proxy(f"http://127.0.0.1:{free_port()}") as proxy:
        response = requests.get(f"{proxy.url}/v1/models", headers=bearer(), timeout=10)
        assert response.status_code == 502 and response.json()["status_code"] == 502
        assert int(response.headers["Retry-After"]) > 0  # a client may try again when one is up
    with running_proxy(echo_upstream.url, args=("--read-timeout", "1")) as proxy:
        response = requests.get(f"{proxy.url}/slow", headers=bearer(), timeout=10)
        assert response.status_code == 504 and "in time" in response.json()["message"]


def test_a_body_over_the_limit_is_a_413(echo_upstream):
    with running_proxy(echo_upstream.url, args=("--max-body-bytes", "1000")) as proxy:
        response = requests.post(f"{proxy.url}/echo", data=b"x" * 5000, headers=bearer(), timeout=10)
    assert response.status_code == 413 and response.json()["status_code"] == 413


def test_the_proxy_refuses_to_start_without_a_secret_and_warns_about_a_short_one(tmp_path, echo_upstream):
    env = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--port", str(free_port())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "JWT_SECRET is not set" in result.stderr
    with running_proxy(echo_upstream.url, secret="short") as proxy:
        assert "JWT_SECRET is 5 bytes" in proxy.log()


def test_a_proxy_stopped_while_its_worker_boots_stops_at_once(tmp_path):
    """SIGTERM to the master while its worker is still booting (gevent patching the standard library):
    the worker, which had the master's handlers, lost the signal, and the master waited out its 10 s
    graceful timeout before killing it (make run with a server refusing its options did so)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JWT_SECRET="s" * 32)
    command = [sys.executable, "-m", "proxy", "--port", str(free_port()), "--upstream", "http://127.0.0.1:9"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        master = psutil.Process(process.pid)
        deadline = time.monotonic() + 30
        while not master.children() and time.monotonic() < deadline:  # forked, not yet booted
            time.sleep(0.01)
        assert master.children(), "no worker was forked"
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        assert time.monotonic() - stopping < 5, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_requests_go_to_the_least_busy_upstream_and_survive_one_dying():
    slow = ("--mock", "--rows", "8", "--mock-tokens-per-second", "10")
    with (
        running_server(*slow) as first,
        running_server(*slow) as second,
        running_proxy(first.url, second.url, args=("--check-interval", "0.5")) as proxy,
    ):

        def stream(max_tokens: int) -> int:
            response = requests.post(
                f"{proxy.url}/predictions/mock",
                json={"text": "hi", "max_tokens": max_tokens},
                headers=bearer(),
                timeout=60,
            )
            assert response.status_code == 200, response.text
            return len(response.text.split())

        # Six 2-second streams at once: least-in-flight spreads them three and three.
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(stream, [20] * 6)) == [20] * 6
        generated = [server.metric("inference_generated_tokens_total") for server in (first, second)]
        assert generated == [60, 60], generated

        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait()
        # Straight after the kill, before any health check noticed: refused connections
        # are retried on the other upstream, so nothing that had not started is lost.
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(stream, [5] * 12)) == [5] * 12


def test_discovery_sends_requests_to_the_addresses_a_host_name_resolves_to(mock_server):
    port = urllib.parse.urlsplit(mock_server.url).port
    with running_proxy(f"http://localhost:{port}", args=("--discover",)) as proxy:
        response = requests.post(
            f"{proxy.url}/predictions/mock",
            json={"text": "hi", "max_tokens": 3},
            headers=bearer(),
            timeout=30,
        )
        assert response.status_code == 200 and len(response.text.split()) == 3
        assert f"http://127.0.0.1:{port}" in proxy.log()  # the replica was found by its address


def test_any_team_id_reaches_the_upstream_encoded_and_forges_no_log_line(echo_upstream):
    """A team id outside Latin-1, or with CR/LF, used to end in a 500 when set as a header."""
    teams = {"研究": "%E7%A0%94%E7%A9%B6", "a\r\nX-Evil: 1": "a%0D%0AX-Evil%3A%201", "team-a": "team-a"}
    with running_proxy(echo_upstream.url) as proxy:
        for team, encoded in teams.items():
            response = requests.get(f"{proxy.url}/echo", headers=bearer(token(team_id=team)), timeout=10)
            assert response.status_code == 200, response.text
            seen = {name.lower(): value for name, value in response.json()["headers"].items()}
            assert seen["x-team-id"] == encoded and "x-evil" not in seen
        log = proxy.log()
    assert "team=%E7%A0%94%E7%A9%B6 " in log
    assert not any(line.startswith("X-Evil") for line in log.splitlines())


def test_an_upstream_loading_its_model_answers_with_its_own_503_and_retry_after():
    """Not the proxy's 502: the upstream is there, and says when to come back (issue 15, item 9)."""
    import json
    import threading

    from werkzeug.serving import make_server
    from werkzeug.wrappers import Response

    def loading(environ, start_response):  # what inference_api answers while its model loads
        body = json.dumps({"status_code": 503, "message": "the model is still loading"})
        response = Response(body, status=503, content_type="application/json", headers={"Retry-After": "7"})
        return response(environ, start_response)

    server = make_server("127.0.0.1", free_port(), loading, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with running_proxy(f"http://127.0.0.1:{server.port}") as proxy:
            response = requests.get(f"{proxy.url}/v1/models", headers=bearer(), timeout=10)
    finally:
        server.shutdown()
    assert response.status_code == 503 and response.headers["Retry-After"] == "7"
    assert "still loading" in response.json()["message"]
