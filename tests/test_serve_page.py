"""The chat page in a real headless browser (Debian's chromium and chromium-driver, driven by selenium): it types a
message and sees the reply stream in, in chat mode and, for a model without a chat template, plain completion.
CI installs the browser (.ci/run); there a missing browser fails the test instead of skipping it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.serving import Served, slow_steps

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# offline and quiet: without the background-networking flags Chromium tries to reach Google's services
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-dev-shm-usage",
    "--window-size=1000,800",
)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def served():
    s = Served(max_batch=4)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        message = "the page test needs chromium and chromedriver: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    yield driver
    driver.quit()


def ask(browser, served, text: str, mode: str) -> tuple[str, set[str]]:
    """Open the page, type `text` with temperature 0, send it; the reply and every partial reply seen on the way."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(served.url + "/")
    WebDriverWait(browser, 10).until(lambda d: mode in d.find_element(By.ID, "model").text)
    for field, value in (("temperature", "0"), ("max_tokens", str(MAX_TOKENS))):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    partial, deadline = set(), time.monotonic() + 20
    while time.monotonic() < deadline:
        finished = browser.find_element(By.ID, "send").is_enabled()  # before the text, which may still grow
        replies = browser.find_elements(By.CSS_SELECTOR, ".assistant .text")
        reply = replies[-1].get_property("textContent") if replies else ""
        partial.add(reply)
        if reply and finished:
            return reply, partial - {"", reply}
        time.sleep(0.01)
    raise AssertionError(f"no whole reply within 20 s; the page shows {browser.find_element(By.ID, 'log').text!r}")


def test_the_page_streams_a_chat_reply(browser, served, monkeypatch, tmp_path):
    slow_steps(monkeypatch, served.engine, 0.02)  # 40 tokens in about a second, so the partial replies can be seen
    reply, partial = ask(browser, served, "Hello there", "(chat)")
    rendered = served.tokenizer.render([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert reply == served.greedy(rendered, MAX_TOKENS)
    assert len(partial) >= 2 and all(reply.startswith(p) for p in partial)  # it grew piece by piece
    assert browser.save_screenshot(str(tmp_path / "chat.png"))


def test_without_a_chat_template_the_page_completes_text(browser, served, monkeypatch, tmp_path):
    monkeypatch.setattr(served.tokenizer, "chat_template", None)
    slow_steps(monkeypatch, served.engine, 0.02)
    reply, partial = ask(browser, served, "ROMEO:", "plain completion")
    assert reply == served.greedy("ROMEO:", MAX_TOKENS) and len(partial) >= 2
    assert browser.save_screenshot(str(tmp_path / "completion.png"))
