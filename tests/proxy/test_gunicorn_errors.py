"""The answers gunicorn writes itself in the proxy, to requests it cannot parse, are JSON in the proxy's
error shape like every other error, not gunicorn's HTML page (issue 19, leftovers)."""

from __future__ import annotations

import json

import pytest

from tests.gunicorn_rejects import REJECTED, raw_exchange
from tests.proxy.conftest import running_proxy


@pytest.fixture(scope="module")
def plain_proxy(echo_upstream):
    with running_proxy(echo_upstream.url) as proxy:
        yield proxy


@REJECTED
def test_what_gunicorn_rejects_is_answered_in_json(plain_proxy, request_bytes: bytes, status: int) -> None:
    got, headers, body = raw_exchange(plain_proxy.url, request_bytes)
    assert got == status
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert headers["x-request-id"]
    answer = json.loads(body)
    assert answer["status_code"] == status and answer["message"]
    assert answer["error"] == {"message": answer["message"], "type": "invalid_request_error", "code": status}
