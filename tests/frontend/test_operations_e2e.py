"""/health, /ready, /metrics, a backend that dies, and the server's own life, through real gunicorn."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from tests.server_fixture import RunningServer, running_server, start_server, stop_server

METRIC_NAMES = [
    "inference_requests_total",
    "inference_time_to_first_token_seconds_bucket",
    "inference_request_queue_time_seconds_bucket",
    "inference_inter_token_latency_seconds_bucket",
    "inference_end_to_end_latency_seconds_bucket",
    "inference_queue_depth",
    "inference_active_rows",
    "inference_prompt_tokens_total",
    "inference_generated_tokens_total",
    "inference_backend_ready",
    "inference_backend_restarts_total",
]


def test_health_and_ready(fast_server: RunningServer) -> None:
    health = requests.get(f"{fast_server.url}/health", timeout=10)
    assert health.status_code == 200
    ready = requests.get(f"{fast_server.url}/ready", timeout=10)
    assert ready.status_code == 200
    assert ready.json()["model"] == "mock"
    assert ready.json()["rows"] == 4


def test_metrics_has_every_metric(fast_server: RunningServer) -> None:
    body = {"text": "count me", "max_tokens": 5, "stream": False}
    assert requests.post(f"{fast_server.url}/predictions/mock", json=body, timeout=10).status_code == 200
    response = requests.get(f"{fast_server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    for name in METRIC_NAMES:
        assert f"\n{name}" in response.text, name
    assert 'inference_requests_total{endpoint="/predictions/<path:model>",status="200"}' in response.text
    assert fast_server.metric("inference_generated_tokens_total") >= 5
    assert fast_server.metric("inference_time_to_first_token_seconds_count") >= 1
    assert fast_server.metric("inference_request_queue_time_seconds_count") >= 1


def test_request_id_is_echoed_when_sane(fast_server: RunningServer) -> None:
    sane = requests.get(f"{fast_server.url}/health", headers={"X-Request-ID": "abc-123"}, timeout=10)
    assert sane.headers["X-Request-ID"] == "abc-123"
    insane = requests.get(
        f"{fast_server.url}/health", headers={"X-Request-ID": "a b\tc" + "x" * 200}, timeout=10
    )
    assert insane.headers["X-Request-ID"] not in ("", "a b\tc" + "x" * 200)
    generated = requests.get(f"{fast_server.url}/health", timeout=10)
    assert len(generated.headers["X-Request-ID"]) >= 16


def test_gunicorn_worker_never_loads_torch(fast_server: RunningServer) -> None:
    mapped = [m.path for m in fast_server.worker().memory_maps()]
    assert mapped, "could not read the worker's memory maps"
    assert not [path for path in mapped if "torch" in path]


def test_a_killed_backend_is_restarted(tmp_path: Path) -> None:
    # A restart delay long enough to see the server not ready, however loaded the machine is.
    options = "--mock --rows 2 --mock-tokens-per-second 20 --restart-delay 3"
    with running_server(*options.split()) as server:
        url = f"{server.url}/predictions/mock"
        stream = requests.post(url, json={"text": "streaming", "max_tokens": 2000}, stream=True, timeout=30)
        chunks = stream.iter_content(chunk_size=None)
        assert next(chunks)
        outcome: dict[str, requests.Response] = {}
        blocking = threading.Thread(
            target=lambda: outcome.update(
                response=requests.post(
                    url, json={"text": "json", "max_tokens": 2000, "stream": False}, timeout=30
                )
            )
        )
        blocking.start()
        wait_for_metric(server, "inference_active_rows", 2)

        old_pid = server.backend_pid()
        os.kill(old_pid, signal.SIGKILL)

        # The stream in flight is cut (no clean end of the chunked body), the JSON one gets a 503.
        with pytest.raises(requests.exceptions.RequestException):
            for _ in chunks:
                pass
        blocking.join(30)
        assert outcome["response"].status_code == 503
        assert outcome["response"].json()["status_code"] == 503
        assert "Retry-After" in outcome["response"].headers

        # Not ready until the new backend is.
        assert requests.get(f"{server.url}/ready", timeout=10).status_code == 503
        assert requests.post(url, json={"text": "too soon"}, timeout=10).status_code == 503
        server.wait_ready(timeout=30)
        new_pid = server.backend_pid()
        assert new_pid != old_pid
        assert server.metric("inference_backend_restarts_total") == 1

        body = {"text": "after", "max_tokens": 3, "stream": False}
        assert requests.post(url, json=body, timeout=30).json()["finish_reason"] == "length"
    assert not psutil.pid_exists(new_pid) or psutil.Process(new_pid).status() == psutil.STATUS_ZOMBIE


def test_backend_stops_with_the_server(tmp_path: Path) -> None:
    server = start_server("--mock", log_path=tmp_path / "server.log")
    try:
        server.wait_ready(60)
        backend = psutil.Process(server.backend_pid())
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        backend.wait(10)  # raises TimeoutExpired if the backend outlived the server
        assert "Worker exiting" in server.log()
    finally:
        stop_server(server)


def test_a_backend_that_cannot_start_stops_the_server(tmp_path: Path) -> None:
    # No mock: a model directory of a type no transformers class is for (one that is not there stops the
    # command line before gunicorn: tests/frontend/test_server_options.py). The backend fails to start,
    # and the server exits with gunicorn's "app failed to load" code and a message, instead of never
    # becoming ready.
    model = tmp_path / "unknown-type"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-type"}')
    server = start_server("--model", str(model), log_path=tmp_path / "server.log")
    try:
        assert server.process.wait(120) == 4, server.log()[-3000:]
        assert "the backend cannot start" in server.log()
    finally:
        stop_server(server)


# A parser named on the command line whose tags the mock's byte tokenizer does not have as tokens, and the
# start of what the server says of it.
UNREADABLE = [
    ("--tool-call-parser", "gemma4", "--tool-call-parser gemma4 reads calls between Gemma 4's <|tool_call>"),
    (
        "--tool-call-parser",
        "functiongemma",
        "--tool-call-parser functiongemma reads calls between FunctionGemma's <start_function_call>",
    ),
    ("--tool-call-parser", "mistral", "--tool-call-parser mistral reads calls after a [TOOL_CALLS] token"),
    ("--tool-call-parser", "granite", "--tool-call-parser granite reads calls after a <|tool_call|> token"),
    ("--tool-call-parser", "deepseek_v31", "--tool-call-parser deepseek_v31 reads calls between DeepSeek's"),
    ("--tool-call-parser", "lfm2", "--tool-call-parser lfm2 reads calls between <|tool_call_start|> and"),
    ("--tool-call-parser", "jamba", "--tool-call-parser jamba reads calls between <tool_calls> and"),
    ("--tool-call-parser", "cohere_command4", "--tool-call-parser cohere_command4 reads calls and answers"),
    ("--reasoning-parser", "cohere_command4", "--reasoning-parser reads thoughts between <|START_THINKING|>"),
    ("--reasoning-parser", "gemma4", "--reasoning-parser reads thoughts between <|channel> and <channel|>"),
    ("--reasoning-parser", "mistral", "--reasoning-parser reads thoughts between [THINK] and [/THINK]"),
]


@pytest.mark.parametrize(("option", "parser", "says"), UNREADABLE)
def test_a_parser_the_tokenizer_cannot_read_stops_the_server(
    tmp_path: Path, option: str, parser: str, says: str
) -> None:
    """Gemma 4's, Mistral's and Cohere's calls and thoughts, and FunctionGemma's, Granite's, DeepSeek's,
    LFM2's and Jamba's calls, are between or after tokens of their own, which the mock's byte tokenizer
    lacks."""
    server = start_server("--mock", option, parser, log_path=tmp_path / "server.log")
    try:
        assert server.process.wait(120) == 4, server.log()[-3000:]
        assert says in server.log()
    finally:
        stop_server(server)


def wait_for_metric(server: RunningServer, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)
