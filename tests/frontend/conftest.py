"""Shared servers for the frontend's end-to-end tests, each started once per module that uses it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask

from backend.messages import BackendConfig
from inference_api import create_app
from inference_api.config import ServerConfig
from tests.server_fixture import RunningServer, running_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_model: end-to-end on the real default model (slow on CPU)")


@pytest.fixture(scope="module")
def app() -> Iterator[Flask]:
    """The app in this process with a fast mock backend (2 rows, a queue of 2), for Flask's test client:
    details that need no gunicorn."""
    config = ServerConfig(backend=BackendConfig(mock=True, rows=2, mock_tokens_per_second=1000), max_queue=2)
    app = create_app(config)
    router = app.extensions["router"]
    assert router.wait_ready(30)
    yield app
    router.stop()


@pytest.fixture(scope="module")
def fast_server() -> Iterator[RunningServer]:
    """A quick mock: for validation, response shapes and metrics. Small body limit for the 413 test."""
    options = "--mock --rows 4 --max-queue 4 --mock-tokens-per-second 1000 --max-body-bytes 65536"
    with running_server(*options.split()) as server:
        yield server


@pytest.fixture(scope="module")
def slow_server() -> Iterator[RunningServer]:
    """One row, one waiting place, 20 tokens per second: timing, backpressure and hang-ups are visible."""
    options = "--mock --rows 1 --max-queue 1 --mock-tokens-per-second 20"
    with running_server(*options.split()) as server:
        yield server
