"""Anthropic's Messages API (`POST /v1/messages`) on `edge-chat serve` as a real subprocess, through the official
`anthropic` client: plain and streamed answers (the event sequence as Anthropic sends it), a forced tool call and
its tool_result turn, stop sequences, every error as Anthropic's error object, x-api-key auth, a full queue, and
the same answers as the OpenAI route under mixed concurrent load (one pipeline)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ServerProcess, served

anthropic = pytest.importorskip("anthropic", reason="pip install -e '.[dev]' (anthropic)")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ASK = [{"role": "user", "content": "Tell me a fun fact."}]
GREEDY = {"temperature": 0}  # anthropic 2.x sends no sampling fields (Anthropic's newer models take none); others do
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tokyo", "Paris"]},
                                                             "unit": {"type": "string", "enum": ["C", "F"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Add two small numbers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["a", "b"], "additionalProperties": False}}
# Anthropic's stream: message_start, then each block's start, deltas and stop, message_delta, message_stop;
# ping may come anywhere after message_start (docs.claude.com, "Streaming Messages")
SEQUENCE = re.compile(r"message_start (ping )*((content_block_start (ping )*(content_block_delta (ping )*)+"
                      r"content_block_stop (ping )*)*)message_delta (ping )*message_stop $")


@pytest.fixture(scope="module")
def server(tiny_bundle):
    yield from served(tiny_bundle.root, "--engine", "fp32", "--max-users", "8", "--no-ui")


@pytest.fixture(scope="module")
def long_server(long_bundle):
    """The 4k-context model: the tools' fallback prompt alone is ~800 of the small tokenizer's tokens."""
    yield from served(long_bundle.root, "--max-users", "4", "--no-ui")


def _client(server, **kw) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def _raw_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(SSE event name, data) of a streamed answer, read off the wire."""
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=120,
                      headers={"anthropic-version": "2023-06-01", **(headers or {})}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_plain_answer_in_anthropics_shape_equals_the_openai_routes(server):
    client = _client(server)
    msg = client.messages.create(model="claude-anything", max_tokens=20, system="You are terse.", extra_body=GREEDY,
                                 messages=ASK, metadata={"user_id": "u1"})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == "tiny-llama"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.output_tokens == (20 if msg.stop_reason == "max_tokens" else msg.usage.output_tokens) > 0
    counted = client.messages.count_tokens(model="x", system="You are terse.", messages=ASK)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens > 5
    # the same conversation through /v1/chat/completions: the same prompt, the same answer (one pipeline), greedy
    # and sampled with a seed (so the answer is not a degenerate one a broken prompt could give as well)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    system = [{"role": "system", "content": "You are terse."}]
    same = oa.chat.completions.create(model="x", max_tokens=20, temperature=0, messages=system + ASK)
    assert same.choices[0].message.content == _text(msg)
    assert same.usage.prompt_tokens == counted.input_tokens
    sampled = client.messages.create(model="x", max_tokens=20, system="You are terse.", messages=ASK,
                                     extra_body={"temperature": 0.9, "seed": 11})
    assert _text(sampled) == oa.chat.completions.create(model="x", max_tokens=20, temperature=0.9, seed=11,
                                                        messages=system + ASK).choices[0].message.content
    assert _text(sampled) != oa.chat.completions.create(model="x", max_tokens=20, temperature=0.9, seed=11,
                                                        messages=ASK).choices[0].message.content
    # system as text blocks (cache_control accepted), content as blocks, consecutive user turns combined
    blocks = client.messages.create(model="x", max_tokens=20, extra_body=GREEDY,
                                    system=[{"type": "text", "text": "You are terse.",
                                             "cache_control": {"type": "ephemeral"}}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}])
    assert _text(blocks) == _text(msg)


def test_streamed_answer_follows_anthropics_event_sequence(server):
    body = {"model": "x", "max_tokens": 16, "temperature": 0, "messages": ASK}
    events = _raw_events(server, body)
    names = [e for e, _ in events]
    assert SEQUENCE.fullmatch("".join(n + " " for n in names)), names
    assert all(data["type"] == name for name, data in events)  # the event name is the data's type
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 5
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0
    # the client's own accumulation equals the whole answer
    client = _client(server)
    kw = {"model": "x", "max_tokens": 16, "messages": ASK, "extra_body": GREEDY}  # the client sends no temperature
    with client.messages.stream(**kw) as stream:
        got = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert "message_stop" in got
    whole = client.messages.create(**kw)
    assert _text(final) == _text(whole) == "".join(d["text"] for d in deltas)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_end_the_answer_and_are_named(server):
    client = _client(server)
    full = _text(client.messages.create(model="x", max_tokens=30, messages=ASK, extra_body=GREEDY))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3
    cut = client.messages.create(model="x", max_tokens=30, messages=ASK, extra_body=GREEDY,
                                 stop_sequences=["never-there", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == full[:full.find(stop)]
    events = _raw_events(server, {"model": "x", "max_tokens": 30, "temperature": 0, "messages": ASK,
                                  "stop_sequences": [stop]})
    delta = next(d for n, d in events if n == "message_delta")["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_a_final_assistant_message_is_the_start_of_the_answer(server):
    client = _client(server)
    n = client.messages.count_tokens(model="x", messages=ASK).input_tokens
    prefilled = ASK + [{"role": "assistant", "content": "Octopuses"}]
    assert client.messages.count_tokens(model="x", messages=prefilled).input_tokens > n
    msg = client.messages.create(model="x", max_tokens=8, messages=prefilled, extra_body=GREEDY)
    assert msg.usage.output_tokens > 0 and not _text(msg).startswith("Octopuses")


def test_errors_are_anthropic_error_objects(server):
    client = _client(server)

    def refused(status: int, kind: str, words: str, **kw) -> None:
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(**{"model": "x", "max_tokens": 8, "messages": ASK, **kw})
        assert e.value.status_code == status, e.value
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == kind, e.value.body
        assert words in e.value.body["error"]["message"], e.value.body

    url = server.url + "/v1/messages"
    r = httpx.post(url, json={"model": "x", "messages": ASK}, timeout=30)  # the client refuses to send it
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": r.json()["error"]["message"]}}
    assert "'max_tokens' is required" in r.json()["error"]["message"]
    refused(400, "invalid_request_error", "'messages[0].role' must be \"user\" or \"assistant\"",
            messages=[{"role": "system", "content": "hi"}])
    refused(400, "invalid_request_error", "'image' blocks are not supported",
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                             "media_type": "image/png", "data": "AA=="}}]}])
    refused(400, "invalid_request_error", "'temperature' must be a finite number from 0 to 1",
            extra_body={"temperature": 1.5})
    refused(400, "invalid_request_error", "lower max_tokens", max_tokens=5000)  # past the 256-token context
    refused(400, "invalid_request_error", "no earlier assistant message has a tool_use block",
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])
    refused(400, "invalid_request_error", "'tool_choice' names 'nope'", tools=[WEATHER],
            tool_choice={"type": "tool", "name": "nope"})
    refused(400, "invalid_request_error", "'thinking' is not available",
            thinking={"type": "enabled", "budget_tokens": 1024})
    # adaptive: the model decides whether to think; this one does not (no thinking block, no error)
    assert [b.type for b in client.messages.create(model="x", max_tokens=2, messages=ASK,
                                                   thinking={"type": "adaptive"}).content] in (["text"], [])
    refused(400, "invalid_request_error", "'container' is not supported", extra_body={"container": "c1"})
    # any model name is served (one model per server), as on the OpenAI route
    assert client.messages.create(model="claude-opus-4-1", max_tokens=2, messages=ASK).model == "tiny-llama"
    for method, path, status, kind in (("POST", "/v1/messages", 400, "invalid_request_error"),  # not JSON
                                       ("GET", "/v1/messages", 405, "invalid_request_error"),
                                       ("POST", "/v1/messages/batches", 404, "not_found_error"),
                                       ("POST", "/V1/messages", 404, "not_found_error")):
        r = httpx.request(method, server.url + path, content=b"{not json", timeout=30)
        assert r.status_code == status and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == kind and r.json()["error"]["message"], (path, r.text)
    # the OpenAI routes keep OpenAI's error object
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "messages"


def test_x_api_key_auth_and_a_full_queue(tiny_bundle):
    s = ServerProcess(tiny_bundle.root, "--engine", "fp32", "--max-users", "1", "--max-queue", "1", "--no-ui",
                      "--auth", "admin:s3cret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as e:
            _client(s, api_key="wrong").messages.create(model="x", max_tokens=2, messages=ASK)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": e.value.body["error"]["message"]}}
        assert "x-api-key" in e.value.body["error"]["message"]
        assert _client(s, api_key="s3cret").messages.create(model="x", max_tokens=2, messages=ASK).content
        bearer = anthropic.Anthropic(base_url=s.url, auth_token="s3cret", max_retries=0)
        assert bearer.messages.count_tokens(model="x", messages=ASK).input_tokens > 5
        go = threading.Barrier(6)

        def one(i: int) -> httpx.Response:
            go.wait()
            path = "/v1/messages" if i % 2 else "/v1/chat/completions"
            return httpx.post(s.url + path, json={"model": "x", "messages": ASK, "max_tokens": 200},
                              headers={"x-api-key": "s3cret", "anthropic-version": "2023-06-01"}, timeout=60)

        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(one, range(6)))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and (529 in codes or 429 in codes), codes
        for i, r in enumerate(rs):
            if i % 2 and r.status_code != 200:  # Anthropic: 529 overloaded_error, retried after Retry-After
                assert r.status_code == 529 and int(r.headers["retry-after"]) >= 1, r.text
                assert r.json()["error"]["type"] == "overloaded_error" and "busy" in r.json()["error"]["message"]
            elif r.status_code != 200:  # OpenAI: 429 with its own error object
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    finally:
        code, out = s.stop()
    assert code == 0, out


def test_mixed_load_with_the_openai_route_gives_each_its_solo_answer(server):
    """Anthropic and OpenAI requests, streamed and whole, at once: each answer equals the one it gets alone (the two
    routes share the scheduler's batched steps). Sampled with a seed (EdgeChat's extension on /v1/messages), so
    the answers differ from one another and any change to a row's logits would show; greedy too."""
    client = _client(server)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [f"Question {i}: what is the capital of Japan?" for i in range(12)]

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": prompts[i]}]
        how = {"temperature": 0.9, "seed": 100 + i} if i < 8 else {"temperature": 0}
        if i % 4 == 0:
            return _text(client.messages.create(model="x", max_tokens=24, messages=messages, extra_body=how))
        if i % 4 == 1:
            with client.messages.stream(model="x", max_tokens=24, messages=messages, extra_body=how) as st:
                return "".join(st.text_stream)
        if i % 4 == 2:
            return oa.chat.completions.create(model="x", max_tokens=24, messages=messages,
                                              **how).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            model="x", max_tokens=24, messages=messages, stream=True, **how) if c.choices)

    alone = [ask(i) for i in range(len(prompts))]
    go = threading.Barrier(len(prompts))

    def together(i: int) -> str:
        go.wait()
        return ask(i)

    with ThreadPoolExecutor(len(prompts)) as pool:
        mixed = list(pool.map(together, range(len(prompts))))
    assert mixed == alone
    assert len(set(alone[:8])) == 8  # the sampled answers differ: a mix-up between rows would show


def test_a_forced_tool_call_and_its_tool_result(long_server):
    client = _client(long_server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model="x", max_tokens=100, messages=ask, tools=[WEATHER, ADD], extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use", msg
    use = next(b for b in msg.content if b.type == "tool_use")
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    # the result goes back as a tool_result block; the model answers in text
    turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": json.dumps({"temperature": 18})}]}]
    final = client.messages.create(model="x", max_tokens=20, messages=turn, tools=[WEATHER, ADD], extra_body=GREEDY,
                                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens") and _text(final)
    assert all(b.type == "text" for b in final.content)
    # streamed, tool_choice any: the call comes as a tool_use block, its input as input_json_delta pieces as the
    # arguments are written (the block opens once the name is written)
    body = {"model": "x", "max_tokens": 100, "temperature": 0.8, "messages": ask, "tools": [WEATHER, ADD],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    events = _raw_events(long_server, body)
    assert SEQUENCE.fullmatch("".join(n + " " for n, _ in events)), [n for n, _ in events]
    start = next(d for n, d in events if n == "content_block_start" and d["content_block"]["type"] == "tool_use")
    assert start["content_block"]["input"] == {} and start["content_block"]["name"] in ("get_weather", "add")
    parts = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
             and d["index"] == start["index"]]
    tool = {"get_weather": WEATHER, "add": ADD}[start["content_block"]["name"]]
    jsonschema.validate(json.loads("".join(parts)), tool["input_schema"])
    assert len(parts) > 2 and all(parts), parts
    assert next(d for n, d in events if n == "message_delta")["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY) as stream:
        final_streamed = stream.get_final_message()
    whole = client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    assert [(b.type, b.name, b.input) for b in final_streamed.content] == [(b.type, b.name, b.input)
                                                                            for b in whole.content]
    assert final_streamed.stop_reason == whole.stop_reason == "tool_use"


def test_every_anthropic_case_under_concurrent_load_with_the_openai_routes(long_server):
    """The issue's list at once, from threads, through both official clients: Anthropic's plain and streamed
    answers (the raw event sequence), a forced tool call and its tool_result turn, errors as Anthropic error
    objects; OpenAI's plain, streamed and tool-call answers beside them. Each gives what it gives alone."""
    client = _client(long_server)
    oa = openai.OpenAI(base_url=long_server.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    seeded = {"temperature": 0.9, "seed": 5}

    def tool_turn() -> tuple:
        msg = client.messages.create(model="x", max_tokens=100, messages=ask, tools=[WEATHER, ADD], extra_body=GREEDY,
                                     tool_choice={"type": "tool", "name": "get_weather"})
        use = next(b for b in msg.content if b.type == "tool_use")
        turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
        final = client.messages.create(model="x", max_tokens=12, messages=turn, tools=[WEATHER, ADD],
                                       extra_body=GREEDY)
        return msg.stop_reason, use.name, use.input, final.stop_reason, _text(final)

    def streamed() -> tuple:
        events = list(client.messages.create(model="x", max_tokens=16, messages=ASK, stream=True, extra_body=seeded))
        names = "".join(e.type + " " for e in events)
        assert SEQUENCE.fullmatch(names), names
        return names, "".join(e.delta.text for e in events if e.type == "content_block_delta")

    def error() -> tuple:
        out = []
        for kw in ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, {"max_tokens": 5000},  # past the 4k context
                   {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}):
            with pytest.raises(anthropic.BadRequestError) as e:
                client.messages.create(**{"model": "x", "max_tokens": 8, "messages": ASK, **kw})
            assert set(e.value.body) == {"type", "error"} and e.value.body["type"] == "error"
            out.append((e.value.status_code, e.value.body["error"]["type"], e.value.body["error"]["message"]))
        return tuple(out)

    def openai_tool() -> tuple:
        r = oa.chat.completions.create(model="x", max_tokens=100, messages=ask, temperature=0,
                                       tools=[{"type": "function", "function": {"name": t["name"],
                                                                                "parameters": t["input_schema"]}}
                                              for t in (WEATHER, ADD)], tool_choice="required",
                                       parallel_tool_calls=False)
        call = r.choices[0].message.tool_calls[0].function
        return r.choices[0].finish_reason, call.name, json.loads(call.arguments)

    cases = {
        "anthropic plain": lambda: _text(client.messages.create(model="x", max_tokens=16, messages=ASK,
                                                                extra_body=seeded)),
        "anthropic streamed": streamed,
        "anthropic tool turn": tool_turn,
        "anthropic errors": error,
        "openai plain": lambda: oa.chat.completions.create(model="x", max_tokens=16, messages=ASK,
                                                           **seeded).choices[0].message.content,
        "openai streamed": lambda: "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            model="x", max_tokens=16, messages=ASK, stream=True, **seeded) if c.choices),
        "openai tool call": openai_tool,
    }
    alone = {name: fn() for name, fn in cases.items()}
    assert alone["anthropic tool turn"][:2] == ("tool_use", "get_weather"), alone
    assert alone["anthropic tool turn"][3] in ("end_turn", "max_tokens") and alone["anthropic tool turn"][4]
    assert [e[:2] for e in alone["anthropic errors"]] == [(400, "invalid_request_error")] * 3
    assert alone["anthropic plain"] == alone["openai plain"] == alone["anthropic streamed"][1] \
        == alone["openai streamed"]  # one pipeline: the same seeded answer on both routes
    assert alone["openai tool call"][0] == "tool_calls"
    jobs = list(cases.items()) * 2  # each case twice, all at once
    go = threading.Barrier(len(jobs))

    def together(job) -> tuple:
        go.wait()
        return job[0], job[1]()

    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(together, jobs))
    for name, got in mixed:
        assert got == alone[name], (name, got, alone[name])
