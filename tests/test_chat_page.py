"""The chat page (``GET /``) in a real headless Chromium against a real server.

The server is ``python -m api.cli`` on a loopback port with no
``--model``: the embedded demo model. The browser is Debian's ``chromium``
driven by Playwright (Playwright's own browser download cannot work
offline); the ``chromium`` fixture installs it with apt-get when it is
missing and this process is root, and skips, saying why, only where it
cannot be installed.

    python -m tests.test_chat_page docs/chat-page.png   # the README's screenshot
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from tests.test_server_process import spawn_server, stop_server

pytestmark = pytest.mark.server  # starts a server subprocess and a browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
DEMO_TOKENIZER = Path(__file__).parent.parent / "demo_model" / "mlx-trio-demo" / "tokenizer.json"
WAIT_MS = 60_000  # the CPU is shared: generous, but bounded


def install_chromium() -> str | None:
    """Install Debian's chromium if missing and possible; None when it is there, else why not."""
    if os.path.exists(CHROMIUM):
        return None
    if not shutil.which("apt-get"):
        return f"{CHROMIUM} is missing and there is no apt-get to install it"
    if os.geteuid() != 0:
        return f"{CHROMIUM} is missing; install it as root: apt-get install -y chromium"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command, seconds in (
        (["apt-get", "update"], 300),
        (["apt-get", "install", "-y", "--no-install-recommends", "chromium"], 900),
    ):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took more than {seconds} s"
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed: {(done.stderr or done.stdout)[-500:]}"
    return None if os.path.exists(CHROMIUM) else f"apt-get installed chromium but not {CHROMIUM}"


@pytest.fixture(scope="session")
def chromium():
    reason = install_chromium()
    if reason is not None:
        pytest.skip(f"no Chromium for the chat page tests: {reason}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def demo_server_args(port: int) -> list[str]:
    return ["-m", "api.cli", "--port", str(port)]


@pytest.fixture(scope="module")
def demo_server():
    proc, base = spawn_server(demo_server_args)
    yield base
    stop_server(proc)


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=5).json()


def wait_engine_idle(base: str, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        h = health(base)
        if h["active_sequences"] == 0 and h["requests_in_flight"] == 0:
            return h
        assert time.monotonic() < deadline, f"the generation is still running: {h}"
        time.sleep(0.05)


def open_page(browser, base: str, **context_options):
    """A fresh context (empty localStorage) on the chat page, once the model list is in."""
    context = browser.new_context(**context_options)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{base}/")
    expect(page.locator("#model option[value='mlx-trio-demo']")).to_be_attached()
    return context, page, errors


@pytest.fixture
def page(chromium, demo_server):
    context, page, errors = open_page(chromium, demo_server, viewport={"width": 1000, "height": 800})
    yield page
    context.close()
    assert errors == [], f"script errors in the page: {errors}"


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def open_settings(page) -> None:
    if not page.locator("#settings").evaluate("details => details.open"):
        page.click("#settings summary")


def cached_tokens(stats: str) -> int:
    match = re.search(r"(\d+) of \d+ prompt tokens cached", stats)
    assert match, stats
    return int(match[1])


def eos_token_ids() -> list[int]:
    tokens = json.loads(DEMO_TOKENIZER.read_text())["added_tokens"]
    return [t["id"] for t in tokens if t["content"] in ("<|im_end|>", "<|endoftext|>")]


def never_stop(page) -> None:
    """Ban the demo model's end-of-turn tokens in the page's requests, so a reply
    runs until max_tokens (the model itself ends every reply within ~50 tokens)."""
    ban = {str(i): -100 for i in eos_token_ids()}

    def add_logit_bias(route):
        body = route.request.post_data_json
        route.continue_(post_data=json.dumps({**body, "logit_bias": ban}))

    page.route("**/v1/chat/completions", add_logit_bias)


# ------------------------------------------------------------------ tests


def test_page_and_assets_are_served_with_types_and_etags(demo_server):
    page = httpx.get(f"{demo_server}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'src="assets/chat.js"' in page.text
    script = httpx.get(f"{demo_server}/assets/chat.js", timeout=10)
    assert script.headers["content-type"].startswith("text/javascript")
    again = httpx.get(f"{demo_server}/assets/chat.js", timeout=10,
                      headers={"If-None-Match": script.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert httpx.get(f"{demo_server}/assets/chat.css", timeout=10).headers[
        "content-type"].startswith("text/css")
    for missing in ("/assets/nope.js", "/assets/..%2Fchat_page.py", "/assets/../server.py"):
        r = httpx.get(f"{demo_server}{missing}", timeout=10)
        assert r.status_code == 404, missing
    # The JSON API around it is unchanged: CORS, JSON errors.
    assert httpx.get(f"{demo_server}/v1/models", timeout=10).headers[
        "access-control-allow-origin"] == "*"


def test_a_message_streams_a_reply_with_reasoning_and_stats(page):
    # Watch the reply grow: it is painted chunk by chunk, before the stats appear.
    # The page records every text the reply shows (polling from here could miss
    # them all on a busy machine).
    page.evaluate("""() => {
        window.seenReplies = new Set();
        new MutationObserver(() => {
            const reply = [...document.querySelectorAll('.msg.assistant')].pop();
            if (reply && !reply.querySelector('.stats')) window.seenReplies.add(reply.innerText);
        }).observe(document.querySelector('#transcript'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "What is 12 + 30?")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".stats")).to_have_count(1, timeout=WAIT_MS)
    seen = page.evaluate("() => [...window.seenReplies]")
    assert len(seen) >= 2, f"the reply did not stream: {seen}"
    expect(reply.locator(".text")).to_have_text("42")
    reasoning = reply.locator("details.reasoning")
    expect(reasoning).not_to_have_attribute("open", "")
    expect(reasoning.locator("pre")).to_contain_text("12 + 30")
    expect(reply.locator(".stats")).to_contain_text("tokens/s")
    expect(reply.locator(".stats")).to_contain_text("prompt tokens cached")
    assert cached_tokens(reply.locator(".stats").inner_text()) == 0  # a new, short prompt
    # The conversation survives a reload (localStorage); New chat clears it.
    page.reload()
    expect(page.locator(".msg.user")).to_have_count(1)
    expect(page.locator(".msg.assistant .text").first).to_have_text("42")
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    page.reload()
    expect(page.locator("#transcript")).to_be_empty()


def test_stop_and_escape_cancel_the_generation_on_the_server(page, demo_server):
    never_stop(page)
    open_settings(page)
    page.fill("#max-tokens", "20000")
    for n, how in enumerate(("button", "escape")):
        send(page, "Hello")
        reply = page.locator(".msg.assistant").nth(n)
        expect(reply.locator(".text")).to_have_text(re.compile(r"\w"))  # text streams
        assert health(demo_server)["active_sequences"] == 1, reply.text_content()
        expect(page.locator("#stop")).to_be_enabled()
        if how == "button":
            page.click("#stop")
        else:
            page.keyboard.press("Escape")
        expect(reply.locator(".stopped")).to_have_text("Stopped.")
        expect(page.locator("#status")).to_have_text("Stopped.")
        expect(page.locator("#stop")).to_be_disabled()
        expect(page.locator("#send")).to_be_enabled()
        wait_engine_idle(demo_server)  # long before 20000 tokens at this speed


def test_demo_tools_preset_gives_a_tool_call_card_and_a_round_trip(page):
    open_settings(page)
    page.click("#tools-preset")
    tools = json.loads(page.input_value("#tools"))
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    send(page, "What is the weather in Lisbon?")
    card = page.locator(".tool-card")
    expect(card.locator("h3")).to_have_text("Tool call get_weather")
    assert json.loads(card.locator(".tool-args").inner_text()) == {"city": "Lisbon"}
    card.locator("input").fill('{"temperature": 21, "condition": "sunny"}')
    card.locator("button").click()
    expect(page.locator(".msg.tool")).to_contain_text("get_weather")
    answer = page.locator(".msg.assistant").last.locator(".text")
    expect(answer).to_have_text("It is 21 degrees and sunny in Lisbon.")
    expect(page.locator(".tool-card input")).to_have_count(0)  # answered
    # The second request repeats the first one's prompt: the server's prompt cache has it.
    # The stats line comes when the stream ends, after the text: wait for the answer's own.
    stats = page.locator(".msg.assistant").last.locator(".stats")
    expect(stats).to_have_text(re.compile(r"prompt tokens cached"))
    assert cached_tokens(stats.inner_text()) >= 64, stats.inner_text()


def test_errors_are_shown(page):
    open_settings(page)
    page.fill("#max-tokens", "0")
    send(page, "Hello")
    alert = page.locator(".msg.error[role=alert]")
    expect(alert).to_contain_text("HTTP 400")
    expect(alert).to_contain_text("max_tokens")
    page.fill("#max-tokens", "")
    page.fill("#tools", "[{")
    send(page, "Hello")
    expect(alert.nth(1)).to_contain_text("The tools are not valid JSON")
    page.fill("#tools", "")
    # An error frame inside a stream (the server sends one when the engine fails
    # mid-reply): a canned stream, since a real engine failure is not on demand.
    chunk = {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
    failure = {"error": {"message": "the engine stopped", "type": "server_error",
                         "param": None, "code": None}}
    canned = f": keepalive 1/2\n\ndata: {json.dumps(chunk)}\n\ndata: {json.dumps(failure)}\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=canned))
    send(page, "Hello")
    expect(alert.nth(2)).to_contain_text("the engine stopped")
    expect(page.locator(".msg.assistant .text").last).to_have_text("Hel")
    expect(page.locator("#send")).to_be_enabled()


def test_phone_width_has_no_horizontal_scroll(chromium, demo_server):
    context, page, errors = open_page(chromium, demo_server,
                                      viewport={"width": 360, "height": 740}, is_mobile=True)
    try:
        open_settings(page)
        page.click("#tools-preset")
        send(page, "What time is it in Tokyo?")
        expect(page.locator(".tool-card h3")).to_have_text("Tool call get_time")
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 360, width
        assert page.locator("#stop").bounding_box()["x"] + 10 < 360
    finally:
        context.close()
    assert errors == []


# ------------------------------------------------------------ screenshot


def take_screenshot(path: str) -> None:
    """A real exchange with the demo model (reasoning, a tool round trip), saved as PNG."""
    proc, base = spawn_server(demo_server_args)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context, page, errors = open_page(browser, base, viewport={"width": 960, "height": 900},
                                              device_scale_factor=1)
            send(page, "What is 47 + 85?")
            expect(page.locator(".msg.assistant .stats")).to_have_count(1)
            open_settings(page)
            page.click("#tools-preset")
            page.click("#settings summary")
            send(page, "What is the weather in Lisbon?")
            card = page.locator(".tool-card")
            card.locator("input").fill('{"temperature": 21, "condition": "sunny"}')
            card.locator("button").click()
            expect(page.locator(".msg.assistant .stats")).to_have_count(3)
            page.locator("details.reasoning summary").click()
            page.fill("#prompt", "What time is it in Tokyo?")
            page.screenshot(path=path)
            browser.close()
            assert errors == [], errors
    finally:
        stop_server(proc)


if __name__ == "__main__":
    take_screenshot(sys.argv[1] if len(sys.argv) > 1 else "docs/chat-page.png")
