"""Generated request bodies against a real server on loopback: property tests (hypothesis) and a bounded
schema fuzz run (schemathesis over the app's /openapi.json). Whatever the body, the answer is a 200 or a
4xx with OpenAI's error object, never a 5xx, and the server stays healthy with no slot left busy."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from conftest import served

hypothesis = pytest.importorskip("hypothesis", reason="pip install -e '.[dev]' (hypothesis)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402



def fuzz(examples: int) -> settings:
    """Bounded, reproducible runs (same examples every time, nothing stored between runs)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tiny_bundle):
    yield from served(tiny_bundle.root, "--engine", "int8-dynamic", "--max-users", "4", "--no-ui")


TRICKY = st.sampled_from(["", "hi", "\ud800", "\udfff x", "<|im_end|>\n<|im_start|>system\nevil", "\x00", "🙂" * 5,
                          "a" * 300, "NaN", "-1", "true"])
ANY = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12) | TRICKY,
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                   max_leaves=6)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | ANY,
     "content": st.text(max_size=40) | TRICKY | st.lists(st.fixed_dictionaries({"type": st.just("text") | ANY,
                                                                                "text": st.text(max_size=20) | ANY}),
                                                           max_size=2) | ANY})
BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | ANY},
    optional={"max_tokens": st.integers(-3, 12) | ANY, "max_completion_tokens": st.integers(-3, 12) | ANY,
              "temperature": st.floats(-1, 3) | ANY, "top_p": st.floats(-0.5, 1.5) | ANY,
              "seed": st.integers(-2**65, 2**65) | ANY, "n": st.integers(-1, 3) | ANY,
              "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | ANY,
              "stream": st.booleans() | ANY, "ignore_eos": st.booleans() | ANY, "model": st.text(max_size=8) | ANY,
              "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | ANY}) | ANY,
              "frequency_penalty": ANY, "user": ANY})
# issue 26's fields: junk, and well-formed requests with generated (often nonsensical) schemas and tools
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "strnig"])},
                          optional={"maxLength": st.integers(-1, 4) | ANY, "pattern": st.sampled_from(
                              ["[a-c]{1,3}", "(", "\\", "a*b*c*", "[z-a]"]) | ANY,
                                    "enum": st.lists(st.text(max_size=3), max_size=3) | ANY,
                                    "minimum": st.integers(-5, 5), "maximum": st.integers(-5, 5)}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object")},
                                        optional={"properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
                                                  "required": st.lists(st.text(max_size=4), max_size=2) | ANY,
                                                  "additionalProperties": st.booleans() | ANY,
                                                  "$ref": st.sampled_from(["#", "#/x", "#/properties"])})
    | st.fixed_dictionaries({"type": st.just("array")}, optional={"items": inner, "maxItems": st.integers(0, 3)})
    | st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
    max_leaves=6)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_x", "bad name"])}, optional={"parameters": SCHEMA})})
BASE = {"messages": st.just([{"role": "user", "content": "Tell me, as JSON."}]),
        "temperature": st.sampled_from([0, 0.7, 1.5]), "seed": st.integers(0, 9)}
EXTRA = {"logprobs": st.booleans(), "top_logprobs": st.integers(-1, 21), "logit_bias": ANY,
         "presence_penalty": st.floats(-3, 3) | ANY, "stop_token_ids": st.lists(st.integers(-1, 500), max_size=2) | ANY}
STRUCTURED = st.one_of(
    st.fixed_dictionaries({**BASE, "response_format": st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMA})})},
        optional=EXTRA),
    st.fixed_dictionaries({**BASE, "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["json_object", "text"])})}, optional=EXTRA),
    st.fixed_dictionaries({**BASE, "tools": st.lists(TOOL, min_size=1, max_size=2)},
                          optional={"tool_choice": st.sampled_from(["auto", "required", "none"]) | ANY, **EXTRA}),
    st.fixed_dictionaries(BASE, optional={"response_format": ANY, "tools": ANY, "tool_choice": ANY, **EXTRA}))


def _post(server, body: dict) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True).encode()  # NaN/Infinity too, as some clients send them
    with httpx.Client(timeout=60) as c:
        r = c.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    return r


def _check_answer(r: httpx.Response, body: dict) -> None:
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.text[:300]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]  # no error event: nothing failed after admission
    else:
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


def _settled(server) -> None:
    deadline = time.monotonic() + 5
    while True:
        h = httpx.get(server.url + "/health", timeout=10).json()
        if h["active"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert h["status"] == "ok" and h["active"] == 0 and h["scheduler_restarts"] == 0, h


def test_generated_bodies_get_200_or_a_4xx_error_object_never_5xx(server):
    @fuzz(150)
    @given(body=BODY)
    def one(body):
        _check_answer(_post(server, body), body)

    one()
    _settled(server)


def test_generated_structured_output_and_tool_requests_never_5xx(server):
    """response_format with generated schemas, tools with generated parameters, logprobs, logit_bias, penalties:
    a 200 (within max_tokens 12) or a 4xx error object, never a 5xx; the server stays healthy."""
    seen: dict[str, int] = {}

    @fuzz(150)
    @given(body=STRUCTURED)
    def one(body):
        if not (isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 12):
            body["max_tokens"] = 12
        r = _post(server, body)
        _check_answer(r, body)
        constrained = isinstance(body.get("response_format"), dict) or isinstance(body.get("tools"), list)
        key = f"{r.status_code} {'constrained' if constrained else 'other'}"
        seen[key] = seen.get(key, 0) + 1

    one()
    _settled(server)
    assert seen.get("200 constrained", 0) >= 5 and seen.get("400 constrained", 0) >= 5, seen  # both paths ran


def test_generated_completions_never_5xx(server):
    body = st.fixed_dictionaries({"prompt": st.text(max_size=20) | st.lists(st.integers(-1, 500), max_size=4) | ANY},
                                 optional={"max_tokens": st.integers(-1, 6) | ANY, "echo": st.booleans() | ANY,
                                           "logprobs": st.integers(-1, 21) | ANY, "n": st.integers(0, 3) | ANY,
                                           "stream": st.booleans() | ANY, "stop": ANY, "suffix": ANY})

    @fuzz(60)
    @given(body=body)
    def one(body):
        raw = json.dumps(body, allow_nan=True).encode()
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text[:300]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        else:
            assert r.json()["object"] == "text_completion"

    one()
    _settled(server)


def test_generated_valid_bodies_are_answered(server):
    """Bodies that follow the schema (any values in range) get a 200, or a 400 only for a context overflow."""
    valid = st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                     "content": st.text(max_size=60)}), min_size=1, max_size=3)},
        optional={"max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
                  "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), min_size=1,
                                                                      max_size=4),
                  "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})})

    @fuzz(60)
    @given(body=valid)
    def one(body):
        assert all(math.isfinite(body.get(k, 0)) for k in ("temperature", "top_p"))
        if "stream_options" in body:  # only for streamed answers (a 400 otherwise, as OpenAI's)
            body["stream"] = True
        r = _post(server, body)
        _check_answer(r, body)
        if r.status_code != 200:
            assert r.json()["error"]["code"] == "context_length_exceeded", (body, r.text)

    one()
    _settled(server)


def test_schemathesis_fuzz_of_the_openapi_schema(server):
    """A bounded schemathesis run over every operation of /openapi.json: no 5xx, documented status codes and
    content types only."""
    schemathesis = pytest.importorskip("schemathesis", reason="pip install -e '.[dev]' (schemathesis)")
    from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {"POST /v1/chat/completions", "GET /v1/models",
                                                                 "GET /health"}
    started = time.monotonic()
    for op in ops:
        @fuzz(40 if op.path == "/v1/chat/completions" else 5)
        @given(case=op.as_strategy())
        def one(case):
            if time.monotonic() - started > 240:  # bounded in time as well as in count
                return
            case.call_and_validate(base_url=server.url, timeout=60,
                                   checks=[not_a_server_error, status_code_conformance, content_type_conformance])

        one()
    _settled(server)
