"""A stream cut upstream stays visibly cut through the proxy, never a clean but shorter end (SPEC §6;
issue 15, item B): an upstream that dies mid-answer, and a real server whose backend fails."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest
import requests

from tests.proxy.conftest import bearer, running_proxy
from tests.server_fixture import RunningServer, running_server

CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
# What each path answers before the upstream's process dies: the connection just closes.
CUT = {
    "/chunked": CHUNKED + b"6\r\nhello \r\n6\r\nworld \r\n",
    "/before-the-body": CHUNKED,
    "/sized": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nhello world ",
}
READY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class DyingUpstream:
    """A raw HTTP server: /ready is well, every path of CUT starts an answer and drops the connection."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self.answer, args=(connection,), daemon=True).start()

    def answer(self, connection: socket.socket) -> None:
        with connection:
            request = b""
            while b"\r\n\r\n" not in request:
                if not (data := connection.recv(65536)):
                    return
                request += data
            path = request.split(b" ", 2)[1].decode()
            connection.sendall(CUT.get(path, READY))  # closes after even /ready: no keep-alive

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def dying_upstream() -> Iterator[DyingUpstream]:
    upstream = DyingUpstream()
    yield upstream
    upstream.close()


def raw_get(url: str, path: str, headers: dict[str, str]) -> bytes:
    """Everything the server sends until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{lines}\r\n".encode())
        received = b""
        while data := connection.recv(65536):
            received += data
    return received


@pytest.mark.parametrize("path", list(CUT))
def test_an_answer_the_upstream_breaks_off_is_cut_for_the_client_too(dying_upstream, path):
    with running_proxy(dying_upstream.url) as proxy:
        received = raw_get(proxy.url, path, bearer())
        with pytest.raises(requests.exceptions.ChunkedEncodingError):  # requests' word for a cut body
            requests.get(f"{proxy.url}{path}", headers=bearer(), timeout=10).raise_for_status()
        if shutil.which("curl"):
            for url, headers in (
                (dying_upstream.url, []),
                (proxy.url, ["-H", f"Authorization: {bearer()['Authorization']}"]),
            ):
                curl = subprocess.run(["curl", "-sS", "-o", "/dev/null", *headers, url + path], timeout=30)
                assert curl.returncode == 18, f"{url}: curl exit {curl.returncode}"  # 18: partial transfer
        assert requests.get(f"{proxy.url}/health", timeout=5).status_code == 200  # the proxy is fine
        log = proxy.log()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")  # the status went out before the cut, as upstream
    if path == "/sized":
        assert b"Content-Length: 100" in head and body == b"hello world "
    else:
        assert b"Transfer-Encoding: chunked" in head
        assert not body.endswith(b"0\r\n\r\n")  # no last chunk: the client can tell
        assert body == (b"6\r\nhello \r\n6\r\nworld \r\n" if path == "/chunked" else b"")
    assert "broke off a response" in log
    assert "Traceback" not in log  # a lost upstream is a warning line, not a crash


STALL = "stall for good"


@pytest.fixture(scope="module")
def stalling_server() -> Iterator[RunningServer]:
    """The mock backend, stalling for good at the STALL prompt: the router's watchdog fails every row
    in flight, then restarts the backend."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERENCE_MOCK_STALL_TEXT", STALL)
        options = "--mock --rows 4 --mock-tokens-per-second 20 --step-timeout 2 --restart-delay 0.5"
        with running_server(*options.split()) as server:
            yield server


def test_streams_a_failed_backend_ends_arrive_cut_or_with_an_error_event_never_done(stalling_server):
    with running_proxy(stalling_server.url) as proxy:
        native = requests.post(
            f"{proxy.url}/predictions/mock",
            json={"text": "a long answer", "max_tokens": 2000},
            headers=bearer(),
            stream=True,
            timeout=30,
        )
        native_chunks = native.iter_content(chunk_size=None)
        assert next(native_chunks)
        chat = requests.post(
            f"{proxy.url}/v1/chat/completions",
            json={
                "model": "mock",
                "messages": [{"role": "user", "content": "a long answer"}],
                "max_tokens": 2000,
                "stream": True,
            },
            headers=bearer(),
            stream=True,
            timeout=30,
        )
        chat_lines = chat.iter_lines(decode_unicode=True)
        assert next(line for line in chat_lines if line).startswith("data: {")

        stalled = requests.post(
            f"{proxy.url}/v1/completions",
            json={"model": "mock", "prompt": STALL, "max_tokens": 5},
            headers=bearer(),
            timeout=30,
        )
        assert stalled.status_code == 503

        with pytest.raises(requests.exceptions.ChunkedEncodingError):  # the native stream: cut
            for _ in native_chunks:
                pass
        events = [line for line in chat_lines if line]  # the OpenAI stream: an error event, the end
    assert events[-1] != "data: [DONE]" and "data: [DONE]" not in events
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "no step" in error["message"]
