"""The chat page in a real headless browser (Debian's chromium and chromium-driver, driven by selenium): it types a
message and sees the reply stream in, in chat mode and, for a model without a chat template, plain completion;
on a model of 64 tokens of context a first message and a second turn are answered with the page's defaults; the
controls keep to one line; a server with a key gets it asked once. CI installs the browser (.ci/run); there a
missing browser fails the test instead of skipping it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gptlite.serve.guard import Policy
from tests.helpers.serving import Served, slow_steps

pytestmark = pytest.mark.slow  # a real browser: left out by -m 'not slow'

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


def open_page(browser, served, mode: str) -> None:
    """Load the page and wait until it has the model's card (`mode` is a phrase of the header)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(served.url + "/")
    WebDriverWait(browser, 10).until(lambda d: mode in d.find_element(By.ID, "model").text)


def ask(browser, text: str, max_tokens: int | None = MAX_TOKENS) -> tuple[str, set[str]]:
    """On the open page, type `text` with temperature 0 (and max_tokens, unless None: the page's default), send it;
    the reply and every partial reply seen on the way."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    settings = {"temperature": "0"} | ({} if max_tokens is None else {"max_tokens": str(max_tokens)})
    for field, value in settings.items():
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    before = len(browser.find_elements(By.CSS_SELECTOR, ".assistant .text, .error .text"))
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    partial, deadline = set(), time.monotonic() + 20
    while time.monotonic() < deadline:
        finished = browser.find_element(By.ID, "send").is_enabled()  # before the text, which may still grow
        replies = browser.find_elements(By.CSS_SELECTOR, ".assistant .text, .error .text")
        reply = replies[-1].get_property("textContent") if len(replies) > before else ""
        partial.add(reply)
        if reply and finished:
            return reply, partial - {"", reply}
        time.sleep(0.01)
    raise AssertionError(f"no whole reply within 20 s; the page shows {browser.find_element(By.ID, 'log').text!r}")


def on_one_line(browser) -> bool:
    """Whether the Clear button sits on the line of the fields beside it (it wrapped below them once)."""
    from selenium.webdriver.common.by import By

    clear = browser.find_element(By.ID, "clear").rect
    for field in ("temperature", "max_tokens"):
        box = browser.find_element(By.ID, field).rect
        if not (clear["y"] < box["y"] + box["height"] and box["y"] < clear["y"] + clear["height"]):
            return False
    return True


def test_the_page_streams_a_chat_reply(browser, served, monkeypatch, tmp_path):
    slow_steps(monkeypatch, served.engine, 0.02)  # 40 tokens in about a second, so the partial replies can be seen
    open_page(browser, served, "(chat)")
    assert on_one_line(browser)
    reply, partial = ask(browser, "Hello there")
    rendered = served.tokenizer.render([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert reply == served.greedy(rendered, MAX_TOKENS)
    assert len(partial) >= 2 and all(reply.startswith(p) for p in partial)  # it grew piece by piece
    assert browser.save_screenshot(str(tmp_path / "chat.png"))


def test_without_a_chat_template_the_page_completes_text(browser, served, monkeypatch, tmp_path):
    monkeypatch.setattr(served.tokenizer, "chat_template", None)
    slow_steps(monkeypatch, served.engine, 0.02)
    open_page(browser, served, "plain completion")
    assert on_one_line(browser)  # the longer header once pushed Clear to a second line
    reply, partial = ask(browser, "ROMEO:")
    assert reply == served.greedy("ROMEO:", MAX_TOKENS) and len(partial) >= 2
    assert browser.save_screenshot(str(tmp_path / "completion.png"))


def test_a_64_token_model_answers_a_first_message_and_a_second_turn(browser, tmp_path):
    """With the page's own max tokens, each reply gets what the context leaves after its prompt (where 200 tokens
    asked once got a 400), and a second turn that no longer fits with the first leaves the first out."""
    from selenium.webdriver.common.by import By

    small = Served(max_batch=2, block_size=64)
    try:
        open_page(browser, small, "context 64 tokens")
        first, _ = ask(browser, "Hello there", max_tokens=None)
        prompt = small.tokenizer.render([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
        assert first == small.greedy(prompt, 64 - len(prompt))
        second, _ = ask(browser, "And then?", max_tokens=None)
        prompt = small.tokenizer.render([{"role": "user", "content": "And then?"}], add_generation_prompt=True)
        assert second == small.greedy(prompt, 64 - len(prompt))
        assert "the oldest turn was left out" in browser.find_element(By.ID, "log").text
        small.tokenizer.chat_template = None  # plain completion: each message a prompt of its own
        open_page(browser, small, "plain completion")
        assert ask(browser, "ROMEO:", max_tokens=None)[0] == small.greedy("ROMEO:", 58)
        assert ask(browser, "JULIET:", max_tokens=None)[0] == small.greedy("JULIET:", 57)
        assert browser.save_screenshot(str(tmp_path / "small.png"))
    finally:
        small.close()


def test_a_server_with_a_key_has_it_asked_once(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    keyed = Served(max_batch=2, policy=Policy(api_key="page-key"))
    try:
        open_page(browser, keyed, "needs an API key")
        browser.find_element(By.ID, "key").send_keys("wrong")
        browser.find_element(By.ID, "use-key").click()
        WebDriverWait(browser, 10).until(lambda d: "not this server's" in d.find_element(By.ID, "key-status").text)
        browser.find_element(By.ID, "key").clear()
        browser.find_element(By.ID, "key").send_keys("page-key")
        browser.find_element(By.ID, "use-key").click()
        WebDriverWait(browser, 10).until(lambda d: "(chat)" in d.find_element(By.ID, "model").text)
        assert not browser.find_element(By.ID, "key-form").is_displayed()
        assert ask(browser, "Hi")[0]
        open_page(browser, keyed, "(chat)")  # again in this tab: the key is kept, not asked for
        assert not browser.find_element(By.ID, "key-form").is_displayed()
    finally:
        keyed.close()
