"""The app with Flask's test client and a mock backend: details that need no gunicorn."""

from __future__ import annotations

import gc
import logging
import time

import pytest
from flask import Flask

from backend.messages import BackendConfig
from backend.mock import mock_text
from inference_api import create_app
from inference_api.__main__ import parse_args
from inference_api.config import DEFAULT_MAX_BODY_BYTES, ServerConfig


def test_default_body_limit_is_one_mebibyte(app: Flask) -> None:
    assert DEFAULT_MAX_BODY_BYTES == 1024 * 1024
    client = app.test_client()
    response = client.post("/predictions/mock", data=b"x" * (DEFAULT_MAX_BODY_BYTES + 1))
    assert response.status_code == 413
    assert response.get_json()["status_code"] == 413


def test_streaming_and_json_agree(app: Flask) -> None:
    client = app.test_client()
    streamed = client.post("/predictions/mock", json={"text": "same", "max_tokens": 7})
    assert streamed.mimetype == "text/plain"
    joined = client.post("/predictions/mock", json={"text": "same", "max_tokens": 7, "stream": False})
    assert streamed.get_data(as_text=True) == joined.get_json()["text"] == mock_text(tuple(b"same"), 7)


def test_every_error_is_json_with_a_request_id(app: Flask) -> None:
    client = app.test_client()
    for response in (
        client.post("/predictions/mock", data=b"{"),
        client.get("/nowhere"),
        client.put("/predictions/mock"),
        client.post("/predictions/other", json={"text": "hi"}),
    ):
        assert response.is_json
        assert set(response.get_json()) == {"status_code", "message"}
        assert response.get_json()["status_code"] == response.status_code
        assert response.headers["X-Request-ID"]


def test_an_unexpected_error_is_a_500_logged_with_its_traceback(
    app: Flask, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug is a server error, in the log with its traceback (a client's hang-up is not: test_hangup_e2e)."""

    def broken() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setitem(app.view_functions, "ops.health", broken)
    with caplog.at_level(logging.INFO, logger="inference_api"):
        response = app.test_client().get("/health")
    assert response.status_code == 500
    assert response.get_json() == {"status_code": 500, "message": "internal error: RuntimeError"}
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError


def test_not_ready_is_503_with_retry_after() -> None:
    app = create_app(ServerConfig(backend=BackendConfig(mock=True)))
    router = app.extensions["router"]
    assert router.wait_ready(30)
    router.stop()  # as if the backend were loading or restarting
    client = app.test_client()
    for response in (client.get("/ready"), client.post("/predictions/mock", json={"text": "hi"})):
        assert response.status_code == 503
        assert int(response.headers["Retry-After"]) >= 1
        assert response.get_json()["status_code"] == 503
    assert client.get("/health").status_code == 200


def test_once_ready_what_the_worker_loaded_is_out_of_the_cycle_collectors_sight() -> None:
    """docs/frontend.md, "The cycle collector": a full collection read the tokenizers, templates and
    transformers' modules each time (60 ms during a flood); once the backend is ready they are frozen."""
    gc.unfreeze()
    app = create_app(ServerConfig(backend=BackendConfig(mock=True)))
    router = app.extensions["router"]
    try:
        assert router.wait_ready(30)
        deadline = time.monotonic() + 10  # frozen just after ready is announced
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gc.get_freeze_count() > 0
    finally:
        router.stop()


def test_config_travels_through_the_environment() -> None:
    options = "--mock --rows 3 --max-queue 0 --port 9001 --max-seq-len 512 --dtype float32 --restart-delay 2"
    options += " --torch-threads 1 --kv-cache-dtype bfloat16 --embedding-pooling last"
    options += " --embedding-model org/embedder --rerank-model org/reranker"
    config = parse_args(options.split())
    assert config.backend.embedding_model == "org/embedder" and config.backend.rerank_model == "org/reranker"
    assert ServerConfig.from_env(config.to_env()) == config
    assert config.backend.torch_threads == 1
    assert config.backend.kv_cache_dtype == "bfloat16" and config.embedding_pooling == "last"
    assert config.threads == 3 + 0 + 8
    assert ServerConfig.from_env({}).backend.rows == 32


def test_a_server_without_a_rerank_model_answers_rerank_with_a_404_naming_the_option(app: Flask) -> None:
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        response = app.test_client().post(path, json={"query": "a", "documents": ["b"]})
        assert response.status_code == 404
        assert "--rerank-model" in response.get_json()["error"]["message"]
