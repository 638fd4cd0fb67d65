"""The chat page's conversation around its answers (issue 19, item 10): a failed message given back
for another try, "New chat", the conversation kept across a reload, and the last answer's
statistics in view after it ends or is stopped. On the mock, whose answers are quick and long.
"""

from __future__ import annotations

from selenium import webdriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from tests.browser.chat_page import ChatPage, wait_until
from tests.server_fixture import RunningServer

CONVERSATION_KEY = "inference-server.conversation"


def shown(page: ChatPage) -> list[tuple[str, str]]:
    """The conversation on the page: each message's role and text as written."""
    return [(message.get_attribute("class").split()[1], page.source(message)) for message in page.messages()]


def answer_stats(page: ChatPage) -> list[str]:
    return [answer.find_element(By.CLASS_NAME, "stats").text for answer in page.answers()]


def fail_with_a_400(page: ChatPage, prompt: str) -> None:
    page.set_field("temperature", 5)  # out of the OpenAI API's range: a 400 before any token
    page.send(prompt)
    page.wait_answer_done(10)
    assert page.answer_error().startswith("400 Bad request: temperature"), page.answer_error()
    wait_until(lambda: page.prompt() == prompt, 5, "the prompt was not given back")
    page.set_field("temperature", 0.7)


def test_a_failed_message_comes_back_whole_to_be_sent_again_or_replaced(
    browser: webdriver.Chrome, mock_server: RunningServer
) -> None:
    page = ChatPage(browser, mock_server.url)
    page.open()
    page.set_field("max_tokens", 5)
    page.send("first question")
    page.wait_answer_done(10)
    first_answer = page.answer_text()

    # Sent again as it was given back: it is in the conversation once, and sent once.
    fail_with_a_400(page, "second question")
    page.click_send()
    page.wait_answer_done(10)
    assert not page.answer_error()
    second_answer = page.answer_text()
    assert shown(page) == [
        ("user", "first question"),
        ("assistant", first_answer),
        ("user", "second question"),
        ("assistant", second_answer),
    ]
    assert page.sent_bodies()[-1]["messages"] == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "second question"},
    ]

    # The prompt given back has the focus and is selected whole: what is typed next replaces it.
    page.set_field("temperature", 5)
    page.send("third question")
    page.wait_answer_done(10)
    wait_until(lambda: page.prompt() == "third question", 5, "the prompt was not given back")
    assert browser.switch_to.active_element == page.element("prompt")
    ActionChains(browser).send_keys("fourth question").perform()  # keys to the focused element, as typed
    assert page.prompt() == "fourth question"
    page.set_field("temperature", 0.7)
    page.click_send()
    page.wait_answer_done(10)
    assert not page.answer_error()
    assert [text for role, text in shown(page) if role == "user"] == [
        "first question",
        "second question",
        "fourth question",
    ]
    assert [turn["content"] for turn in page.sent_bodies()[-1]["messages"]][-1] == "fourth question"
    assert [turn["content"] for turn in page.stored_conversation()] == [text for _, text in shown(page)]


def test_new_chat_clears_the_conversation_the_box_the_error_and_what_is_stored(
    browser: webdriver.Chrome, mock_server: RunningServer
) -> None:
    page = ChatPage(browser, mock_server.url)
    page.open()
    page.set_field("max_tokens", 5)
    page.send("hello")
    page.wait_answer_done(10)
    fail_with_a_400(page, "this one fails")
    assert page.stored_conversation()

    page.element("clear").click()
    assert page.messages() == []
    assert page.prompt() == ""
    assert page.stored_conversation() is None
    page.reload()
    assert page.messages() == [], "the conversation came back after a reload"

    # In the middle of an answer: it is stopped, and nothing of it comes back into the new chat.
    page.set_field("max_tokens", 2000)  # 10 s at the mock's 200 tokens a second
    page.send("a long answer")
    wait_until(lambda: len(page.answer_text()) > 50, 10, "no text came")
    page.element("clear").click()
    assert page.messages() == []
    assert page.element("send").is_enabled() and not page.element("stop").is_enabled()
    page.set_field("max_tokens", 5)
    page.send("a new start")
    page.wait_answer_done(10)
    assert page.sent_bodies()[-1]["messages"] == [{"role": "user", "content": "a new start"}]
    assert [role for role, _ in shown(page)] == ["user", "assistant"]
    assert [turn["content"] for turn in page.stored_conversation()] == ["a new start", page.answer_text()]


def test_the_conversation_is_kept_across_a_reload_and_goes_on(
    browser: webdriver.Chrome, mock_server: RunningServer
) -> None:
    page = ChatPage(browser, mock_server.url)
    page.open()
    page.set_field("max_tokens", 5)
    for prompt in ("one", "two"):
        page.send(prompt)
        page.wait_answer_done(10)
    before = shown(page)
    stats = answer_stats(page)
    assert len(stats) == 2 and all(stats), stats

    page.reload()
    assert shown(page) == before
    assert answer_stats(page) == stats
    page.set_field("max_tokens", 5)  # the controls are not kept: only the conversation is
    page.send("three")
    page.wait_answer_done(10)
    assert page.sent_bodies()[-1]["messages"] == [
        *({"role": role, "content": text} for role, text in before),
        {"role": "user", "content": "three"},
    ]
    # The conversation is the only thing in localStorage: the token stays in sessionStorage.
    assert browser.execute_script("return Object.keys(localStorage)") == [CONVERSATION_KEY]


def test_the_last_answers_statistics_are_in_view_when_it_is_stopped_and_when_it_ends(
    browser: webdriver.Chrome, mock_server: RunningServer
) -> None:
    page = ChatPage(browser, mock_server.url)
    page.open()
    # 3,500 tokens, 17 s at the mock's pace: Stop comes long before the end even where a loaded
    # machine's browser renders slowly (at 2,000 a CI run's answer ended before the click).
    page.set_field("max_tokens", 3500)
    page.send("a long answer, stopped")
    wait_until(lambda: overflows(page), 20, "not enough text came to scroll")
    page.element("stop").click()
    wait_until(page.answer_done, 10, "Stop did not end the answer")
    stats = page.answers()[-1].find_element(By.CLASS_NAME, "stats")
    assert stats.text.endswith("stopped")
    wait_until(lambda: page.in_view(stats), 5, f"the statistics are out of view after Stop: {stats.text}")

    page.element("clear").click()  # the mock's context is 4,096 tokens: room for one such answer
    page.set_field("max_tokens", 600)  # 3 s
    page.send("a long answer to its end")
    page.wait_answer_done(20)
    assert overflows(page)
    stats = page.answers()[-1].find_element(By.CLASS_NAME, "stats")
    wait_until(lambda: page.in_view(stats), 5, f"the statistics are out of view: {stats.text}")


def overflows(page: ChatPage) -> bool:
    """Whether the conversation is longer than its window: it scrolls."""
    script = "const c = document.getElementById('conversation'); return c.scrollHeight > c.clientHeight + 100"
    return page.driver.execute_script(script)
