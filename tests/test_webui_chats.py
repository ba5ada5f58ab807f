"""The page's chats in a real headless Chromium against a real server: kept in the browser across reloads,
listed (new, open, rename, delete) and kept apart, the system prompt field used, tokens and tok/s under each
answer, regenerate and edit-and-resend asking again, a chat switched mid-answer left alone, no request leaving
loopback, and a layout that fits 360 px."""

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
READY = "#message textarea:not([disabled])"  # the page has read the browser's chats
STATS = re.compile(r"^(\d+) tokens · [\d.]+ tok/s · TTFT \d+ ms · length$")


def _metric(server, line: str) -> int:
    m = re.search(rf"^{re.escape(line)} (\d+)$", httpx.get(server.url + "/metrics").text, re.M)
    return int(m.group(1)) if m else 0


def _prompt_tokens(server) -> int:
    return _metric(server, "edgechat_prompt_tokens_total")


def _finished(server, finish: str = "length") -> int:
    return _metric(server, f'edgechat_requests_total{{finish="{finish}"}}')


def _tokens(bundle, messages: list[dict]) -> int:
    tok = ChatTokenizer(bundle.path(bundle.manifest.tokenizer.file), bundle.manifest.tokenizer)
    return len(tok.encode_chat(messages))


def _settled(page, n_bots: int) -> None:
    """Wait until the chat shows n_bots answers, the last with its stats line, and the status line is final."""
    page.wait_for_function(
        "n => { const b = document.querySelectorAll(\"#chatbot [data-testid='bot']\");"
        " return b.length == n && b[n - 1].querySelector('.answer-stats') !== null"
        " && document.querySelector('#stats').innerText.includes('tok/s'); }", arg=n_bots, timeout=60_000)
    time.sleep(0.3)


def _wait_request(server, before: int) -> None:
    deadline = time.time() + 60
    while _finished(server) <= before and time.time() < deadline:
        time.sleep(0.05)
    assert _finished(server) > before, "no new answer was asked for"


def _ask(page, server, text: str) -> None:
    before = _finished(server)
    n = page.locator("#chatbot [data-testid='bot']").count()
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    _wait_request(server, before)
    _settled(page, n + 1)


def _texts(page, who: str) -> list[str]:
    return page.locator(f"#chatbot [data-testid='{who}']").all_inner_texts()


def _answer(page) -> str:
    """The last answer's text without its stats line."""
    bot = page.locator("#chatbot [data-testid='bot']").last
    return bot.inner_text().replace(bot.locator(".answer-stats").inner_text(), "").strip()


def _chats(page) -> list[str]:
    return page.locator("#chat-list label").all_inner_texts()


def _settings(page, max_tokens: int, temperature: float) -> None:
    page.get_by_text("Settings").click()
    page.get_by_label("number input for Max new tokens").fill(str(max_tokens))
    page.get_by_label("number input for Max new tokens").press("Enter")
    page.get_by_label("number input for Temperature (0 = greedy)").fill(str(temperature))
    page.get_by_label("number input for Temperature (0 = greedy)").press("Enter")


def _browser(p):
    """Chromium that cannot resolve any host but loopback: a device on a Wi-Fi without internet. (Routing
    requests in playwright instead holds back gradio's streamed responses.)"""
    return p.chromium.launch(executable_path=CHROMIUM, args=[
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])


def _outside(urls: list[str]) -> list[str]:
    return [u for u in urls if urlparse(u).hostname != "127.0.0.1" and not u.startswith(("data:", "blob:"))]


def test_chats_survive_reload_stay_apart_and_use_the_system_prompt(long_bundle):
    server = ServerProcess(long_bundle.root, "--max-users", "2")
    seen: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.on("request", lambda r: seen.append(r.url))  # every page, frame and worker of the context
            page = context.new_page()
            page.on("websocket", lambda ws: seen.append(ws.url))
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_selector(READY, timeout=30_000)
            assert page.locator("#system textarea").is_visible()  # no Settings to open for it
            _settings(page, 8, 0)
            # the system prompt field is what the model gets
            page.locator("#system textarea").fill("You are terse.")
            before = _prompt_tokens(server)
            _ask(page, server, "What is the capital of Japan?")
            q1 = [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is the capital of Japan?"}]
            assert _prompt_tokens(server) - before == _tokens(long_bundle, q1)
            # tokens and tok/s under the answer itself
            stats = page.locator("#chatbot [data-testid='bot'] .answer-stats").last.inner_text()
            assert STATS.match(stats) and STATS.match(stats).group(1) == "8", stats
            a1 = _answer(page)
            first_bot = _texts(page, "bot")
            # the conversation survives a reload: messages, stats line, system prompt, its place in the list
            page.reload(wait_until="load")
            page.wait_for_selector(READY, timeout=30_000)
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='bot']\").length == 1",
                                   timeout=10_000)
            assert _texts(page, "user") == ["What is the capital of Japan?"] and _texts(page, "bot") == first_bot
            assert page.locator("#system textarea").input_value() == "You are terse."
            assert _chats(page) == ["What is the capital of Japan?"]
            # a second chat: empty, keeps the system prompt in use until changed; Markdown and code render
            page.locator("#new-chat").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 0",
                                   timeout=10_000)
            assert page.locator("#system textarea").input_value() == "You are terse."
            page.locator("#system textarea").fill("")
            before = _prompt_tokens(server)
            q2 = "Fun **fact**?\n```python\nprint('hi')\n```"
            _ask(page, server, q2)
            assert _prompt_tokens(server) - before == _tokens(long_bundle, [{"role": "user", "content": q2}])
            user = page.locator("#chatbot [data-testid='user']").last
            assert user.locator("strong").inner_text() == "fact"
            assert user.locator("pre code").count() == 1 and user.locator("pre code .token").count() >= 2
            assert _chats(page) == ["Fun **fact**? ```python print('hi') ```", "What is the capital of Japan?"]
            # back to the first chat: only its messages, its system prompt, and the model gets only its turns
            page.locator("#chat-list label", has_text="capital of Japan").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 1 && "
                                   "document.querySelector(\"#chatbot [data-testid='user']\").innerText.includes('Japan')",
                                   timeout=10_000)
            assert page.locator("#system textarea").input_value() == "You are terse."
            before = _prompt_tokens(server)
            _ask(page, server, "And of France?")
            follow = q1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And of France?"}]
            assert _prompt_tokens(server) - before == _tokens(long_bundle, follow)
            assert _texts(page, "user") == ["What is the capital of Japan?", "And of France?"]
            # rename, then reload: the open chat and both chats are still there, apart
            page.locator("#chat-title textarea, #chat-title input").first.fill("Geography")
            page.locator("#chat-title textarea, #chat-title input").first.press("Enter")
            page.wait_for_function("document.querySelector('#chat-list').innerText.includes('Geography')",
                                   timeout=10_000)
            page.reload(wait_until="load")
            page.wait_for_selector(READY, timeout=30_000)
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 2",
                                   timeout=10_000)
            assert _chats(page) == ["Geography", "Fun **fact**? ```python print('hi') ```"]
            page.locator("#chat-list label", has_text="Fun").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 1",
                                   timeout=10_000)
            assert "Japan" not in page.locator("#chatbot").inner_text()
            assert page.locator("#system textarea").input_value() == ""
            # delete the open chat (a second click confirms): the other one opens, a reload does not bring it back
            page.locator("#delete-chat").click()
            page.wait_for_function("document.querySelector('#delete-chat').innerText.includes('again')",
                                   timeout=10_000)
            assert len(_chats(page)) == 2
            page.locator("#delete-chat").click()
            page.wait_for_function("document.querySelector('#chat-list').innerText.includes('Geography') && "
                                   "!document.querySelector('#chat-list').innerText.includes('Fun')", timeout=10_000)
            assert _texts(page, "user") == ["What is the capital of Japan?", "And of France?"]
            page.reload(wait_until="load")
            page.wait_for_selector(READY, timeout=30_000)
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 2",
                                   timeout=10_000)
            assert _chats(page) == ["Geography"]
            # another browser (its own storage) starts with no chats: nothing is kept on the server
            other = browser.new_context(viewport={"width": 360, "height": 740}).new_page()
            other.goto(server.url + "/", wait_until="load")
            other.wait_for_selector(READY, timeout=30_000)
            assert other.locator("#chatbot [data-testid='user']").count() == 0
            browser.close()
    finally:
        code, out = server.stop()
    assert code == 0 and "Traceback" not in out, out
    assert not _outside(seen), f"the page reached outside loopback (fonts, CDN?): {_outside(seen)}"
    assert len(seen) > 5


def test_regenerate_edit_and_a_chat_switched_mid_answer(long_bundle, tmp_path):
    server = ServerProcess(long_bundle.root, "--max-users", "2")
    try:
        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_context(viewport={"width": 360, "height": 740}).new_page()
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_selector(READY, timeout=30_000)
            # at 360 px the list of chats is folded away and nothing is wider than the screen
            assert page.locator("#chats-panel.open").count() == 0
            assert page.evaluate("document.documentElement.scrollWidth") <= 360
            _settings(page, 12, 1)
            before = _prompt_tokens(server)
            _ask(page, server, "Hello! Tell me a fun fact.")
            one = _prompt_tokens(server) - before
            assert one == _tokens(long_bundle, [{"role": "user", "content": "Hello! Tell me a fun fact."}])
            first = _answer(page)
            assert page.evaluate("document.documentElement.scrollWidth") <= 360  # with an answer drawn too
            page.screenshot(path=str(tmp_path / "page-360.png"))
            # regenerate: a new request for the same question (its old answer not sent), a new sampled answer
            before, asked = _prompt_tokens(server), _finished(server)
            page.locator("#chatbot button[aria-label='Retry']").click()
            _wait_request(server, asked)
            _settled(page, 1)
            assert _prompt_tokens(server) - before == one
            assert _texts(page, "user") == ["Hello! Tell me a fun fact."] and _answer(page) != first
            # edit-and-resend: the edited question replaces the old one and is answered
            before, asked = _prompt_tokens(server), _finished(server)
            page.locator("#chatbot button[aria-label='Edit']").click()
            page.locator("#chatbot textarea").fill("Edited question")
            page.locator("#chatbot").get_by_role("button", name="Submit").click()
            _wait_request(server, asked)
            _settled(page, 1)
            assert _prompt_tokens(server) - before == _tokens(long_bundle, [{"role": "user", "content": "Edited question"}])
            assert _texts(page, "user") == ["Edited question"]
            page.reload(wait_until="load")
            page.wait_for_selector(READY, timeout=30_000)
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='bot']\").length == 1",
                                   timeout=10_000)
            assert _texts(page, "user") == ["Edited question"]
            # a new chat opened while an answer streams: that answer stops and never draws into the new chat
            page.get_by_text("Settings").click()  # closed again after the reload
            page.get_by_label("number input for Max new tokens").fill("2000")
            page.get_by_label("number input for Max new tokens").press("Enter")
            page.locator("#message textarea").fill("A long one, please.")
            page.locator("#message textarea").press("Enter")
            page.wait_for_function("document.querySelector('#stats').innerText.includes('generating')", timeout=30_000)
            time.sleep(0.5)
            page.locator("#chats-panel .toggle-button").click()  # the list, folded on a phone
            page.locator("#new-chat").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 0",
                                   timeout=10_000)
            assert page.locator("#chats-panel.open").count() == 0  # the list folds again once a chat is picked
            deadline = time.time() + 10
            while _finished(server, "cancelled") < 1 and time.time() < deadline:
                time.sleep(0.05)
            assert _finished(server, "cancelled") == 1
            time.sleep(1.0)
            assert page.locator("#chatbot [data-testid='bot']").count() == 0
            # the old chat kept its question and what was written of the answer
            page.locator("#chats-panel .toggle-button").click()
            assert _chats(page) == ["New chat", "Edited question"]
            page.locator("#chat-list label", has_text="Edited question").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 2",
                                   timeout=10_000)
            assert _texts(page, "user") == ["Edited question", "A long one, please."]
            wide = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            wide.goto(server.url + "/", wait_until="load")
            wide.wait_for_selector(READY, timeout=30_000)
            wide.wait_for_selector("#chats-panel.open", timeout=10_000)  # the list is open when wide
            wide.screenshot(path=str(tmp_path / "page-1280.png"))
            assert page.get_by_text("Error", exact=True).count() == 0
            browser.close()
    finally:
        code, out = server.stop()
    assert code == 0 and "Traceback" not in out, out


def test_two_tabs_of_one_browser_keep_each_others_chats(long_bundle):
    """Both tabs share the browser's storage: a chat saved in one survives the other's next save (each event
    reads the stored chats afresh; a copy read at page load overwrote the other tab's chat)."""
    server = ServerProcess(long_bundle.root, "--max-users", "2")
    try:
        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            one, two = context.new_page(), context.new_page()
            for page in (one, two):  # both loaded before either saves
                page.goto(server.url + "/", wait_until="load")
                page.wait_for_selector(READY, timeout=30_000)
                _settings(page, 4, 0)
            _ask(one, server, "First tab's question")
            _ask(two, server, "Second tab's question")
            assert _chats(two) == ["Second tab's question", "First tab's question"]
            # the first tab's list follows by itself (the storage event), its open chat stays
            one.wait_for_function("document.querySelectorAll('#chat-list label').length == 2", timeout=10_000)
            assert _chats(one) == ["Second tab's question", "First tab's question"]
            assert _texts(one, "user") == ["First tab's question"]
            one.locator("#system textarea").fill("Be brief.")
            one.locator("#system textarea").blur()  # a save in the first tab, after the second tab's
            # the save has landed when the stored list has the first tab's chat newest (the list showed
            # 'Second' before it too: waiting on that raced the reload below on a loaded machine)
            one.wait_for_function("(() => { const s = JSON.parse(localStorage.getItem('edgechat-chats-v1') || 'null');"
                                  " return s && s.chats.length == 2 && s.chats[0].title.startsWith('First'); })()",
                                  timeout=30_000)
            for page in (one, two):
                page.reload(wait_until="load")
                page.wait_for_selector(READY, timeout=30_000)
                page.wait_for_function("document.querySelectorAll('#chat-list label').length == 2", timeout=10_000)
                assert _chats(page) == ["First tab's question", "Second tab's question"]
            browser.close()
    finally:
        code, out = server.stop()
    assert code == 0 and "Traceback" not in out, out
