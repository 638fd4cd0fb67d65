"""An answer without a body (HEAD) frees its upstream: the body's generator never starts for it."""

from __future__ import annotations

import gc

import pytest

from proxy.app import create_app
from proxy.config import ProxyConfig
from tests.proxy.conftest import SECRET, bearer


@pytest.fixture
def app_and_pool(echo_upstream):
    app = create_app(ProxyConfig(upstreams=(echo_upstream.url,)), secret=SECRET)
    pool = app.extensions["upstreams"]
    yield app, pool
    pool.stop()


def test_what_the_app_holds_is_out_of_the_cycle_collectors_sight(echo_upstream):
    """As the inference server's worker (docs/frontend.md, "The cycle collector")."""
    gc.unfreeze()
    app = create_app(ProxyConfig(upstreams=(echo_upstream.url,)), secret=SECRET)
    app.extensions["upstreams"].stop()
    assert gc.get_freeze_count() > 0


def in_flight(pool) -> int:
    return sum(upstream.in_flight for upstream in pool.upstreams)


def test_a_head_answer_frees_its_upstream_as_a_get_does(app_and_pool):
    app, pool = app_and_pool
    client = app.test_client()
    for method in ("GET", "HEAD", "HEAD"):
        with client.open("/v1/models", method=method, headers=bearer()) as answer:
            assert answer.status_code == 200
        assert in_flight(pool) == 0, f"{method} left its upstream counted busy"
