"""A web page at another origin calls the API through the proxy from a real Chromium, with a team's token
(--allowed-origins, proxy/cors.py): the browser sends its preflight without the token, then the call,
and lets the page read the streamed answer; a page at an origin not allowed gets nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from tests.proxy.conftest import RunningProxy, running_proxy, token
from tests.server_fixture import RunningServer, free_port

FETCH = """
const [url, bearer, done] = arguments;
const body = {model: "mock", stream: true, max_tokens: 4, messages: [{role: "user", content: "hi"}]};
fetch(url + "/v1/chat/completions", {
  method: "POST",
  headers: {Authorization: "Bearer " + bearer, "Content-Type": "application/json", "x-stainless-os": "Linux"},
  body: JSON.stringify(body),
}).then(async (answer) => {
  done({status: answer.status, text: await answer.text(), id: answer.headers.get("X-Request-ID")});
}).catch((error) => done({error: error.name + ": " + error.message}));
"""


class PageServer:
    """A blank page at an origin of its own (a port of its own on 127.0.0.1)."""

    def __init__(self):
        self.server = make_server("127.0.0.1", free_port(), self.app, threaded=True)
        self.origin = f"http://127.0.0.1:{self.server.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @Request.application
    def app(self, request: Request) -> Response:
        return Response("<!doctype html><title>a team's tool</title><p>tool</p>", content_type="text/html")


@pytest.fixture(scope="module")
def pages() -> Iterator[tuple[PageServer, PageServer]]:
    allowed, other = PageServer(), PageServer()
    yield allowed, other
    allowed.server.shutdown()
    other.server.shutdown()


@pytest.fixture(scope="module")
def cors_proxy(mock_server: RunningServer, pages) -> Iterator[RunningProxy]:
    allowed, _ = pages
    with running_proxy(mock_server.url, args=("--allowed-origins", allowed.origin)) as proxy:
        yield proxy


def call_from_page(browser, page: PageServer, proxy: RunningProxy) -> dict:
    browser.get(page.origin)
    browser.set_script_timeout(30)
    return browser.execute_async_script(FETCH, proxy.url, token())


def test_a_page_of_an_allowed_origin_reads_the_streamed_answer(browser, pages, cors_proxy):
    allowed, _ = pages
    answer = call_from_page(browser, allowed, cors_proxy)
    assert answer.get("status") == 200, answer
    assert "data: [DONE]" in answer["text"] and '"delta"' in answer["text"]
    assert answer["id"]  # an exposed header the page may read


def test_a_page_of_another_origin_gets_nothing(browser, pages, cors_proxy):
    _, other = pages
    answer = call_from_page(browser, other, cors_proxy)
    assert answer == {"error": "TypeError: Failed to fetch"}
