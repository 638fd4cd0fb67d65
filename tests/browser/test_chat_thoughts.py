"""A reasoning model's thoughts on the chat page: streamed into a fold above the answer, open while the
model thinks and folded away when the answer begins, kept with the conversation, and not sent back with
the next message (the API's `reasoning_content`; tests/reasoning_server.py's server, whose greedy
answers are all thoughts unless a `guided_regex` ends them)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import requests
from selenium import webdriver

from tests.browser.chat_page import ChatPage
from tests.reasoning_server import reasoning_server
from tests.server_fixture import RunningServer

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with reasoning_server(tmp_path_factory.mktemp("template")) as server:
        yield server


def test_the_thoughts_stream_into_a_fold_and_stay_with_the_conversation(
    browser: webdriver.Chrome, thinking_server: RunningServer
) -> None:
    page = ChatPage(browser, thinking_server.url)
    page.open()
    page.set_field("temperature", 0)
    page.set_field("max_tokens", 12)
    page.send("Hi! Who are you?")
    page.wait_answer_done()
    body = {key: value for key, value in page.sent_bodies()[-1].items() if key != "stream_options"}
    alone = requests.post(
        f"{thinking_server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=60
    )
    thoughts = alone.json()["choices"][0]["message"]["reasoning_content"]
    assert page.answer_thoughts() == (thoughts, True)  # all thoughts: the fold stays open
    assert page.answer_text() == ""
    [question, answer] = page.stored_conversation()
    assert (answer["content"], answer["thoughts"]) == ("", thoughts)

    page.reload()
    assert page.answer_thoughts() == (thoughts, False)  # kept, folded away
    page.send("Go on.")
    page.wait_answer_done()
    assert page.sent_bodies()[-1]["messages"][:2] == [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": ""},
    ]


# The page sends no guided_regex: this wraps its fetch to add one, so that the thoughts end and an
# answer follows (the page's own code is what runs; only the request's body grows by a field).
FORCE_TEXT = """
const regex = arguments[0];
const pageFetch = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body && url.endsWith("/chat/completions")) {
    options = { ...options, body: JSON.stringify({ ...JSON.parse(options.body), guided_regex: regex }) };
  }
  return pageFetch(url, options);
};
"""


def test_the_fold_closes_when_the_answer_begins(
    browser: webdriver.Chrome, thinking_server: RunningServer
) -> None:
    page = ChatPage(browser, thinking_server.url)
    page.open()
    browser.execute_script(FORCE_TEXT, re.escape("I should greet.\n</think>\n\nHello!"))
    page.set_field("temperature", 0)
    page.set_field("max_tokens", 40)
    page.send("Hi!")
    page.wait_answer_done()
    assert page.answer_thoughts() == ("I should greet.", False)
    assert page.answer_text() == "Hello!"
