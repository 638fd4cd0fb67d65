"""The chat page in a real headless Chromium (Debian's, from scripts/install_browser.sh), driven by selenium.

Nothing is downloaded at run time: the driver and the browser are named by
path, so selenium-manager has nothing to look for.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = [
    "--headless=new",
    "--no-sandbox",  # root in a container has no user namespaces for the sandbox
    "--disable-gpu",
    "--disable-dev-shm-usage",  # a container's /dev/shm is small
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1200,820",
]

# Wraps fetch so that a test can read the bodies the page sent (the conversation, the sampling fields).
RECORD_REQUESTS = """
window.sentBodies = [];
const originalFetch = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body) window.sentBodies.push(JSON.parse(options.body));
  return originalFetch(url, options);
};
"""

# Records every text an answer is rendered with, as the page renders it: polling through the driver
# takes several round trips a look, and on a busy machine missed most of a short answer's renders.
RECORD_RENDERS = """
window.shownTexts = [];
new MutationObserver((records) => {
  for (const record of records) {
    if (record.target.closest(".message.assistant")) window.shownTexts.push(record.target.dataset.source);
  }
}).observe(document.getElementById("conversation"), {
  subtree: true, attributes: true, attributeFilter: ["data-source"],
});
"""


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} missing: run scripts/install_browser.sh (make test does)")
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options = Options()
        options.binary_location = str(CHROMIUM)
        for flag in [*FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def wait_until(condition: Callable[[], Any], timeout: float, message: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s: {message}")


class ChatPage:
    """What a person sees and does on the page, by element ids and classes of index.html and chat.js."""

    def __init__(self, driver: webdriver.Chrome, base_url: str):
        self.driver = driver
        self.base_url = base_url

    def open(self) -> None:
        self.driver.get(f"{self.base_url}/")
        self.wait_loaded()

    def reload(self) -> None:
        self.driver.refresh()
        self.wait_loaded()

    def wait_loaded(self) -> None:
        wait_until(lambda: "loading" not in self.model_label(), 30, "the model name never loaded")
        self.driver.execute_script(RECORD_REQUESTS + RECORD_RENDERS)

    def element(self, element_id: str) -> WebElement:
        return self.driver.find_element(By.ID, element_id)

    def model_label(self) -> str:
        return self.element("model").text

    def set_field(self, element_id: str, value: object) -> None:
        field = self.element(element_id)
        field.clear()
        field.send_keys(str(value))

    def set_token(self, value: str) -> None:
        self.set_field("token", value)
        self.element("token").send_keys(Keys.TAB)  # leaving the field fires change: the model name reloads

    def send(self, prompt: str) -> None:
        self.set_field("prompt", prompt)
        self.click_send()

    def prompt(self) -> str:
        """What the message box holds."""
        return self.element("prompt").get_attribute("value")

    def click_send(self) -> None:
        # A new last answer, not one more: a failed exchange before it leaves the page at the send.
        before = self.answers()[-1:]
        self.element("send").click()
        wait_until(lambda: self.answers()[-1:] not in ([], before), 10, "no answer appeared")

    def messages(self) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, "#conversation .message")

    def answers(self) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, "#conversation .message.assistant")

    @staticmethod
    def source(message: WebElement) -> str:
        """A message's text as written: an answer shows it rendered as Markdown."""
        return message.find_element(By.CLASS_NAME, "text").get_attribute("data-source")

    def answer_text(self) -> str:
        return self.source(self.answers()[-1])

    def answer_thoughts(self) -> tuple[str, bool] | None:
        """The last answer's thoughts as shown, and whether their fold is open (None: it has none)."""
        folds = self.answers()[-1].find_elements(By.CLASS_NAME, "thoughts")
        if not folds:
            return None
        text = self.driver.execute_script(
            "return arguments[0].querySelector('.thinking').textContent", folds[0]
        )
        return text, folds[0].get_attribute("open") is not None

    def answer_done(self) -> bool:
        return "streaming" not in self.answers()[-1].get_attribute("class")

    def wait_answer_done(self, timeout: float = 120) -> None:
        wait_until(self.answer_done, timeout, "the answer never ended", interval=0.1)

    def answer_stats(self) -> str:
        stats = self.answers()[-1].find_elements(By.CLASS_NAME, "stats")
        return stats[0].text if stats else ""

    def in_view(self, element: WebElement) -> bool:
        """Whether the element lies wholly inside the conversation's visible part (it scrolls)."""
        return self.driver.execute_script(
            """const inner = arguments[0].getBoundingClientRect();
            const outer = document.getElementById("conversation").getBoundingClientRect();
            return inner.height > 0 && inner.top >= outer.top - 1 && inner.bottom <= outer.bottom + 1;""",
            element,
        )

    def stored_conversation(self) -> list[dict] | None:
        stored = self.driver.execute_script("return localStorage.getItem('inference-server.conversation')")
        return None if stored is None else json.loads(stored)["turns"]

    def answer_error(self) -> str:
        errors = self.answers()[-1].find_elements(By.CLASS_NAME, "error")
        return errors[0].text if errors else ""

    def shown_texts(self) -> list[str]:
        """Every text an answer was rendered with since the page loaded, in order."""
        return self.driver.execute_script("return window.shownTexts")

    def sent_bodies(self) -> list[dict]:
        return self.driver.execute_script("return window.sentBodies")
