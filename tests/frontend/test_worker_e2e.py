"""The API server's gunicorn worker (inference_api/worker.py), through the real server: a SIGTERM
waits for the streams in flight even after a backend crash, requests still waiting when the grace
runs out get a 503, and what gunicorn answers itself is JSON."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from backend.mock import mock_text
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


def raw_exchange(server: RunningServer, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are and read the answer to the end (gunicorn closes after its errors)."""
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),  # request line over 4,094 bytes
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),  # a field over 8,190
        (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
        (b"NONSENSE\r\n\r\n", 400),  # no method, path and version
    ],
    ids=["line-too-long", "header-too-large", "too-many-headers", "malformed-line"],
)
def test_what_gunicorn_rejects_is_answered_in_json(
    fast_server: RunningServer, request_bytes: bytes, status: int
) -> None:
    got, headers, body = raw_exchange(fast_server, request_bytes)
    assert got == status
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert headers["x-request-id"]
    answer = json.loads(body)
    assert answer["status_code"] == status
    assert answer["message"]
    assert set(answer) == {"status_code", "message"}
