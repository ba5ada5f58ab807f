"""A chat longer than the context window: the oldest turns are dropped (never the system prompt or the last turn,
a tool call never parted from its result), on a grid so that the chat's next request drops the same turns and the
prompt cache still serves it; the API answers say so; `--context-overflow error` keeps refusing (issue 42)."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import served
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
