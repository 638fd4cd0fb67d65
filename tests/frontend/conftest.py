"""Shared servers for the frontend's end-to-end tests, each started once per module that uses it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server_fixture import RunningServer, running_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_model: end-to-end on the real default model (slow on CPU)")


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
