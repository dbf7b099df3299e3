"""The chat page at `/` in a real browser: Debian's chromium, driven by selenium, over a live server and
the real engine on a HashLM model (whose replies `Rule.reply` knows in advance).

Skipped when chromium, its driver or selenium is missing, except under CI (`CI` set), where that fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from test_server_harness import LiveServer, user

from engine.hashlm import Rule

KEY = "page-test-key"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1000,800"]
WAIT_S = 15


def browser_missing() -> str | None:
    """Why the browser cannot run here, or None."""
    if importlib.util.find_spec("selenium") is None:
        return "the selenium package is not installed (pip install -e '.[test]')"
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = browser_missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: CI must run the chat page test in a real browser")
        pytest.skip(reason)
    request.getfixturevalue("servers")  # they start while the browser does
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")  # type: ignore[assignment]
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


RELEASE = "release-engine"  # the file the slow server's held engine waits for before loading
THOUGHT = "Plan a short greeting."
ANSWER = "Hello there! This reply streams slowly, so that the stop button can cut it short."


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    """Both servers start at once, while the browser starts: `slow` (no key, a reasoning reply at 25
    tokens a second, its engine held until the first test has met it loading: `release`) and `keyed`
    (API key, HashLM's hash rule: each reply depends on the whole conversation)."""
    work = tmp_path_factory.mktemp("chat-slow")
    slow = LiveServer(work, switches={"hold_until": str(work / RELEASE), "tok_s": 25},
                      rule=Rule(text=f"<think>{THOUGHT}</think>{ANSWER}"), wait=False)
    keyed = LiveServer(tmp_path_factory.mktemp("chat-keyed"), config={"api_key": KEY}, wait=False)
    yield slow, keyed
    with ThreadPoolExecutor() as pool:  # each stop waits for its engine to quit
        list(pool.map(LiveServer.stop, (slow, keyed)))


def wait_for(driver: Any, what: Callable[[], Any], message: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(lambda _: what(), message)


class Page:
    """The chat page's fields and messages, as a user sees them."""

    def __init__(self, driver: Any, url: str):
        self.driver = driver
        driver.get(url)
        wait_for(driver, lambda: self.status() not in ("", "…"), "the page never read /health")

    def el(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def text_of(self, css: str) -> str:
        return self.el(css).get_attribute("textContent")

    def status(self) -> str:
        return self.text_of("#status")

    def error(self) -> str:
        box = self.el("#error")
        return "" if box.get_attribute("hidden") is not None else box.get_attribute("textContent")

    def fill(self, css: str, value: str) -> None:
        from selenium.webdriver.common.keys import Keys

        field = self.el(css)
        field.clear()
        field.send_keys(value + Keys.TAB)  # Tab: the change event (the key is saved, models reloaded)

    def send(self, text: str | None = None) -> None:
        if text is not None:
            self.el("#prompt").send_keys(text)
        self.el("#send").click()

    def messages(self) -> list[tuple[str, str, str]]:
        """(role, text, state) of each message shown. The state is read before the text: the page sets
        it after the reply's last text, so a final state comes with the whole text (read the other way
        round, a chunk landing between the two reads gave a reply cut short marked done)."""
        from selenium.webdriver.common.by import By

        out = []
        for m in self.driver.find_elements(By.CSS_SELECTOR, "#conversation .message"):
            role = "user" if "user" in m.get_attribute("class").split() else "assistant"
            state = m.get_attribute("data-state") or ""
            text = m.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
            out.append((role, text, state))
        return out

    def last_reply(self) -> tuple[str, str]:
        """(text, state) of the last assistant message once it is no longer streaming."""
        def ended() -> tuple[str, str] | None:
            shown = self.messages()
            if shown and shown[-1][0] == "assistant" and shown[-1][2] not in ("", "streaming"):
                return shown[-1][1], shown[-1][2]
            return None
        return wait_for(self.driver, ended, "the reply never ended")

    def refused(self, text: str) -> str:
        """Sends `text`, expects the error box; the question must be back in the box, unsent."""
        self.send(text)
        message = wait_for(self.driver, self.error, "no error shown")
        assert self.messages() == []
        assert self.el("#prompt").get_attribute("value") == text
        self.el("#prompt").clear()
        return message


def test_loading_reasoning_streaming_stop_and_new_chat(browser, servers):
    srv = servers[0]
    deadline = time.monotonic() + WAIT_S
    while True:  # the HTTP server is up; its engine is still starting
        try:
            httpx.get(srv.base + "/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, srv.output()
            time.sleep(0.05)
    page = Page(browser, srv.base + "/")
    assert page.status().startswith("loading the model")
    message = page.refused("hi")
    assert "the model is loading" in message and message.endswith("(HTTP 503)")
    (srv.tmp / RELEASE).touch()  # now the engine loads

    wait_for(browser, lambda: page.status() == "ready", "the status never turned ready")
    page.send("hi")
    wait_for(browser, lambda: len(page.messages()) == 2 and len(page.messages()[1][1]) >= 5, "no content")
    role, partial, state = page.messages()[1]
    assert state == "streaming" and ANSWER.startswith(partial) and partial != ANSWER  # shown as it arrives
    assert page.text_of(".message.assistant details.reasoning .reasoning-text") == THOUGHT
    page.el("#stop").click()
    text, state = page.last_reply()
    assert state == "stopped" and ANSWER.startswith(text) and len(text) < len(ANSWER)
    assert page.text_of(".message.assistant .note") == "stopped"
    wait_for(browser, lambda: srv.metrics()["totals"]["disconnects"] == 1, "Stop did not end the engine's work")

    page.el("#new-chat").click()
    assert page.messages() == [] and page.error() == ""

def test_two_turns_behind_the_key(browser, servers):
    keyed = servers[1]
    keyed.wait_ready()
    page = Page(browser, keyed.base + "/")  # the page itself needs no key
    assert page.status() == "ready"
    assert "needs an API key" in wait_for(browser, page.error, "no 401 shown for /v1/models without the key")
    assert "needs an API key" in page.refused("hello")

    page.fill("#api-key", "wrong-key")
    assert "refused the API key (invalid API key)" in page.refused("hello")

    page.fill("#api-key", KEY)
    wait_for(browser, lambda: page.el("#model").get_attribute("value") == "hashlm", "models not loaded")
    assert page.error() == ""
    page.fill("#max-tokens", "100000")
    message = page.refused("hello")  # the server's own words for a 400
    assert "max_tokens is 100000" in message and message.endswith("(HTTP 400)")

    page.fill("#max-tokens", "80")
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    page.send(conversation[0]["content"])
    first, finish = keyed.expected_chat(conversation, 80)
    assert page.last_reply() == (first, "done")
    assert page.error() == ""
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    page.send("And of Italy?")
    second, _ = keyed.expected_chat(conversation, 80)
    assert second != keyed.expected_chat(user("And of Italy?"), 80)[0]  # the reply depends on the history
    assert page.last_reply() == (second, "done")
    assert [(role, text) for role, text, _ in page.messages()] == [(m["role"], m["content"]) for m in conversation] + [
        ("assistant", second)]

    browser.refresh()  # the key is kept in the browser; the conversation is not
    page = Page(browser, keyed.base + "/")
    assert page.el("#api-key").get_attribute("value") == KEY and page.messages() == []


def test_page_files_need_no_key_but_keep_the_host_check(servers):
    slow, keyed = servers
    keyed.wait_ready()
    with httpx.Client() as client:  # no key
        for path, kind in [("/", "text/html"), ("/static/chat.js", "text/javascript"),
                           ("/static/chat.css", "text/css")]:
            r = client.get(keyed.base + path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.status_code)
            assert "default-src 'self'" in r.headers["content-security-policy"]
        assert client.get(keyed.base + "/v1/models").status_code == 401
        assert client.get(keyed.base + "/static/other.js").status_code == 401  # only the page's own files
        # without a key the Host check (DNS rebinding) covers the page as every other path
        assert client.get(slow.base + "/", headers={"Host": "evil.example"}).status_code == 403
        assert client.get(slow.base + "/", headers={"Host": f"localhost:{slow.port}"}).status_code == 200
