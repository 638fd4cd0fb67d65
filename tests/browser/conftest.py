"""A browser per test, and the servers the chat page talks to, each started once per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from selenium import webdriver

from tests.browser.chat_page import chromium
from tests.proxy.conftest import RunningProxy, running_proxy
from tests.server_fixture import RunningServer, running_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_model: end-to-end on the real default model (slow on CPU)")


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    with chromium() as driver:  # a fresh profile each time: nothing kept between tests
        yield driver


@pytest.fixture(scope="module")
def real_server(default_mode_server: RunningServer) -> RunningServer:
    """The default model, as a person would run it (make run): real text, at a CPU's pace."""
    return default_mode_server


@pytest.fixture(scope="module")
def real_proxy(real_server: RunningServer) -> Iterator[RunningProxy]:
    with running_proxy(real_server.url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def busy_server() -> Iterator[RunningServer]:
    """The mock with one row and no waiting place: a second request is a 503 at once."""
    options = "--mock --rows 1 --max-queue 0 --mock-tokens-per-second 10"
    with running_server(*options.split()) as server:
        yield server


@pytest.fixture(scope="module")
def mock_server() -> Iterator[RunningServer]:
    """The mock at a quick pace: long answers in a few seconds, for what the page does around them."""
    with running_server("--mock", "--rows", "4", "--mock-tokens-per-second", "200") as server:
        yield server
