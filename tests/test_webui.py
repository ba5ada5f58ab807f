"""The Gradio page in a real headless Chromium: type, watch the answer stream, press Stop, stay on 127.0.0.1."""

from __future__ import annotations

import re
import shutil
import time
from urllib.parse import urlparse

import httpx
import pytest

from conftest import ServerProcess
from edge.decode.tokenizer import ChatTokenizer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (apt-get install chromium; .ci/run does)"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed: pip install -e '.[dev]'")


def _prompt_tokens(server) -> int:
    return int(re.search(r"^edgechat_prompt_tokens_total (\d+)$", httpx.get(server.url + "/metrics").text, re.M).group(1))


def _bot_text(page) -> str:
    bots = page.locator("#chatbot [data-testid='bot']")
    return bots.last.inner_text() if bots.count() else ""


def test_page_streams_an_answer_and_stop_really_stops(long_bundle):
    server = ServerProcess(long_bundle.root, "--max-users", "4")
    requests: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page()
            page.on("request", lambda r: requests.append(r.url))
            page.on("websocket", lambda ws: requests.append(ws.url))
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_selector("#message textarea", timeout=30_000)
            assert "tiny-llama-4k" in page.locator("#model-line").inner_text()
            assert "fp32" in page.locator("#model-line").inner_text()
            page.get_by_text("Settings").click()
            page.get_by_label("number input for Max new tokens").fill("2000")
            page.get_by_label("number input for Temperature (0 = greedy)").fill("1")
            page.get_by_label("number input for Temperature (0 = greedy)").press("Enter")
            other = browser.new_page()  # another user, set up now so that both answers run at once below
            other.goto(server.url + "/", wait_until="load")
            other.wait_for_selector("#message textarea", timeout=30_000)
            other.get_by_text("Settings").click()
            other.get_by_label("number input for Max new tokens").fill("2000")
            other.get_by_label("number input for Temperature (0 = greedy)").fill("1")
            other.get_by_label("number input for Temperature (0 = greedy)").press("Enter")
            page.locator("#message textarea").fill("Hello! Tell me a fun fact.")
            page.locator("#message textarea").press("Enter")
            # the user's message shows, then the answer grows while it streams
            page.wait_for_selector("#chatbot [data-testid='user']", timeout=30_000)
            deadline = time.time() + 30
            while not _bot_text(page) and time.time() < deadline:
                time.sleep(0.05)
            first = _bot_text(page)
            assert first, "no streamed answer appeared"
            deadline = time.time() + 5
            while len(_bot_text(page)) <= len(first) and time.time() < deadline:
                time.sleep(0.05)
            assert len(_bot_text(page)) > len(first), "the answer did not grow: not streaming"
            assert "generating" in page.locator("#stats").inner_text()
            # another user's page streams at the same time: this page's Stop must not stop that answer
            other.locator("#message textarea").fill("Tell me another fact.")
            other.locator("#message textarea").press("Enter")
            other.wait_for_function("document.querySelector('#stats').innerText.includes('generating')",
                                    timeout=30_000)
            page.locator("#stop").click()
            time.sleep(1.0)
            after_stop, other_at_stop = _bot_text(page), _bot_text(other)
            time.sleep(1.0)
            assert _bot_text(page) == after_stop, "text kept coming after Stop"
            assert len(_bot_text(other)) > len(other_at_stop), "Stop on one page stopped another page's answer"
            assert "generating" in other.locator("#stats").inner_text()
            other.locator("#stop").click()
            other.wait_for_function("document.querySelector('#stats').innerText.startsWith('stopped')", timeout=10_000)
            other.close()
            assert re.fullmatch(r"stopped · \d+ tokens", page.locator("#stats").inner_text())  # not "generating…"
            metrics = httpx.get(server.url + "/metrics").text
            assert re.search(r'^edgechat_requests_total\{finish="cancelled"\} 2$', metrics, re.M), metrics
            assert re.search(r"^edgechat_active_requests 0$", metrics, re.M)
            # a second question in the same chat gets a full answer and the speed line
            page.get_by_label("number input for Max new tokens").fill("20")
            page.get_by_label("number input for Max new tokens").press("Enter")
            page.locator("#message textarea").fill("And another one?")
            page.locator("#message textarea").press("Enter")
            page.wait_for_function("document.querySelector('#stats').innerText.includes('tok/s')", timeout=30_000)
            assert page.locator("#chatbot [data-testid='user']").count() == 2
            assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · 20 tokens · length", page.locator("#stats").inner_text())
            # the chatbot's own trash icon clears the conversation for real: the next question is sent alone
            page.locator("#chatbot button[aria-label='Clear']").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 0",
                                   timeout=10_000)
            before = _prompt_tokens(server)
            page.locator("#message textarea").fill("A fresh question?")
            page.locator("#message textarea").press("Enter")
            page.wait_for_function("document.querySelector('#stats').innerText.includes('tok/s')", timeout=30_000)
            assert _prompt_tokens(server) - before == len(
                ChatTokenizer(long_bundle.path(long_bundle.manifest.tokenizer.file), long_bundle.manifest.tokenizer)
                .encode_chat([{"role": "user", "content": "A fresh question?"}]))
            # Clear while an answer streams: the answer stops (cancelled) and does not refill the chat
            page.get_by_label("number input for Max new tokens").fill("2000")
            page.get_by_label("number input for Max new tokens").press("Enter")
            page.locator("#message textarea").fill("One more, a long one?")
            page.locator("#message textarea").press("Enter")
            page.wait_for_function("document.querySelector('#stats').innerText.includes('generating')", timeout=30_000)
            page.locator("#clear").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 0",
                                   timeout=10_000)
            time.sleep(1.5)
            assert page.locator("#chatbot [data-testid='user']").count() == 0 and not _bot_text(page)
            assert page.locator("#stats").inner_text() == ""
            metrics = httpx.get(server.url + "/metrics").text
            assert re.search(r'^edgechat_requests_total\{finish="cancelled"\} 3$', metrics, re.M), metrics
            assert re.search(r"^edgechat_active_requests 0$", metrics, re.M)
            # neither Stop nor Clear left gradio's "Error" badge on the page
            assert page.get_by_text("Error", exact=True).count() == 0
            browser.close()
    finally:
        code, out = server.stop()
    assert code == 0, out
    hosts = {urlparse(u).hostname for u in requests if not u.startswith(("data:", "blob:"))}
    assert hosts == {"127.0.0.1"}, f"the page reached outside loopback: {sorted(hosts)}"
    assert len(requests) > 5
