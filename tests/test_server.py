"""`edge-chat serve` as a real subprocess: the official openai client, concurrency, bad input, 429, auth, SIGTERM."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ServerProcess, run_cli, served
from edge.backends.decoder import boundary_at_or_below

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_bundle):
    yield from served(tiny_bundle.root, "--engine", "fp32", "--max-users", "8", "--no-ui")


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def _stream(client, prompt: str, seed: int, max_tokens: int = 40) -> tuple[str, str | None]:
    parts, finish = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                stream=True, max_tokens=max_tokens, temperature=0.9, seed=seed):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_openai_client_streams_and_completes(server):
    client = _client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    text, finish = _stream(client, "Tell me a fun fact.", seed=7, max_tokens=30)
    full = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Tell me a fun fact."}],
                                          max_tokens=30, temperature=0.9, seed=7)
    assert full.choices[0].message.content == text and text
    assert full.choices[0].finish_reason == finish == "length"
    assert full.usage.completion_tokens == 30 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + 30
    # a stop string cuts the answer before it
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Tell me a fun fact."}],
                                         max_tokens=30, temperature=0.9, seed=7, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.find(stop)]


def test_stream_usage_chunk_and_done(server):
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_sixteen_concurrent_streams_each_get_their_own_answer(server):
    client = _client(server)
    prompts = [f"Question {i}: what is the capital of Japan?" for i in range(16)]
    alone = [_stream(client, p, seed=100 + i) for i, p in enumerate(prompts)]
    steps_before = _metric(server, "edgechat_decode_steps_total")
    start = threading.Barrier(16)

    def one(i):
        start.wait()
        return _stream(client, prompts[i], seed=100 + i)

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, range(16)))
    assert together == alone  # no lost, crossed or reordered tokens
    assert len(set(t for t, _ in alone)) > 8  # the answers really differ from each other
    steps = _metric(server, "edgechat_decode_steps_total") - steps_before
    assert steps < 16 * 40 / 2, f"{steps} decode steps for 16x40 tokens: requests were not batched"


def test_server_frees_clients_that_hang_up(long_bundle):
    # the wider 4k-context model: 2000 tokens take seconds, so a hang-up always lands mid-answer
    # (on the 64-wide model 200 tokens could finish before a busy CI machine delivered the hang-up)
    server = ServerProcess(long_bundle.root, "--max-users", "4", "--no-ui")
    try:
        url = server.url + "/v1/chat/completions"
        for _ in range(4):
            with httpx.stream("POST", url, json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 2000,
                                                 "ignore_eos": True, "stream": True}, timeout=30) as r:
                for i, _line in enumerate(r.iter_lines()):
                    if i > 3:
                        break
        deadline = time.monotonic() + 10  # the server notices a hang-up at its next write
        while _requests(server, "cancelled") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        metrics = httpx.get(server.url + "/metrics").text
        assert _requests(server, "cancelled") == 4, metrics
        assert _requests(server, "length") == 0, metrics
        assert _metric(server, "edgechat_active_requests") == 0
        # and the freed slots serve the next client at once
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        code, out = server.stop()
    assert code == 0, out


def test_server_survives_bad_input(server):
    url = server.url + "/v1/chat/completions"
    bad = {
        "not json": (b"{not json", 400, "not valid JSON"),
        "no messages": (json.dumps({"model": "x"}).encode(), 400, "messages"),
        "bad role": (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "role"),
        "n=17": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 17}).encode(), 400, "'n'"),
        "unknown field": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools_whatever": [1]}).encode(),
                          400, "'tools_whatever' is not supported"),
        "bad temperature": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
                            400, "temperature"),
        "oversize prompt": (json.dumps({"messages": [{"role": "user", "content": "Hello! " * 400}]}).encode(), 400,
                            "context"),
        "too many tokens asked": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}).encode(),
                                  400, "lower max_tokens"),
        "huge body": (b'{"messages": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, "limit"),
    }
    for what, (raw, status, words) in bad.items():
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (what, r.text)
        assert words in r.json()["error"]["message"], (what, r.text)
    # the OpenAI fields clients commonly send are taken (fields the server does not support are a 400: above)
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "frequency_penalty": 0,
                              "user": "me", "logit_bias": {}}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert _metric(server, "edgechat_active_requests") == 0
    assert server.proc.poll() is None


def _requests(server, finish: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf'^edgechat_requests_total{{finish="{finish}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_full_server_answers_429_with_retry_after_and_checks_auth(tiny_bundle):
    s = ServerProcess(tiny_bundle.root, "--engine", "fp32", "--max-users", "1", "--max-queue", "1", "--no-ui",
                      "--auth", "admin:s3cret")
    try:
        url = s.url + "/v1/chat/completions"
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error" and "--auth" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 200  # health checks need no credentials
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", auth=("admin", "s3cret")).status_code == 200  # HTTP Basic works too
        assert httpx.get(s.url + "/metrics", auth=("admin", "wrong")).status_code == 401
        client = _client(s, api_key="s3cret")
        assert client.models.list().data[0].id == "tiny-llama"
        chunks = list(client.chat.completions.create(model="x", stream=True, max_tokens=4,
                                                     messages=[{"role": "user", "content": "hi"}]))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")  # streams through the auth check
        with pytest.raises(openai.AuthenticationError):
            _client(s, api_key="wrong").models.list()
        go = threading.Barrier(6)

        def one(_):
            go.wait()
            return httpx.post(url, json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 200},
                              headers={"Authorization": "Bearer s3cret"}, timeout=60)

        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(one, range(6)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(429) >= 1 and codes.count(200) >= 1, codes
        for r in rs:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1 and "busy" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        code, out = s.stop()
    assert code == 0, out


def test_non_loopback_bind_needs_auth(tiny_bundle):
    r = run_cli("edge.cli", "serve", str(tiny_bundle.root), "--host", "0.0.0.0", timeout=60)
    assert r.returncode == 2
    assert "refusing to listen on 0.0.0.0 without --auth" in r.stderr
    r = run_cli("edge.cli", "serve", str(tiny_bundle.root), "--auth", "nopassword", timeout=60)
    assert r.returncode == 2 and "user:password" in r.stderr


def test_usage_reports_prompt_tokens_taken_from_the_prompt_cache(tiny_bundle):
    """On a fused graph the second request reuses the first one's system prompt (and the whole first turn when
    it continues that chat); usage says how many prompt tokens were cached, as OpenAI's API does."""
    s = ServerProcess(tiny_bundle.root, "--engine", "int8-dynamic", "--max-users", "2", "--no-ui")
    try:
        client = _client(s)
        turn = [{"role": "user", "content": "Tell me a fun fact about the ocean, its waves and the fish in it."}]
        first = client.chat.completions.create(model="x", messages=turn, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens > 64  # past the first prefill boundary: there is a start to reuse
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        nxt = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "Another one?"}]
        second = client.chat.completions.create(model="x", messages=nxt, max_tokens=8, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # the first turn's prompt up to its last prefill boundary (what an uncached prefill computes the same way)
        assert cached == boundary_at_or_below(first.usage.prompt_tokens) > 0
        assert _metric(s, "edgechat_prompt_tokens_cached_total") == cached
    finally:
        code, out = s.stop()
    assert code == 0, out
