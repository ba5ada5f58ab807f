"""A hostile client against a running `edge-chat serve` (issue 45): bounded in count and time, loopback only.

While a canary client streams answers the whole time (measuring the longest gap between two chunks of its
stream: another user's stall), this sends, one after another, what a hostile or broken client sends: deep
nesting in tool-call arguments, non-ASCII credentials, an unsatisfiable schema, hang-ups mid-body and mid-answer,
a 4 MB body, long echo+logprobs scoring, underflowing temperatures, stop strings inside JSON, `$defs` tools,
streamed echo, odd methods and paths, slow-loris headers, a huge Content-Length, n=16 floods, a gzip body,
a heavy schema with n=16; and on Anthropic's /v1/messages: malformed content blocks, a tool_use input nested
100k deep, huge and missing max_tokens, thinking on a model that may not think, hang-ups mid-stream and
mid-answer. Prints a table (what, status, seconds, canary stall) and writes JSON.

Exit 1 if any answer is a 5xx (our own hang-ups are not answers), the canary stalled over --max-stall seconds,
a request was not answered within its timeout, or afterwards /health is not ok, a slot is still busy, or the
same greedy request gets another answer than before.

    python scripts/hostile_client.py http://127.0.0.1:7860 [--out hostile.json] [--max-stall 1.0] [--auth PASSWORD]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

import httpx

TIMEOUT_S = 60.0  # every request is answered within this, or it counts as a failure
HI = [{"role": "user", "content": "Hello! How are you doing today?"}]


@dataclass
class Result:
    what: str
    status: str  # HTTP status, "closed" (the server closed it), "hung up" (we did)
    seconds: float
    stall_s: float  # the canary's longest gap between two chunks while this ran
    ok: bool
    note: str = ""


class Canary(threading.Thread):
    """Another user: streams answers back to back, records the gaps between chunks of each stream."""

    def __init__(self, url: str, headers: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = url, headers
        self.stop = threading.Event()
        self.gaps: list[tuple[float, float]] = []  # (time the gap ended, its length)
        self.errors: list[str] = []
        self.answers = 0

    def run(self) -> None:
        body = {"messages": HI, "max_tokens": 48, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.Client(timeout=TIMEOUT_S, headers=self.headers) as c:
            while not self.stop.is_set():
                try:
                    with c.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                        last = None
                        for line in r.iter_lines():
                            now = time.monotonic()
                            if line.startswith("data: "):
                                if last is not None:
                                    self.gaps.append((now, now - last))
                                last = now
                        if r.status_code != 200:
                            self.errors.append(f"canary got {r.status_code}")
                            time.sleep(0.5)
                    self.answers += 1
                except httpx.HTTPError as e:
                    self.errors.append(f"canary: {type(e).__name__}: {e}")
                    time.sleep(0.5)

    def stall(self, since: float) -> float:
        return max((g for t, g in self.gaps if t >= since), default=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:7860 (loopback only)")
    ap.add_argument("--out", default="hostile.json", help="where to write the JSON report")
    ap.add_argument("--max-stall", type=float, default=1.0, help="the longest canary gap allowed, seconds")
    ap.add_argument("--auth", help="the server's --auth password, if it has one")
    args = ap.parse_args()
    u = urlparse(args.url)
    if u.scheme != "http" or u.hostname not in ("127.0.0.1", "localhost", "::1"):
        print(f"error: {args.url} is not a loopback http URL; this script only talks to 127.0.0.1", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    host, port = u.hostname, u.port or 80
    headers = {"Authorization": f"Bearer {args.auth}"} if args.auth else {}
    client = httpx.Client(timeout=TIMEOUT_S, headers=headers)
    card = client.get(url + "/v1/models").json()["data"][0]
    context = int(card.get("context_length", 2048))
    greedy = {"messages": HI, "max_tokens": 24, "temperature": 0}
    before = client.post(url + "/v1/chat/completions", json=greedy).json()["choices"][0]["message"]["content"]

    canary = Canary(url, headers)
    canary.start()
    time.sleep(1.0)
    results: list[Result] = []

    def record(what: str, fn, want=lambda s: True, note: str = "") -> None:
        t0 = time.monotonic()
        try:
            status = fn()
        except httpx.TimeoutException:
            status = "timeout"
        except (httpx.HTTPError, OSError) as e:
            status = f"error: {type(e).__name__}"
        took = time.monotonic() - t0
        time.sleep(0.3)  # let the canary show a stall that ends just after
        stall = canary.stall(t0)
        code = int(status) if isinstance(status, int) else None
        ok = (code is None or code < 500) and status != "timeout" and not str(status).startswith("error") \
            and took <= TIMEOUT_S and stall <= args.max_stall and want(status)
        results.append(Result(what, str(status), round(took, 2), round(stall, 2), ok, note))
        print(f"  {what[:58]:58s} {str(status):8s} {took:6.2f} s  stall {stall:5.2f} s  {'ok' if ok else 'FAIL'}",
              flush=True)

    def post(path: str, body, **kw) -> int:
        return client.post(url + path, json=body, **kw).status_code

    def raw(data: bytes, wait_s: float = 0.3, read: bool = False) -> str | int:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
            s.sendall(data)
            if not read:
                time.sleep(wait_s)
                return "hung up"
            got = s.recv(4096)
            return int(got.split()[1]) if got.startswith(b"HTTP/") else "closed"

    def not_in(*bad):
        return lambda s: s not in bad

    schema_n = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                "$ref": "#/$defs/n"}
    obj = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    defs_tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"]}}}
    heavy = {"type": "object", "properties": {f"field_{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(40)]}
                                              for i in range(60)}, "required": [f"field_{i}" for i in range(60)]}
    ids = [(7 * i) % 200 + 10 for i in range(min(1500, context - 2))]
    print(f"hostile client against {url} ({card.get('id')}, {card.get('precision')}, context {context})")
    record("1 tool_calls arguments: 100k nested '['", lambda: post("/v1/chat/completions", {"messages": HI + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "[" * 100_000}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}],
        "max_tokens": 4}))
    for name, value in (("Bearer s3cr\\xe9t", b"Bearer s3cr\xe9t"),
                        ("Basic non-ASCII user", b"Basic " + base64.b64encode("m\u00e9:pw".encode()))):
        record(f"2 Authorization: {name}", lambda v=value: client.get(url + "/v1/models",
                                                                       headers={"Authorization": v}).status_code)
    record("3 unsatisfiable recursive json_schema", lambda: post("/v1/chat/completions", {
        "messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema_n}}}),
        want=lambda s: s == 400)
    record("4 hang-up mid-body (x3)", lambda: [raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                                 b"application/json\r\nContent-Length: 1000\r\n\r\n{\"mess")
                                             for _ in range(3)][-1])
    record("5 a 4.19 MB chat body", lambda: post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "octopus " * 524_000}], "max_tokens": 4}))
    record(f"6 completions 4x{len(ids)} ids, max_tokens 0, echo, logprobs 20", lambda: post("/v1/completions", {
        "prompt": [ids] * 4, "max_tokens": 0, "echo": True, "logprobs": 20}))
    record("6b the same, client hangs up after 1 s", lambda: _hang_up(client, url, {
        "prompt": [ids] * 4, "max_tokens": 0, "echo": True, "logprobs": 20}))
    record("7 temperature 2.9e-39 (greedy)", lambda: _same(client, url, {**greedy, "temperature": 2.9e-39}, before))
    record("7b repetition_penalty 1e-38", lambda: post("/v1/chat/completions", {**greedy, "repetition_penalty": 1e-38}),
           want=lambda s: s == 400)
    record("8 stop ',' with a json_schema", lambda: post("/v1/chat/completions", {
        "messages": HI, "stop": ",", "response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                                                "schema": obj}}}),
        want=lambda s: s == 400)
    record("8b tools with stop '\"'", lambda: post("/v1/chat/completions", {"messages": HI, "tools": [tool],
                                                                              "stop": "\""}), want=lambda s: s == 400)
    record("9 tool parameters with $defs/$ref", lambda: post("/v1/chat/completions", {
        "messages": HI, "tools": [defs_tool], "tool_choice": "required", "max_tokens": 32}),
        want=lambda s: s in (200, 400))  # 400 only for a context the tools' prompt overflows
    record("10 streamed echo, max_tokens 0", lambda: _streamed_echo(client, url))
    for method, path, want in (("HEAD", "/health", 200), ("OPTIONS", "/health", 405), ("TRACE", "/metrics", 405),
                               ("TRACE", "/v1/models", 405), ("GET", "//v1/models", 404), ("GET", "/V1/models", 404)):
        record(f"13 {method} {path}", lambda m=method, p=path: client.request(m, url + p).status_code,
               want=lambda s, w=want: s == w)
    record("14 slow loris: half the headers, then nothing", lambda: raw(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", read=True), want=lambda s: s in ("closed", 408))
    record("14b Content-Length: 10^12", lambda: raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                                   b"application/json\r\nContent-Length: 1000000000000\r\n\r\n",
                                                   read=True), want=lambda s: s == 413)
    record("15 two n=16 requests, then one small one", lambda: _flood(client, url), want=lambda s: s == 200)
    record("16 stream_options without stream", lambda: post("/v1/chat/completions", {
        "messages": HI, "stream_options": {"include_usage": True}}), want=lambda s: s == 400)
    record("16b gzip body", lambda: client.post(url + "/v1/chat/completions", content=gzip.compress(json.dumps(
        {"messages": HI}).encode()), headers={"content-type": "application/json", "content-encoding": "gzip"})
        .status_code, want=lambda s: s == 415)
    record("16c duplicate tool names", lambda: post("/v1/chat/completions", {"messages": HI, "tools": [tool, tool]}),
           want=lambda s: s == 400)
    record("17 n=16 with a heavy json_schema", lambda: post("/v1/chat/completions", {
        "messages": HI, "n": 16, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "heavy", "schema": heavy}}}))
    record("18 non-streamed client gone after 0.5 s", lambda: _hang_up(client, url, {
        "messages": HI, "max_tokens": 200, "ignore_eos": True}, path="/v1/chat/completions", after=0.5))
    _anthropic_cases(record, post, client, url, context)
    canary.stop.set()
    canary.join(TIMEOUT_S)

    deadline = time.monotonic() + 10
    while True:
        health = client.get(url + "/health").json()
        if health.get("active") == 0 and health.get("queued") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    after = client.post(url + "/v1/chat/completions", json=greedy).json()["choices"][0]["message"]["content"]
    checks = {"health ok": health.get("status") == "ok", "no active slots": health.get("active") == 0,
              "same greedy answer as before": after == before, "canary answered": canary.answers > 0,
              "canary got no error": not canary.errors}
    for name, good in checks.items():
        print(f"  after: {name:52s} {'ok' if good else 'FAIL'}")
    failed = [r for r in results if not r.ok] + [n for n, good in checks.items() if not good]
    worst = max((r.stall_s for r in results), default=0.0)
    print(f"{len(results)} requests, {len([r for r in results if not r.ok])} failed; longest canary stall {worst:.2f} s; "
          f"canary answers {canary.answers}")
    with open(args.out, "w") as f:
        json.dump({"url": url, "model": card, "results": [asdict(r) for r in results], "after": checks,
                   "health": health, "canary_errors": canary.errors[:10], "longest_stall_s": worst,
                   "max_stall_s": args.max_stall, "ok": not failed, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                           time.gmtime())}, f, indent=1)
    return 1 if failed else 0


def _anthropic_cases(record, post, client: httpx.Client, url: str, context: int) -> None:
    """Anthropic's Messages API (POST /v1/messages): every bad body is a 400 (Anthropic's error object), a
    client that hangs up mid-stream or mid-answer frees its slot (checked after: no active slots)."""
    def refused(s) -> bool:
        return s == 400

    ask = {"model": "x", "max_tokens": 16, "messages": HI}
    malformed = (("text block without text", [{"type": "text"}]),
                 ("text block with a number", [{"type": "text", "text": 7}]),
                 ("block that is a number", [123]),
                 ("tool_use block from the user", [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]),
                 ("tool_result with no tool_use before", [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]),
                 ("image block", [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                               "data": "AA=="}}]),
                 ("5000 empty text blocks", [{"type": "text", "text": ""}] * 5000))
    for name, blocks in malformed:
        record(f"19 messages: {name}", lambda b=blocks: post("/v1/messages", {
            **ask, "messages": [{"role": "user", "content": b}]}), want=refused)
    record("19b messages: tool_use input nested 100k deep", lambda: client.post(url + "/v1/messages", content=(
        '{"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
        '"content": [{"type": "tool_use", "id": "t", "name": "f", "input": ' + '{"a": ' * 100_000 + '{}' +
        '}' * 100_000 + '}]}, {"role": "user", "content": "ok"}]}').encode(),
        headers={"content-type": "application/json"}).status_code, want=refused)
    record("19c messages: role system, tool_use input a string", lambda: post("/v1/messages", {
        **ask, "messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]}), want=refused)
    for name, value in (("10^12", 10**12), ("2^63", 2**63), ("the context", context), ("-1", -1), ("0", 0),
                        ("'lots'", "lots"), ("1.5", 1.5)):
        record(f"20 messages: max_tokens {name}", lambda v=value: post("/v1/messages", {**ask, "max_tokens": v}),
               want=refused)
    record("20b messages: max_tokens missing", lambda: post("/v1/messages", {"model": "x", "messages": HI}),
           want=refused)
    record("20c messages: thinking budget 10^9", lambda: post("/v1/messages", {
        **ask, "thinking": {"type": "enabled", "budget_tokens": 10**9}}), want=refused)
    record("20d messages: 4 MB of stop_sequences", lambda: post("/v1/messages", {
        **ask, "stop_sequences": ["x" * 262_000] * 16}), want=lambda s: s in (200, 400, 413))  # never matched: harmless
    record("21 messages streamed: hang up after the first delta", lambda: _messages_hang_up(client, url),
           want=lambda s: s == "hung up")
    record("21b messages: client gone after 0.5 s", lambda: _hang_up(client, url, {
        "model": "x", "max_tokens": 200, "messages": HI}, path="/v1/messages", after=0.5),
        want=lambda s: s in ("hung up", 200))  # 200: the answer ended (EOS) within 0.5 s


def _messages_hang_up(client: httpx.Client, url: str) -> str | int:
    """A streamed /v1/messages answer dropped after its first content_block_delta (its slot must be freed)."""
    body = {"model": "x", "max_tokens": 200, "messages": HI, "stream": True, "temperature": 1.0}
    with client.stream("POST", url + "/v1/messages", json=body) as r:
        if r.status_code != 200:
            return r.status_code
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                return "hung up"
    return 299  # not an HTTP status: the answer ended before its first delta (fails the want check)


def _same(client: httpx.Client, url: str, body: dict, want: str) -> int:
    r = client.post(url + "/v1/chat/completions", json=body)
    if r.status_code == 200 and r.json()["choices"][0]["message"]["content"] != want:
        return 299  # not an HTTP status: "a different answer" (fails the want check)
    return r.status_code


def _hang_up(client: httpx.Client, url: str, body: dict, path: str = "/v1/completions", after: float = 1.0) -> str | int:
    try:
        return httpx.post(url + path, json=body, timeout=after, headers=client.headers).status_code
    except httpx.TimeoutException:
        return "hung up"


def _streamed_echo(client: httpx.Client, url: str) -> int:
    body = {"prompt": "Hello! How are you", "echo": True, "max_tokens": 0, "logprobs": 1}
    whole = client.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
    r = client.post(url + "/v1/completions", json={**body, "stream": True})
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    return r.status_code if text == whole else 299


def _flood(client: httpx.Client, url: str) -> int:
    """Two n=16 requests in flight, then a one-answer request: it must not be refused (429)."""
    big = {"messages": HI, "n": 16, "max_tokens": 16, "ignore_eos": True}
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(client.post(url + "/v1/chat/completions",
                                                                      json=big).status_code)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    small = client.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4}).status_code
    for t in threads:
        t.join(TIMEOUT_S)
    return small if all(s < 500 for s in out) else max(out)


if __name__ == "__main__":
    sys.exit(main())
