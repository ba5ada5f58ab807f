"""A chat longer than the context window: the oldest turns are dropped (never the system prompt or the last turn,
a tool call never parted from its result), on a grid so that the chat's next request drops the same turns and the
prompt cache still serves it; the API answers say so; `--context-overflow error` keeps refusing (issue 42)."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from conftest import ServerProcess, served
from edge.backends.decoder import boundary_at_or_below
from edge.decode import conversation
from edge.errors import ContextOverflowError

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic", reason="pip install -e '.[dev]' (anthropic)")

SYSTEM = {"role": "system", "content": "Be brief."}


def _chat(turns: int, tools: bool = False) -> list[dict]:
    out = [SYSTEM]
    for i in range(turns):
        out.append({"role": "user", "content": f"Question number {i}: what is the capital of Japan?"})
        if tools and i % 3 == 0:
            call = {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Japan"}'}}
            out += [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": "Tokyo"}]
        out.append({"role": "assistant", "content": "The capital of Japan is Tokyo."})
    return out


@pytest.mark.parametrize("tools", [False, True], ids=["plain", "tool-turns"])
def test_fit_drops_whole_oldest_turns_and_keeps_the_system_prompt_and_the_last_turn(tiny_generator, tools):
    tok = tiny_generator.tokenizer
    messages = _chat(30, tools) + [{"role": "user", "content": "And one more?"}]
    fitted = conversation.prompt(tok, messages, fit=(256, 32))
    assert fitted.dropped > 0 and len(fitted.ids) + 32 <= 256
    kept = [SYSTEM] + messages[1 + fitted.dropped:]
    assert kept[1]["role"] == "user"  # whole turns: a kept turn starts at a user message (no orphan tool result)
    assert conversation.prompt(tok, kept).ids == fitted.ids  # exactly the system prompt and the newest turns
    assert fitted.messages[0]["role"] == "system" and fitted.messages[0]["content"].startswith("Be brief.")
    assert fitted.messages[-1] == {"role": "user", "content": "And one more?"}


def test_a_growing_chat_drops_the_same_turns_until_it_has_grown_by_half_the_room(tiny_generator):
    """Successive requests of one chat mostly drop the same turns, so each prompt starts with the previous one
    (what the prompt cache reuses); dropping just enough would drop one more turn every request."""
    tok = tiny_generator.tokenizer
    chat, prompts, dropped = [SYSTEM], [], []
    for i in range(60):
        chat.append({"role": "user", "content": f"Hi {i}?"})  # ~12 tokens a turn: ~20 turns fit
        fitted = conversation.prompt(tok, chat, fit=(256, 16))
        prompts.append(fitted.ids)
        dropped.append(fitted.dropped)
        chat.append({"role": "assistant", "content": "Tokyo."})
    shifted = [k for k in range(1, 60) if dropped[k] and dropped[k - 1]]
    assert len(shifted) > 25 and all(d % 2 == 0 for d in dropped)  # user + answer pairs
    same = [k for k in shifted if dropped[k] == dropped[k - 1]]
    assert len(same) >= 4 * (len(shifted) - len(same)), dropped  # at least 4 of 5 shifted requests keep the drop
    assert all(prompts[k][:len(prompts[k - 1])] == prompts[k - 1] for k in same)


def test_the_last_turn_alone_too_long_is_still_an_error(tiny_generator):
    tok = tiny_generator.tokenizer
    with pytest.raises(ContextOverflowError, match="the last turn alone"):
        conversation.prompt(tok, [SYSTEM, {"role": "user", "content": "Tokyo " * 400}], fit=(256, 16))
    with pytest.raises(ContextOverflowError, match="ask for fewer"):
        conversation.prompt(tok, [SYSTEM, {"role": "user", "content": "hi"}], fit=(256, 300))
    with pytest.raises(ContextOverflowError, match="the system prompt alone"):  # nothing else to drop (was a 500)
        conversation.prompt(tok, [{"role": "system", "content": "Tokyo " * 400}], fit=(256, 16))


@pytest.fixture(scope="module")
def server(tiny_bundle):
    """The fused int8 engine (the prompt cache runs on fused graphs), 256-token context, default overflow: shift."""
    yield from served(tiny_bundle.root, "--engine", "int8-dynamic", "--max-users", "4", "--no-ui")


@pytest.fixture(scope="module")
def strict_server(tiny_bundle):
    yield from served(tiny_bundle.root, "--engine", "int8-dynamic", "--max-users", "2", "--no-ui",
                      "--context-overflow", "error")


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_40_turn_chat_never_errors_keeps_the_system_prompt_and_says_when_it_shifted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat, answers = [SYSTEM], []
    for i in range(40):
        chat.append({"role": "user", "content": f"Question {i}: tell me a fun fact about the ocean."})
        r = client.chat.completions.create(model="x", messages=chat, max_tokens=8, temperature=0)
        answers.append(r)
        chat.append({"role": "assistant", "content": r.choices[0].message.content})
    shifts = [(r.model_extra or {}).get("context_shift", {}).get("dropped_messages", 0) for r in answers]
    assert shifts[0] == 0 and "context_shift" not in (answers[0].model_extra or {})
    assert sum(1 for d in shifts if d) > 25, shifts  # 256 tokens hold about 7 of these turns
    # what was kept is the system prompt and the newest messages: asking with exactly those gives the same answer
    last, n = answers[-1], shifts[-1]
    kept = [SYSTEM] + chat[1 + n:-1]
    again = client.chat.completions.create(model="x", messages=kept, max_tokens=8, temperature=0)
    assert "context_shift" not in (again.model_extra or {})
    assert again.choices[0].message.content == last.choices[0].message.content
    assert again.usage.prompt_tokens == last.usage.prompt_tokens
    # the prompt cache keeps working: a shifted request that drops what the one before it dropped reuses that
    # whole prompt (up to its last prefill boundary), not only the system prompt
    pairs = [k for k in range(1, 40) if shifts[k] and shifts[k] == shifts[k - 1]]
    assert len(pairs) >= 10, shifts
    system_only = httpx.post(server.url + "/v1/messages/count_tokens", json={
        "model": "x", "system": SYSTEM["content"], "messages": [{"role": "user", "content": "x"}]}).json()
    for k in pairs:
        cached = answers[k].usage.prompt_tokens_details.cached_tokens
        assert cached == boundary_at_or_below(answers[k - 1].usage.prompt_tokens), (k, cached)
    # (the cache reuses up to a fixed prefill boundary: 16, 32, 64, 128; past the system prompt's from 64 on)
    beyond = [k for k in pairs if answers[k].usage.prompt_tokens_details.cached_tokens >
              boundary_at_or_below(system_only["input_tokens"])]
    assert len(beyond) >= 5, [answers[k].usage.prompt_tokens_details.cached_tokens for k in pairs]
    assert _metric(server, "edgechat_prompt_tokens_cached_total") >= sum(
        answers[k].usage.prompt_tokens_details.cached_tokens for k in pairs)


def _long_chat() -> list[dict]:
    return _chat(20) + [{"role": "user", "content": "And one more?"}]


def test_streams_and_the_anthropic_route_say_so_too(server):
    body = {"model": "x", "messages": _long_chat(), "max_tokens": 8, "temperature": 0}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    n = whole["context_shift"]["dropped_messages"]
    assert n > 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["context_shift"] == {"dropped_messages": n}
    assert all("context_shift" not in c for c in chunks[1:])
    # Anthropic's route: the system prompt is top-level there, so the same chat drops the same messages
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msgs = _long_chat()[1:]
    msg = client.messages.create(model="x", max_tokens=8, system=SYSTEM["content"], messages=msgs,
                                 extra_body={"temperature": 0})
    assert msg.model_extra["context_shift"] == {"dropped_messages": n}
    assert "".join(b.text for b in msg.content) == whole["choices"][0]["message"]["content"]
    with client.messages.stream(model="x", max_tokens=8, system=SYSTEM["content"], messages=msgs,
                                extra_body={"temperature": 0}) as stream:
        start = next(ev for ev in stream if ev.type == "message_start")
        assert start.message.model_extra["context_shift"] == {"dropped_messages": n}


def test_context_overflow_error_still_refuses_and_raw_prompts_always_do(server, strict_server):
    body = {"model": "x", "messages": _long_chat(), "max_tokens": 8}
    r = httpx.post(strict_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(strict_server.url + "/v1/messages", json={**body, "messages": body["messages"][1:]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Tokyo " * 300, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # shift or not, a last message that alone does not fit is refused, naming what to do
    huge = {"model": "x", "messages": [SYSTEM, {"role": "user", "content": "Tokyo " * 300}], "max_tokens": 8}
    r = httpx.post(server.url + "/v1/chat/completions", json=huge, timeout=60)
    assert r.status_code == 400 and "shorten it" in r.json()["error"]["message"], r.text


# -- the page, in a real headless Chromium -------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STORE = "edgechat-chats-v1"  # the page's localStorage key (edge.serve.webui.STORE_KEY)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (apt-get install chromium)")
def test_a_40_turn_chat_on_the_page_never_errors_keeps_the_system_prompt_and_notes_each_shift(tiny_bundle):
    """40 turns typed into the page (256-token context: about 7 of these turns fit): every answer comes with its
    stats line, the shifted ones say how many old messages were dropped, the chat the browser keeps is whole (the
    page drops turns only from what the model gets), and the last answer's prompt is the one the API makes of the
    same chat (the system prompt and the newest turns: test_a_40_turn_chat_never_errors... above)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    s = ServerProcess(tiny_bundle.root, "--engine", "int8-dynamic", "--max-users", "2")
    bots = "#chatbot [data-testid='bot']"
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(s.url + "/", wait_until="load")
            page.wait_for_selector("#message textarea:not([disabled])", timeout=30_000)
            page.get_by_text("Settings").click()
            for label, value in (("Max new tokens", "8"), ("Temperature (0 = greedy)", "0")):
                page.get_by_label(f"number input for {label}").fill(value)
                page.get_by_label(f"number input for {label}").press("Enter")
            page.locator("#system textarea").fill(SYSTEM["content"])
            for i in range(40):
                page.locator("#message textarea").fill(f"Question {i}: tell me a fun fact about the ocean.")
                page.locator("#message textarea").press("Enter")
                page.wait_for_function(  # the new answer is whole: its stats line drawn, the status line final
                    "n => { const b = document.querySelectorAll(\"#chatbot [data-testid='bot']\");"
                    " return b.length == n && b[n - 1].querySelector('.answer-stats') !== null"
                    " && document.querySelector('#stats').innerText.includes('tok/s'); }", arg=i + 1, timeout=60_000)
                status = page.locator("#stats").inner_text()
                assert "rror" not in status and "too long" not in status, (i, status)
            last_note = page.locator(bots).last.locator(".answer-stats").inner_text()
            page.wait_for_timeout(500)  # the chat's save to localStorage runs after the answer's event
            store = page.evaluate(f"JSON.parse(localStorage.getItem({json.dumps(STORE)}))")
            browser.close()
        chat = next(c for c in store["chats"] if c["id"] == store["current"])
        assert chat["system"] == SYSTEM["content"] and len(chat["messages"]) == 80  # the whole chat is kept
        answers = [m for m in chat["messages"] if m["role"] == "assistant"]
        noted = [next((int(re.search(r"dropped (\d+)", n).group(1)) for n in m.get("notes", []) if "dropped" in n), 0)
                 for m in answers]
        assert noted[0] == 0 and sum(1 for d in noted if d) > 25, noted
        assert f"dropped {noted[-1]} old message(s) to fit the context" in last_note, last_note
        # the last answer: the API's shift of the same chat drops as many messages and gives the same answer
        convo = [SYSTEM] + [{"role": m["role"], "content": m["content"]} for m in chat["messages"][:-1]]
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "x", "messages": convo, "max_tokens": 8,
                                                             "temperature": 0}, timeout=60).json()
        assert r["context_shift"]["dropped_messages"] == noted[-1]
        assert r["choices"][0]["message"]["content"] == answers[-1]["content"]
    finally:
        code, out = s.stop()
    assert code == 0 and "Traceback" not in out, out
