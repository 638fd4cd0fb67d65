"""A client that hangs up is not a server error: through the real gunicorn server, on a slow mock (one
row, a token a second), with gunicorn's access log on.

Any user can close a connection, so a hang-up must not put an error and its traceback in the log:
it is one info line, and a 499 (nginx's "client closed request") in the access log and the
inference_requests metric. A real error in a request still logs as an error with its traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import requests

from tests.server_fixture import RunningServer, running_server

HUNG_UP_LINE = "client closed the connection"
ERROR_LINE = "Error handling request"
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hang up"}], "max_tokens": 2000}
NATIVE = {"text": "hang up", "max_tokens": 2000}


@pytest.fixture(scope="module")
def logged_server() -> Iterator[RunningServer]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GUNICORN_CMD_ARGS", "--access-logfile -")  # to the same log, as stdout
        # A token a second: a stream's client watch (every 0.5 s) sees a hang-up before its next write
        # does, as it does whenever text is held back (a stop sequence's start, a tool call).
        options = "--mock --rows 1 --max-queue 1 --mock-tokens-per-second 1 --restart-delay 0.2"
        with running_server(*options.split()) as server:
            yield server


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def requests_counted(server: RunningServer, endpoint: str, status: int) -> float:
    """inference_requests_total of one endpoint and status (0 before the first)."""
    sample = f'inference_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(sample):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def send_request(server: RunningServer, path: str, body: dict) -> socket.socket:
    """A POST on a bare socket: the test decides when the client hangs up."""
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_some_of_the_body(sock: socket.socket) -> None:
    """The status, the headers and a first chunk of the streamed body."""
    data = b""
    while not data.partition(b"\r\n\r\n")[2]:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early after {data!r}"
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data


def log_of_one_request(server: RunningServer, since: int, path: str) -> str:
    """What the server logged from `since` (an offset in its log) until the access line of `path`."""
    access_line = f'"POST {path} HTTP/1.1" '
    wait_for(lambda: access_line in server.log()[since:], timeout=10)
    time.sleep(0.2)  # anything gunicorn logs after the access line (its error comes after)
    return server.log()[since:]


def assert_logged_as_a_hang_up(log: str, path: str) -> None:
    assert ERROR_LINE not in log, log
    assert "Traceback" not in log, log
    assert "ClientGone" not in log, log
    info = [line for line in log.splitlines() if "[INFO]" in line and HUNG_UP_LINE in line]
    assert len(info) == 1, log
    assert path in info[0], log
    assert f'"POST {path} HTTP/1.1" 499 ' in log, log


STREAMS = pytest.mark.parametrize(
    "path, endpoint, body",
    [
        ("/predictions/mock", "/predictions/<path:model>", NATIVE),
        ("/v1/chat/completions", "/v1/chat/completions", {**CHAT, "stream": True}),
    ],
    ids=["native", "chat"],
)


@STREAMS
def test_a_client_that_leaves_a_stream_is_an_info_line_and_a_499(
    logged_server: RunningServer, path: str, endpoint: str, body: dict
) -> None:
    wait_for(lambda: logged_server.metric("inference_active_rows") == 0)
    counted = requests_counted(logged_server, endpoint, 499)
    since = len(logged_server.log())
    sock = send_request(logged_server, path, body)
    read_some_of_the_body(sock)
    sock.close()
    # The chat stream's watch sees end-of-file; the native stream, which has none, fails its next
    # write or the one after; the row frees at the next step.
    wait_for(lambda: logged_server.metric("inference_active_rows") == 0, timeout=10)
    assert_logged_as_a_hang_up(log_of_one_request(logged_server, since, path), path)
    assert requests_counted(logged_server, endpoint, 499) == counted + 1


@pytest.mark.parametrize(
    "path, endpoint, body",
    [
        ("/predictions/mock", "/predictions/<path:model>", {**NATIVE, "stream": False}),
        ("/v1/chat/completions", "/v1/chat/completions", CHAT),
    ],
    ids=["native", "chat"],
)
def test_a_client_that_leaves_while_its_json_answer_is_made_is_an_info_line_and_a_499(
    logged_server: RunningServer, path: str, endpoint: str, body: dict
) -> None:
    wait_for(lambda: logged_server.metric("inference_active_rows") == 0)
    counted = requests_counted(logged_server, endpoint, 499)
    since = len(logged_server.log())
    sock = send_request(logged_server, path, body)
    wait_for(lambda: logged_server.metric("inference_active_rows") == 1)
    sock.close()
    wait_for(lambda: logged_server.metric("inference_active_rows") == 0, timeout=10)
    assert_logged_as_a_hang_up(log_of_one_request(logged_server, since, path), path)
    assert requests_counted(logged_server, endpoint, 499) == counted + 1


def test_a_stream_read_to_its_end_is_a_200(logged_server: RunningServer) -> None:
    """Streams are counted when they end (a hang-up is known only then): one that ends well is a 200."""
    wait_for(lambda: logged_server.metric("inference_active_rows") == 0)
    counted = requests_counted(logged_server, "/v1/chat/completions", 200)
    since = len(logged_server.log())
    body = {**CHAT, "max_tokens": 2, "stream": True}
    response = requests.post(f"{logged_server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.text.endswith("data: [DONE]\n\n")
    log = log_of_one_request(logged_server, since, "/v1/chat/completions")
    assert '"POST /v1/chat/completions HTTP/1.1" 200 ' in log, log
    assert HUNG_UP_LINE not in log, log
    wait_for(lambda: requests_counted(logged_server, "/v1/chat/completions", 200) == counted + 1)


def test_a_stream_cut_by_the_backend_is_still_an_error_with_its_traceback(
    logged_server: RunningServer,
) -> None:
    """A real failure mid-stream (the backend died) must stay in the log as an error."""
    wait_for(lambda: logged_server.metric("inference_active_rows") == 0)
    since = len(logged_server.log())
    stream = requests.post(f"{logged_server.url}/predictions/mock", json=NATIVE, stream=True, timeout=30)
    chunks = stream.iter_content(chunk_size=None)
    assert next(chunks)
    os.kill(logged_server.backend_pid(), signal.SIGKILL)
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # cut, not ended cleanly
        for _ in chunks:
            pass
    log = log_of_one_request(logged_server, since, "/predictions/mock")
    assert f"[ERROR] {ERROR_LINE}" in log, log
    assert "Traceback" in log and "StreamAborted" in log, log
    assert HUNG_UP_LINE not in log, log
    logged_server.wait_ready(30)
