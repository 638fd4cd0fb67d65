"""Answers render as Markdown as they stream (issue 19, item 10), and HTML in the model's output
stays inert: shown as text or dropped, never run, never fetching anything.

The mock backend writes fixed words, so these answers come from a stand-in for the server's
/v1/chat/completions, inside the page: the same SSE chunks, held back until the test lets them go.
"""

from __future__ import annotations

from selenium import webdriver
from selenium.webdriver.common.by import By

from tests.browser.chat_page import ChatPage, wait_until
from tests.server_fixture import RunningServer

# fetch for /v1/chat/completions answers arguments[0]'s pieces at once, and arguments[1]'s
# when the test calls window.releaseAnswer(); everything else goes to the server.
STAND_IN_SERVER = """
const [first, rest] = arguments;
const serverFetch = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).endsWith("/v1/chat/completions")) return serverFetch(url, options);
  const encoder = new TextEncoder();
  const event = (data) => encoder.encode(`data: ${JSON.stringify(data)}\\n\\n`);
  const delta = (content) => event({ choices: [{ index: 0, delta: { content }, finish_reason: null }] });
  const body = new ReadableStream({
    start(stream) {
      first.forEach((piece) => stream.enqueue(delta(piece)));
      window.releaseAnswer = () => {
        rest.forEach((piece) => stream.enqueue(delta(piece)));
        const usage = { prompt_tokens: 5, completion_tokens: first.length + rest.length, total_tokens: 0 };
        stream.enqueue(event({ choices: [], usage }));
        stream.enqueue(encoder.encode("data: [DONE]\\n\\n"));
        stream.close();
      };
    },
  });
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""

INJECTIONS = [
    "<img src=x onerror=\"window.injected = 'img'\">\n",
    "<script>window.injected = 'script'</script>\n\n",
    "A raw <a href=\"javascript:window.injected = 'a'\">link</a>, ",
    "[a Markdown one](javascript:window.injected='md'), ",
    "[a good one](https://example.org/) and ![a picture](https://example.org/x.png).\n",
]

# Elements or attributes that could run code or fetch something, anywhere in the conversation.
LIVE_MARKUP = """
const all = [...document.querySelectorAll("#conversation *")];
return all
  .filter((e) => ["SCRIPT", "IMG", "IFRAME", "OBJECT", "EMBED", "STYLE"].includes(e.tagName)
    || [...e.attributes].some((a) => a.name.startsWith("on") || /^\\s*javascript:/i.test(a.value)))
  .map((e) => e.outerHTML);
"""


def test_an_answer_renders_as_markdown_while_it_streams_and_its_html_stays_inert(
    browser: webdriver.Chrome, mock_server: RunningServer
) -> None:
    page = ChatPage(browser, mock_server.url)
    page.open()
    first = ["Here is **the** code:\n\n", "```python\nprint('<b>hi</b>')\n"]  # a code block still open
    rest = ["```\n\nAnd lists:\n\n- one\n", "- two `inline`\n\n3. three\n4. four\n\n", *INJECTIONS]
    browser.execute_script(STAND_IN_SERVER, first, rest)
    page.send("show me")

    answer = page.answers()[-1]
    code = wait_until(lambda: answer.find_elements(By.CSS_SELECTOR, ".text pre code"), 10, "no code block")[0]
    assert not page.answer_done(), "the answer should still be streaming"
    assert code.get_attribute("textContent") == "print('<b>hi</b>')\n"
    assert answer.find_element(By.CSS_SELECTOR, ".text strong").text == "the"

    browser.execute_script("window.releaseAnswer()")
    page.wait_answer_done(10)
    assert not page.answer_error()
    check_rendered(page, browser)
    assert page.answer_text() == "".join(first + rest), "the text as written is what the conversation keeps"

    page.reload()  # the stored conversation renders the same way
    check_rendered(page, browser)


def check_rendered(page: ChatPage, browser: webdriver.Chrome) -> None:
    answer = page.answers()[-1]
    assert [pre.get_attribute("textContent") for pre in answer.find_elements(By.TAG_NAME, "pre")] == [
        "print('<b>hi</b>')\n"
    ]
    items = answer.find_elements(By.CSS_SELECTOR, ".text ul > li")
    assert [item.text for item in items] == ["one", "two inline"]
    assert items[1].find_element(By.TAG_NAME, "code").text == "inline"
    numbered = answer.find_element(By.CSS_SELECTOR, ".text ol")
    assert numbered.get_attribute("start") == "3"
    assert [item.text for item in numbered.find_elements(By.TAG_NAME, "li")] == ["three", "four"]

    assert browser.execute_script(LIVE_MARKUP) == []
    assert browser.execute_script("return window.injected") is None
    text = answer.find_element(By.CLASS_NAME, "text").text
    # Raw HTML reads as the text it is.
    assert "<img src=x onerror=\"window.injected = 'img'\">" in text
    assert "<script>window.injected = 'script'</script>" in text
    assert "<a href=\"javascript:window.injected = 'a'\">link</a>" in text
    links = {link.text: link.get_attribute("href") for link in answer.find_elements(By.TAG_NAME, "a")}
    assert links == {"a Markdown one": None, "a good one": "https://example.org/"}
    good = answer.find_element(By.LINK_TEXT, "a good one")
    assert (good.get_attribute("target"), good.get_attribute("rel")) == ("_blank", "noopener noreferrer")
    assert "a picture" in text  # an image's alt text stands in for it
