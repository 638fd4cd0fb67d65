"""Browsers' cross-origin requests through the real proxy (--allowed-origins, proxy/cors.py): a preflight
is answered before the token check for an allowed origin and refused for another, answers to an allowed
origin say it may read them, and without the option nothing changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from tests.proxy.conftest import RunningProxy, bearer, running_proxy, start_refused

TOOLS = "https://tools.example.com"
OTHER = "https://elsewhere.example.com"
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# What the official JavaScript client asks to send from a page
ASKED_HEADERS = "authorization, content-type, x-stainless-os, x-stainless-lang"


def preflight(proxy: RunningProxy, origin: str, path: str = "/v1/chat/completions") -> requests.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": ASKED_HEADERS,
    }
    return requests.options(f"{proxy.url}{path}", headers=headers, timeout=10)


@pytest.fixture(scope="module")
def cors_proxy(mock_server) -> Iterator[RunningProxy]:
    with running_proxy(mock_server.url, args=("--allowed-origins", TOOLS, "http://localhost:3000")) as proxy:
        yield proxy


def test_an_allowed_origins_preflight_is_answered_without_a_token(cors_proxy):
    answer = preflight(cors_proxy, TOOLS)
    assert answer.status_code == 204, answer.text
    assert answer.headers["Access-Control-Allow-Origin"] == TOOLS
    assert "POST" in answer.headers["Access-Control-Allow-Methods"]
    assert answer.headers["Access-Control-Allow-Headers"] == ASKED_HEADERS
    assert int(answer.headers["Access-Control-Max-Age"]) > 0
    assert "Access-Control-Allow-Credentials" not in answer.headers  # tokens are headers, never cookies
    assert "Origin" in answer.headers["Vary"]


def test_another_origins_preflight_is_a_403_naming_it(cors_proxy):
    answer = preflight(cors_proxy, OTHER)
    assert answer.status_code == 403
    assert OTHER in answer.json()["error"]["message"]
    assert "Access-Control-Allow-Origin" not in answer.headers


def test_an_allowed_origins_answers_say_it_may_read_them_refusals_included(cors_proxy):
    headers = {**bearer(), "Origin": TOOLS}
    answer = requests.post(f"{cors_proxy.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert answer.headers["Access-Control-Allow-Origin"] == TOOLS
    assert "X-Request-ID" in answer.headers["Access-Control-Expose-Headers"]
    streamed = requests.post(
        f"{cors_proxy.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers, timeout=30
    )
    assert streamed.headers["Access-Control-Allow-Origin"] == TOOLS and "data: [DONE]" in streamed.text
    refused = requests.post(
        f"{cors_proxy.url}/v1/chat/completions", json=CHAT, headers={"Origin": TOOLS}, timeout=30
    )
    assert refused.status_code == 401  # the token check is as for any request, and the page can read why
    assert refused.headers["Access-Control-Allow-Origin"] == TOOLS


def test_another_origins_request_is_served_but_not_let_through_to_its_page(cors_proxy):
    headers = {**bearer(), "Origin": OTHER}
    answer = requests.post(f"{cors_proxy.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
    assert answer.status_code == 200
    assert "Access-Control-Allow-Origin" not in answer.headers


def test_without_the_option_a_preflight_needs_a_token_as_before(proxy):
    answer = preflight(proxy, TOOLS)
    assert answer.status_code == 401
    assert not any(name.startswith("Access-Control-") for name in answer.headers)


def test_an_entry_that_is_not_an_origin_stops_the_start(tmp_path):
    refusal = start_refused("--allowed-origins", "tools.example.com/app", cwd=tmp_path)
    assert "--allowed-origins 'tools.example.com/app': an origin is scheme://host[:port]" in refusal
