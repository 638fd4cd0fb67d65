"""The chat page (SPEC §4.4) in a real headless Chromium: text that streams in, a conversation that is
kept, a Stop button that frees the server's row, readable errors, and the page through the proxy.

Most run on the default model (marked real_model), as a person would use the page; the error cases
that need a full server use the mock. CHAT_SCREENSHOT=docs/chat.png saves the conversation's picture.
"""

from __future__ import annotations

import os
import re

import pytest
import requests
from selenium import webdriver

from tests.browser.chat_page import ChatPage, wait_until
from tests.proxy.conftest import RunningProxy, token
from tests.server_fixture import RunningServer

MODEL = "SmolLM2-135M-Instruct"
STATS = re.compile(r"first token \d+ ms · \d+ tokens · [\d.]+ tokens/s")


@pytest.mark.real_model
def test_an_answer_streams_in_and_the_conversation_is_kept(
    browser: webdriver.Chrome, real_server: RunningServer
) -> None:
    page = ChatPage(browser, real_server.url)
    page.open()
    assert page.model_label() == MODEL
    page.set_field("temperature", 0)
    page.set_field("max_tokens", 80)
    page.send("Describe Paris in three sentences.")
    page.wait_answer_done()
    texts = page.shown_texts()
    seen = [text for i, text in enumerate(texts) if text and (i == 0 or text != texts[i - 1])]
    # Twenty tokens and more, each sent on its own: the text must be seen growing, not arrive whole.
    assert len(seen) >= 5, f"the text did not arrive in pieces: {seen}"
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:], strict=False))
    first_answer = page.answer_text()
    assert seen[-1] == first_answer
    assert "Paris" in first_answer
    assert STATS.fullmatch(page.answer_stats()), page.answer_stats()

    page.send("And Rome, in one sentence?")
    page.wait_answer_done()
    assert page.answer_text() and not page.answer_error()
    assert STATS.fullmatch(page.answer_stats())
    second = page.sent_bodies()[-1]
    assert second["messages"] == [
        {"role": "user", "content": "Describe Paris in three sentences."},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "And Rome, in one sentence?"},
    ]
    fields = ("model", "temperature", "top_p", "top_k", "max_tokens", "stream")
    assert {key: second[key] for key in fields} == {
        "model": MODEL,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "max_tokens": 80,
        "stream": True,
    }
    if os.environ.get("CHAT_SCREENSHOT"):
        browser.save_screenshot(os.environ["CHAT_SCREENSHOT"])


@pytest.mark.real_model
def test_stop_ends_the_answer_and_the_server_frees_the_row(
    browser: webdriver.Chrome, real_server: RunningServer
) -> None:
    page = ChatPage(browser, real_server.url)
    page.open()
    page.set_field("temperature", 0)
    # Greedy, the default model writes the numbers until max_tokens stops it: 1,500 tokens, seconds on the
    # fastest CPU here, still running at Stop. ("Count from 1 to 1000, separated by commas." ends at 20,
    # 122 tokens, done in half a second on an AVX-512 EPYC: sometimes before Stop.)
    page.set_field("max_tokens", 1500)
    page.send("Write the numbers from 1 to 1000, one per line.")
    wait_until(lambda: len(page.answer_text()) > 20, 60, "no text came")
    assert real_server.metric("inference_active_rows") == 1
    page.element("stop").click()
    wait_until(page.answer_done, 10, "Stop did not end the answer")
    assert page.answer_stats().endswith("stopped")
    assert page.element("send").is_enabled() and not page.element("stop").is_enabled()
    stopped_text = page.answer_text()
    # The cancel reaches the backend within a few steps of Stop. A row left running would go on to
    # max_tokens: 1,500 more tokens, 25 s and more at this server's one-row step of 16 to 35 ms.
    wait_until(lambda: real_server.metric("inference_active_rows") == 0, 5, "the row was not freed")
    # The row ran on for those steps after Stop: a page still reading the stream would show their text.
    assert page.answer_text() == stopped_text, "text came after Stop"


@pytest.mark.real_model
def test_through_the_proxy_the_page_asks_for_a_token_and_a_bad_one_reads_as_a_401(
    browser: webdriver.Chrome, real_proxy: RunningProxy
) -> None:
    page = ChatPage(browser, real_proxy.url)
    page.open()  # the page and its files came through the proxy without a token
    # No token yet is a question, not an error: no red 401, the Token field ready for one.
    assert page.model_label() == "Paste your token in the Token field (make token TEAM=... prints one)."
    assert "error" not in page.element("model").get_attribute("class")
    assert browser.switch_to.active_element.get_attribute("id") == "token"

    page.set_token("garbage")
    wait_until(lambda: "malformed" in page.model_label(), 10, "the model name was not asked for again")
    hint = "Set a valid token in the Token field."
    assert page.model_label() == f"401 Unauthorized: the token is malformed\n{hint}"
    page.send("Hello!")
    page.wait_answer_done(10)
    assert page.answer_error().startswith("401 Unauthorized: the token is malformed")
    assert page.element("prompt").get_attribute("value") == "Hello!", "the prompt was not given back"

    good = token(team_id="browser-team")
    page.set_token(good)
    wait_until(lambda: page.model_label() == MODEL, 10, "a valid token did not load the model name")
    assert browser.execute_script("return sessionStorage.getItem('inference-server.token')") == good
    page.set_field("max_tokens", 8)
    page.send("Hello!")
    page.wait_answer_done()
    assert page.answer_text() and not page.answer_error()
    assert page.sent_bodies()[-1]["messages"] == [{"role": "user", "content": "Hello!"}]
    assert "team=browser-team" in real_proxy.log() and good not in real_proxy.log()


def test_a_value_out_of_range_reads_as_a_400(browser: webdriver.Chrome, busy_server: RunningServer) -> None:
    page = ChatPage(browser, busy_server.url)
    page.open()
    page.set_field("temperature", 5)
    page.send("hello")
    page.wait_answer_done(10)
    assert page.answer_error() == "400 Bad request: temperature must be a number from 0 to 2, got 5"


def test_a_full_server_reads_as_a_503(browser: webdriver.Chrome, busy_server: RunningServer) -> None:
    page = ChatPage(browser, busy_server.url)
    page.open()
    body = {"text": "hold the one row", "max_tokens": 200}
    with requests.post(f"{busy_server.url}/predictions/mock", json=body, stream=True, timeout=30) as hold:
        chunks = hold.iter_content(chunk_size=None)  # kept: a dropped generator closes the connection
        next(chunks)
        page.send("hello")
        page.wait_answer_done(10)
    error = page.answer_error()
    assert error.startswith("503 Service unavailable: the server is busy"), error
    assert error.endswith("Try again in 1 s.")
