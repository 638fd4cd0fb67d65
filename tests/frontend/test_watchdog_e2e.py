"""A backend that stops stepping is noticed, its requests end with an error, and it is restarted
(issue 15, item 5): through the real server, on a mock that stalls for good at one prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests

from tests.server_fixture import RunningServer, running_server

STEP_TIMEOUT = 2.0
STALL = "stall for good"


@pytest.fixture(scope="module")
def stalling_server() -> Iterator[RunningServer]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERENCE_MOCK_STALL_TEXT", STALL)
        options = (
            f"--mock --rows 2 --mock-tokens-per-second 20 --step-timeout {STEP_TIMEOUT} --restart-delay 0.5"
        )
        with running_server(*options.split()) as server:
            yield server


def test_an_idle_backend_is_not_taken_for_a_hung_one(stalling_server: RunningServer) -> None:
    time.sleep(3 * STEP_TIMEOUT)  # idle for longer than the timeout: its heartbeat keeps it ready
    assert requests.get(f"{stalling_server.url}/ready", timeout=5).status_code == 200
    assert stalling_server.metric("inference_backend_restarts_total") == 0


def test_a_hung_backend_fails_its_requests_says_why_and_is_restarted(stalling_server: RunningServer) -> None:
    url = stalling_server.url
    streaming = requests.post(
        f"{url}/predictions/mock", json={"text": "a long answer", "max_tokens": 2000}, stream=True, timeout=30
    )
    lines = streaming.iter_content(chunk_size=None)
    assert next(lines)  # streaming
    stalled_at = time.monotonic()
    stalled = requests.post(
        f"{url}/v1/completions", json={"model": "mock", "prompt": STALL, "max_tokens": 5}, timeout=30
    )
    assert stalled.status_code == 503
    assert "no step" in stalled.json()["error"]["message"]
    assert time.monotonic() - stalled_at < STEP_TIMEOUT + 3
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # the stream is cut, not ended cleanly
        for _ in lines:
            pass
    ready = requests.get(f"{url}/ready", timeout=5)
    if ready.status_code == 503:  # still restarting: it says why
        assert "no step" in ready.json()["message"]
    deadline = time.monotonic() + 30
    while requests.get(f"{url}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the backend was not restarted"
        time.sleep(0.1)
    answer = requests.post(
        f"{url}/predictions/mock", json={"text": "after", "max_tokens": 3, "stream": False}, timeout=30
    )
    assert answer.status_code == 200 and answer.json()["finish_reason"] == "length"
    assert stalling_server.metric("inference_backend_restarts_total") == 1
