"""The page's JSON mode and tool calls, in a real headless Chromium against a real server."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from conftest import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (apt-get install chromium; .ci/run does)"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed: pip install -e '.[dev]'")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
ADD = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}]


def _settled(locator, quiet_s: float = 0.5, timeout_s: float = 10.0) -> str:
    """The element's text once it has not changed for quiet_s: the chatbot can draw the final message a
    frame after the status line (its code block is highlighted as it renders)."""
    text, since, deadline = locator.inner_text(), time.time(), time.time() + timeout_s
    while time.time() - since < quiet_s and time.time() < deadline:
        time.sleep(0.05)
        now = locator.inner_text()
        if now != text:
            text, since = now, time.time()
    return text


def _ask(page, text: str) -> str:
    before = page.locator("#chatbot [data-testid='bot']").count()
    old_status = page.locator("#stats").inner_text()  # the previous answer's speed line: not this one's
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    deadline = time.time() + 60
    while time.time() < deadline:
        status = page.locator("#stats").inner_text()
        if "tok/s" in status and status != old_status and \
                page.locator("#chatbot [data-testid='bot']").count() > before:
            bot = page.locator("#chatbot [data-testid='bot']").last
            text = _settled(bot)  # the answer, then its stats line (tokens, tok/s) under it
            return text.replace(bot.locator(".answer-stats").inner_text(), "").strip()
        time.sleep(0.1)
    raise AssertionError(f"no finished answer; status: {page.locator('#stats').inner_text()!r}")


def test_json_mode_and_tool_calls_on_the_page(long_bundle):
    server = ServerProcess(long_bundle.root, "--max-users", "2")
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page()
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_selector("#message textarea", timeout=30_000)
            page.get_by_text("Settings").click()
            page.get_by_label("JSON mode (the answer is one JSON object)").check()
            page.locator("#json-schema textarea").fill(json.dumps(SCHEMA))
            page.get_by_label("number input for Temperature (0 = greedy)").fill("1")
            page.get_by_label("number input for Temperature (0 = greedy)").press("Enter")
            answer = _ask(page, "Who are you? Answer in JSON.")
            jsonschema.validate(json.loads(answer), SCHEMA)
            # tools, with tool_choice required: the call shows in the chat as a call block
            page.get_by_label("JSON mode (the answer is one JSON object)").uncheck()
            page.locator("#tools textarea").fill(json.dumps(ADD))
            page.get_by_label("required").check()
            shown = _ask(page, "What is 2 plus 3?")
            assert "🔧" in shown and "add" in shown, shown
            args = json.loads(shown[shown.index("{"):shown.rindex("}") + 1])
            jsonschema.validate(args, ADD[0]["function"]["parameters"])
            # a schema that does not parse is said on the status line; the page goes on
            page.locator("#tools textarea").fill("[{not json")
            page.locator("#message textarea").fill("again")
            page.locator("#message textarea").press("Enter")
            deadline = time.time() + 30
            while "not valid JSON" not in page.locator("#stats").inner_text() and time.time() < deadline:
                time.sleep(0.1)
            assert "Tools is not valid JSON" in page.locator("#stats").inner_text()
            browser.close()
    finally:
        code, out = server.stop()
    assert code == 0 and "Traceback" not in out, out
