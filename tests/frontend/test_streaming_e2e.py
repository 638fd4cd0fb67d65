"""Streaming, backpressure and hang-ups through the real gunicorn server, on a slow mock
(one row, one waiting place, 20 tokens per second)."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from backend.mock import mock_text
from tests.server_fixture import RunningServer

TOKENS_PER_SECOND = 20  # as slow_server is started


def expected_text(prompt: str, max_tokens: int) -> str:
    """The mock's answer; the frontend gives it one token id per UTF-8 byte of the prompt."""
    return mock_text(tuple(prompt.encode()), max_tokens)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def wait_idle(server: RunningServer) -> None:
    """No request in a row or waiting, so that each test starts with the row free."""
    wait_for(
        lambda: server.metric("inference_active_rows") == 0 and server.metric("inference_queue_depth") == 0,
        timeout=15,
    )


def open_raw_stream(server: RunningServer, body: bytes) -> socket.socket:
    """A streaming request on a bare socket, so that the test decides exactly when the client hangs up."""
    return open_raw_request(server, "/predictions/mock", body)


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early after {data!r}"
        data += chunk
    return data


def test_stream_arrives_in_pieces_as_generated(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    max_tokens = 2000  # 100 s at 20 tokens per second: an answer sent whole would not come in time
    with requests.post(
        f"{slow_server.url}/predictions/mock",
        json={"text": "stream me", "max_tokens": max_tokens},
        stream=True,
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert response.headers["Transfer-Encoding"] == "chunked"
        assert response.headers["X-Request-ID"]
        chunks = response.iter_content(chunk_size=None)
        received = [next(chunks) for _ in range(10)]
        # Ten pieces, and the request still holds its row: they left as they were made.
        assert slow_server.metric("inference_active_rows") == 1
    text = b"".join(received).decode()
    assert expected_text("stream me", max_tokens).startswith(text)


def test_return_prompt_streams_the_prompt_first(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    body = {"text": "Echo this. ", "max_tokens": 3, "return_prompt": True}
    response = requests.post(f"{slow_server.url}/predictions/mock", json=body, stream=True, timeout=30)
    chunks = list(response.iter_content(chunk_size=None))
    assert chunks[0] == b"Echo this. "
    assert b"".join(chunks).decode() == "Echo this. " + expected_text("Echo this. ", 3)


def test_non_streaming_json_shape_and_usage(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    body = {"text": "json please", "max_tokens": 4, "stream": False}
    response = requests.post(f"{slow_server.url}/predictions/mock", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert response.json() == {
        "text": expected_text("json please", 4),
        "finish_reason": "length",
        "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
    }


def test_stop_sequence_ends_with_stop(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    answer = expected_text("stop", 10)
    stop_word = answer.split()[2]
    body = {"text": "stop", "max_tokens": 10, "stream": False, "stop_sequence": [stop_word]}
    result = requests.post(f"{slow_server.url}/predictions/mock", json=body, timeout=30).json()
    assert result["finish_reason"] == "stop"
    assert result["text"] == answer[: answer.index(stop_word)]


def test_past_the_queue_is_503_with_retry_after(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    long_body = b'{"text": "busy", "max_tokens": 2000}'  # 100 s: holds the row for the whole test
    holder = open_raw_stream(slow_server, long_body)
    read_until(holder, b"\r\n\r\n")  # headers: it holds the row
    waiter = open_raw_stream(slow_server, long_body)
    try:
        wait_for(lambda: slow_server.metric("inference_queue_depth") == 1)
        started = time.monotonic()
        response = requests.post(f"{slow_server.url}/predictions/mock", json={"text": "one more"}, timeout=30)
        assert response.status_code == 503
        assert time.monotonic() - started < 2, "a 503 past the queue must come at once"
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["status_code"] == 503
        assert "queue" in response.json()["message"]
    finally:
        holder.close()
        waiter.close()


def test_client_that_hangs_up_frees_its_row(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    # The hung-up request would hold the only row for 100 s.
    holder = open_raw_stream(slow_server, b'{"text": "hang up", "max_tokens": 2000}')
    read_until(holder, b"\r\n\r\n")
    read_until(holder, b"\r\n")  # a chunk or so of text

    result: dict[str, object] = {}

    def wait_for_the_row() -> None:
        body = {"text": "next", "max_tokens": 5, "stream": False}
        response = requests.post(f"{slow_server.url}/predictions/mock", json=body, timeout=60)
        result["finished_at"] = time.monotonic()
        result["json"] = response.json()

    waiter = threading.Thread(target=wait_for_the_row)
    waiter.start()
    wait_for(lambda: slow_server.metric("inference_queue_depth") == 1)
    # 20 more tokens streamed (each counts an inter-token gap): a wrongly admitted waiter would have
    # had its 5 tokens by then.
    tokens = slow_server.metric("inference_inter_token_latency_seconds_count")
    wait_for(lambda: slow_server.metric("inference_inter_token_latency_seconds_count") >= tokens + 20)
    assert "finished_at" not in result, "the waiting request ran while the row was taken"
    assert slow_server.metric("inference_queue_depth") == 1

    hung_up_at = time.monotonic()
    holder.close()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert result["json"]["text"] == expected_text("next", 5)
    # Its own 5 tokens take 0.25 s; the hung-up request had about 100 s left.
    assert result["finished_at"] - hung_up_at < 5


def test_concurrent_requests_each_get_their_own_text(fast_server: RunningServer) -> None:
    prompts = [f"prompt number {i}" * (i + 1) for i in range(8)]  # rows + waiting places: all admitted
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        body = {"text": prompts[i], "max_tokens": 30 + i, "stream": i % 2 == 0}
        response = requests.post(f"{fast_server.url}/predictions/mock", json=body, timeout=60)
        results[i] = response.text if body["stream"] else response.json()["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {i: expected_text(prompts[i], 30 + i) for i in range(len(prompts))}


def open_raw_request(server: RunningServer, path: str, body: bytes) -> socket.socket:
    """A request on a bare socket: the test decides when the client hangs up."""
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


@pytest.mark.parametrize(
    "path, body",
    [
        ("/predictions/mock", b'{"text": "hang up", "max_tokens": 2000, "stream": false}'),
        ("/v1/completions", b'{"model": "mock", "prompt": "hang up", "max_tokens": 2000, "n": 1}'),
        (
            "/v1/chat/completions",
            b'{"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}',
        ),
    ],
)
def test_a_client_that_hangs_up_on_a_json_answer_frees_its_row(
    slow_server: RunningServer, path, body
) -> None:
    """A JSON answer writes nothing until it is done: the server must notice the hang-up itself."""
    wait_idle(slow_server)
    holder = open_raw_request(slow_server, path, body)  # 2,000 tokens: 100 s of the only row
    wait_for(lambda: slow_server.metric("inference_active_rows") == 1)
    holder.close()
    # A poll every half second, then the next mock step; the request had about 100 s left.
    wait_for(lambda: slow_server.metric("inference_active_rows") == 0, timeout=5)
    response = requests.post(
        f"{slow_server.url}/predictions/mock",
        json={"text": "next", "max_tokens": 3, "stream": False},
        timeout=10,
    )
    assert response.json()["text"] == expected_text("next", 3)


def test_a_client_that_hangs_up_while_queued_leaves_the_queue(slow_server: RunningServer) -> None:
    wait_idle(slow_server)
    holder = open_raw_stream(slow_server, b'{"text": "hold", "max_tokens": 2000}')
    read_until(holder, b"\r\n\r\n")
    queued = open_raw_request(slow_server, "/predictions/mock", b'{"text": "queued", "max_tokens": 5}')
    wait_for(lambda: slow_server.metric("inference_queue_depth") == 1)
    queued.close()
    wait_for(lambda: slow_server.metric("inference_queue_depth") == 0, timeout=5)  # not when the row frees
    holder.close()


def test_a_request_in_a_row_is_active_before_its_first_piece(slow_server: RunningServer) -> None:
    """Queue depth counts requests waiting for a row, not those in one whose text is held back."""
    wait_idle(slow_server)
    # Every token could be the start of this stop sequence, so no text leaves for 40 tokens (2 s).
    stop = expected_text("held", 60) + "END"
    body = {"text": "held", "max_tokens": 40, "stop_sequence": stop, "stream": False}
    answer: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            requests.post(f"{slow_server.url}/predictions/mock", json=body, timeout=30).json()
        )
    )
    thread.start()
    wait_for(lambda: slow_server.metric("inference_active_rows") == 1, timeout=1.5)
    assert slow_server.metric("inference_queue_depth") == 0
    assert "text" not in answer  # still under way, no piece yet
    thread.join(timeout=30)
    assert answer["text"] == expected_text("held", 40)
