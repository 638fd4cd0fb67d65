"""Slow or idle clients cannot starve the others, and /health answers under any load (SPEC §6;
issue 15, items A and 10): through a real proxy process, on the mock backend."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress

import pytest
import requests
import yaml

from tests.proxy.conftest import bearer, running_proxy
from tests.server_fixture import ROOT, free_port

SLOW_CLIENTS = 1000
HEADER_TIMEOUT = 6.0  # long enough to check everything while they are held, short for the test
PROMPT = {"text": "hi", "max_tokens": 20}  # 1 s at the mock's 20 tokens per second


def allow_open_files(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        if hard != resource.RLIM_INFINITY and hard < count:
            pytest.skip(f"the open file limit is {hard}; this test needs {count}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


@contextmanager
def slowloris(url: str, count: int, period: float = 1.0) -> Iterator[list[socket.socket]]:
    """`count` connections that each start a request and add a header line every `period` seconds,
    never finishing it."""
    host, port = url.removeprefix("http://").split(":")
    connections = []
    for _ in range(count):
        connection = socket.create_connection((host, int(port)), timeout=5)
        connection.setblocking(False)
        connection.send(b"GET /health HTTP/1.1\r\n")
        connections.append(connection)
    stop = threading.Event()

    def drip() -> None:
        line = 0
        while not stop.wait(period):
            line += 1
            for connection in connections:
                with suppress(OSError):  # closed by the proxy: nothing to send to
                    connection.send(f"X-Slow-{line}: still coming\r\n".encode())

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    try:
        yield connections
    finally:
        stop.set()
        dripping.join()
        for connection in connections:
            connection.close()


def closed_by_peer(connection: socket.socket) -> bool:
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:  # closed while the drip was still sending: reset, closed all the same
        return True


def stream(url: str, answering: threading.Semaphore | None = None) -> list[float]:
    """Arrival times of the chunks of one streamed answer, which must be whole. `answering` is
    released once the proxy has taken the connection and the answer's headers have come."""
    started = time.monotonic()
    response = requests.post(
        f"{url}/predictions/mock", json=PROMPT, headers=bearer(), stream=True, timeout=(5, 10)
    )
    assert response.status_code == 200, response.text
    if answering is not None:
        answering.release()
    arrivals, text = [], b""
    for chunk in response.iter_content(chunk_size=None):
        arrivals.append(time.monotonic() - started)
        text += chunk
    assert len(text.split()) == PROMPT["max_tokens"]
    return arrivals


def health_seconds(url: str) -> float:
    started = time.monotonic()
    response = requests.get(f"{url}/health", timeout=5)
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    return time.monotonic() - started


def test_a_thousand_slow_clients_are_held_while_others_stream_and_dropped_at_the_header_deadline(
    mock_server,
):
    allow_open_files(SLOW_CLIENTS + 200)
    args = ("--header-timeout", str(HEADER_TIMEOUT))
    with running_proxy(mock_server.url, args=args) as proxy, slowloris(proxy.url, SLOW_CLIENTS) as slow:
        opened = time.monotonic()
        worker = proxy.worker()
        while worker.num_fds() < SLOW_CLIENTS:  # accepted, each a greenlet, not in the listen backlog
            assert time.monotonic() - opened < 3, f"the proxy took only {worker.num_fds()} connections"
            time.sleep(0.05)

        # While the proxy holds them all: /health at once, and three answers streamed whole.
        assert max(health_seconds(proxy.url) for _ in range(5)) < 1.0
        with ThreadPoolExecutor(3) as pool:
            for arrivals in pool.map(lambda _: stream(proxy.url), range(3)):
                assert len(arrivals) >= 10 and arrivals[0] < arrivals[-1] / 3  # as generated
        assert time.monotonic() - opened < HEADER_TIMEOUT, "too slow to check before the deadline"
        assert not any(closed_by_peer(connection) for connection in slow)

        # Still sending a header line a second, but past the deadline for all of them: closed.
        time.sleep(max(0.0, opened + HEADER_TIMEOUT - time.monotonic()))
        deadline = opened + HEADER_TIMEOUT + 5
        while not all(closed_by_peer(connection) for connection in slow):
            assert time.monotonic() < deadline, "slow clients outlived the header timeout"
            time.sleep(0.2)
        assert health_seconds(proxy.url) < 1.0


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(echo_upstream):
    with running_proxy(echo_upstream.url, args=("--body-timeout", "1")) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            started = time.monotonic()
            headers = f"Authorization: {bearer()['Authorization']}\r\nContent-Length: 100\r\n"
            connection.sendall(f"POST /echo HTTP/1.1\r\nHost: proxy\r\n{headers}\r\n0123456789".encode())
            answer = b""
            while chunk := connection.recv(65536):  # until the proxy closes the connection
                answer += chunk
            waited = time.monotonic() - started
        # A complete body still gets through.
        complete = requests.post(f"{proxy.url}/echo", data=b"x" * 100, headers=bearer(), timeout=10)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"status_code":408' in answer and b"did not arrive within 1 s" in answer
    assert 1.0 <= waited < 4
    assert complete.status_code == 200 and complete.json()["body"] == "x" * 100


def one_connection(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=10)


def ask(connection: http.client.HTTPConnection, path: str, body: dict, headers: dict) -> tuple[int, bytes]:
    """One request on `connection`, its answer read whole (as a pooled client does before the next)."""
    connection.request("POST", path, body=json.dumps(body), headers=headers)
    answer = connection.getresponse()
    return answer.status, answer.read()


def test_an_answer_longer_than_the_body_timeout_leaves_the_connection_serving(mock_server):
    # A generation outlasting --body-timeout, then the next request on the same kept-alive connection,
    # as httpx, requests.Session and the openai SDK send it.
    with running_proxy(mock_server.url, args=("--body-timeout", "2")) as proxy:
        connection = one_connection(proxy.url)
        started = time.monotonic()
        status, text = ask(
            connection, "/predictions/mock", {"text": "hi", "max_tokens": 60, "stream": True}, bearer()
        )
        assert status == 200 and len(text.split()) == 60
        assert time.monotonic() - started > 2.5, "the answer must outlast the body timeout"
        socket_of_the_first = connection.sock
        next_prompt = {"text": "hi", "max_tokens": 2, "stream": False}
        status, answer = ask(connection, "/predictions/mock", next_prompt, bearer())
        assert status == 200, answer  # before the fix: 500, and never forwarded
        assert json.loads(answer)["usage"]["completion_tokens"] == 2
        assert connection.sock is socket_of_the_first  # the same connection, not a new one
        connection.close()


def test_a_request_refused_before_its_body_is_read_keeps_the_connection_after_a_long_answer(
    echo_upstream,
):
    with running_proxy(echo_upstream.url, args=("--body-timeout", "2")) as proxy:
        connection = one_connection(proxy.url)
        status, _ = ask(connection, "/slow", {"first": 1}, bearer())  # 3 s upstream
        assert status == 200
        socket_of_the_first = connection.sock
        # Refused before its body is read: the worker reads the body after the answer, then goes on.
        status, _ = ask(connection, "/echo", {"unread": 1}, {})
        assert status == 401
        status, answer = ask(connection, "/echo", {"third": 3}, bearer())
        assert status == 200 and json.loads(json.loads(answer)["body"]) == {"third": 3}
        assert connection.sock is socket_of_the_first
        connection.close()


def test_the_probe_port_answers_health_while_every_connection_streams(mock_server):
    health_port = free_port()
    args = ("--max-connections", "4", "--health-port", str(health_port))
    with running_proxy(mock_server.url, args=args) as proxy:
        probe = f"http://127.0.0.1:{health_port}"
        answering = threading.Semaphore(0)
        with ThreadPoolExecutor(4) as pool:
            # the mock's 4 rows, 1 s each
            streams = [pool.submit(stream, proxy.url, answering) for _ in range(4)]
            # Every stream holds its connection before the fifth asks (a sleep was not enough on a
            # loaded machine: a stream not yet connected left the fifth a place).
            for _ in streams:
                assert answering.acquire(timeout=5), "a stream was not answered"
            assert not any(s.done() for s in streams)
            # All four connections stream: a fifth waits to be accepted, /health on the main port too...
            with pytest.raises(requests.Timeout):
                requests.get(f"{proxy.url}/health", timeout=0.3)
            # ...and the liveness probe's port answers at once.
            assert health_seconds(probe) < 0.25
            for finished in streams:
                finished.result()
        assert health_seconds(proxy.url) < 1.0  # capacity back
        # The probe port is for the probe (and Prometheus) only.
        elsewhere = requests.get(f"{probe}/v1/models", headers=bearer(), timeout=5)
        assert elsewhere.status_code == 404 and "/health and /metrics only" in elsewhere.json()["message"]
        assert requests.get(f"{proxy.url}/v1/models", headers=bearer(), timeout=5).status_code == 200


def test_the_shipped_liveness_probe_asks_the_probe_port_which_the_service_does_not_expose():
    from proxy.__main__ import parse_args

    deployment, service = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "proxy.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    config = parse_args(container["command"][3:])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": config.port, "probe": config.health_port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "probe"}
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["http"]
