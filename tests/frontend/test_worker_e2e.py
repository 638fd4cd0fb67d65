"""The API server's gunicorn worker (inference_api/worker.py), through the real server: a SIGTERM
waits for the streams in flight even after a backend crash, requests still waiting when the grace
runs out get a 503, and what gunicorn answers itself is JSON."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from backend.mock import mock_text
from tests.gunicorn_rejects import REJECTED, raw_exchange
from tests.server_fixture import RunningServer, running_server


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_sigterm_waits_for_a_stream_after_the_backend_has_crashed() -> None:
    # A stream cut by the crash was counted closed twice by gunicorn's gthread worker: the count ran
    # one short, and a SIGTERM with one stream in flight thought there was none and cut it.
    options = "--mock --rows 2 --mock-tokens-per-second 20 --restart-delay 0.2"
    with running_server(*options.split()) as server:
        url = f"{server.url}/predictions/mock"
        doomed = requests.post(url, json={"text": "doomed", "max_tokens": 2000}, stream=True, timeout=30)
        doomed_chunks = doomed.iter_content(chunk_size=None)
        assert next(doomed_chunks)
        os.kill(server.backend_pid(), signal.SIGKILL)
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for _ in doomed_chunks:
                pass
        server.wait_ready(30)

        max_tokens = 40  # 2 s at 20 tokens per second, well within the 10 s grace
        stream = requests.post(
            url, json={"text": "drain me", "max_tokens": max_tokens}, stream=True, timeout=30
        )
        chunks = stream.iter_content(chunk_size=None)
        received = [next(chunks)]
        server.process.send_signal(signal.SIGTERM)
        received.extend(chunks)  # a cut stream raises ChunkedEncodingError here
        assert b"".join(received).decode() == mock_text(tuple(b"drain me"), max_tokens)
        assert server.process.wait(15) == 0


def test_requests_still_waiting_when_the_grace_ends_get_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    grace = 3.0
    monkeypatch.setenv("GUNICORN_CMD_ARGS", f"--graceful-timeout {grace:g}")
    with running_server("--mock", "--rows", "1", "--mock-tokens-per-second", "20") as server:
        answers: dict[str, requests.Response | requests.RequestException] = {}

        def ask(name: str, path: str, body: dict) -> None:
            try:
                answers[name] = requests.post(f"{server.url}{path}", json=body, timeout=30)
            except requests.RequestException as error:  # a connection closed with no reply
                answers[name] = error

        # 2,000 tokens take 100 s: the native request holds the only row, the OpenAI one waits for it.
        native = {"text": "long", "max_tokens": 2000, "stream": False}
        openai = {"model": "mock", "prompt": "long", "max_tokens": 2000}
        threads = [
            threading.Thread(target=ask, args=("native", "/predictions/mock", native)),
            threading.Thread(target=ask, args=("openai", "/v1/completions", openai)),
        ]
        threads[0].start()
        wait_for(lambda: server.metric("inference_active_rows") == 1)
        threads[1].start()
        wait_for(lambda: server.metric("inference_queue_depth") == 1)

        signalled_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        answered_after = time.monotonic() - signalled_at

        for name, response in answers.items():
            assert isinstance(response, requests.Response), f"{name}: {response!r}"
            assert response.status_code == 503, name
            assert int(response.headers["Retry-After"]) >= 1, name
        assert answers["native"].json()["status_code"] == 503
        assert "shutting down" in answers["native"].json()["message"]
        assert "shutting down" in answers["openai"].json()["error"]["message"]
        # Within the grace, and not before its last second: requests may still finish until then.
        assert grace - 1.5 < answered_after < grace
        assert server.process.wait(15) == 0


@REJECTED
def test_what_gunicorn_rejects_is_answered_in_json(
    fast_server: RunningServer, request_bytes: bytes, status: int
) -> None:
    got, headers, body = raw_exchange(fast_server.url, request_bytes)
    assert got == status
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert headers["x-request-id"]
    answer = json.loads(body)
    assert answer["status_code"] == status
    assert answer["message"]
    assert set(answer) == {"status_code", "message"}


def test_an_idle_connection_stays_open_past_a_client_pools_own_keep_alive_time() -> None:
    """httpx's pools (the openai and anthropic clients') drop a connection idle for 5 s; the server must
    not close it before them (gunicorn's 2 s did), or a request sent on it in the instant it closes fails
    with no answer. Idle 3.5 s, the same connection still takes a request."""
    with running_server("--mock") as server:
        address = urlparse(server.url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.request("GET", "/health")
        first = connection.getresponse()
        first.read()
        assert first.status == 200
        kept = connection.sock
        time.sleep(3.5)
        connection.request("GET", "/health")
        answer = connection.getresponse()  # http.client.RemoteDisconnected if the server closed it
        answer.read()
        assert answer.status == 200 and connection.sock is kept
        connection.close()
