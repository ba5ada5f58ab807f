"""Soak `edge-chat serve`: many clients mixing good requests, bad requests and hang-ups for a bounded time.

Starts the server on a free loopback port, asks a fixed set of requests ONE AT A TIME first (the single-user
answers), then runs N clients for --minutes. Each client, seeded, loops over: a good request (one of the fixed
set, streamed or not: its answer must equal the single-user answer), a bad one (wrong types, ranges, NaN,
lone surrogates, deep nesting, unknown paths, wrong methods, over-size bodies: each must be a 4xx with
OpenAI's error object), or a hang-up (a stream closed after a few chunks, or a non-streaming request whose
client times out). At the end the server must have no slot busy (leaked slots) within 5 s, /health ok and
no scheduler restart. Prints a table and writes JSON.

    python scripts/soak_serve.py BUNDLE [--minutes 3] [--clients 16] [--engine int8-dynamic] [--out soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edge.device.probe import cpu_name  # noqa: E402

QUESTIONS = ["What is the capital of Japan?", "Tell me a fun fact about octopuses.", "How are you doing today?",
             "Write one sentence about the ocean.", "Name three colours.", "Why is the sky blue?"]
SECOND_TURN = [{"role": "user", "content": "What is the capital of Japan?"},
               {"role": "assistant", "content": "The capital of Japan is Tokyo."},
               {"role": "user", "content": "And what is it famous for?"}]
HI = [{"role": "user", "content": "hi"}]
BAD = {  # kind -> (method, path, raw body)
    "seed -1": ("POST", "/v1/chat/completions", json.dumps({"messages": HI, "seed": -1, "temperature": 0.5})),
    "NaN temperature": ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                                                        '"temperature": NaN}'),
    "stream_options x": ("POST", "/v1/chat/completions", json.dumps({"messages": HI, "stream": True,
                                                                      "stream_options": "x"})),
    "lone surrogate": ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "deep nesting": ("POST", "/v1/chat/completions", '{"messages": ' + "[" * 50_000 + "]" * 50_000 + "}"),
    "max_tokens 0": ("POST", "/v1/chat/completions", json.dumps({"messages": HI, "max_tokens": 0})),
    "wrong type": ("POST", "/v1/chat/completions", json.dumps({"messages": HI, "max_tokens": "ten"})),
    "not json": ("POST", "/v1/chat/completions", "{nope"),
    "too long": ("POST", "/v1/chat/completions", json.dumps({"messages": HI, "max_tokens": 10**6})),
    "unknown path": ("GET", "/v1/nothing", ""),
    "wrong method": ("GET", "/v1/chat/completions", ""),
    "over 4 MiB": ("POST", "/v1/chat/completions", "x" * (4 * 1024 * 1024 + 10)),
}


def good_requests(max_tokens: int) -> list[dict]:
    """The fixed set: greedy and seeded sampling, one-turn questions and a chat's second turn."""
    out = []
    for i, q in enumerate(QUESTIONS):
        out.append({"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0})
        out.append({"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0.8,
                    "top_p": 0.95, "seed": 1000 + i})
    out.append({"messages": SECOND_TURN, "max_tokens": max_tokens, "temperature": 0})
    out.append({"messages": SECOND_TURN, "max_tokens": max_tokens, "temperature": 0.7, "seed": 7})
    return out


def ask(client: httpx.Client, url: str, body: dict, stream: bool) -> str:
    """The answer's text (streamed or not); raises on anything but a clean 200."""
    if not stream:
        r = client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]
    parts = []
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error']}")
            if ev["choices"]:
                parts.append(ev["choices"][0]["delta"].get("content") or "")
    return "".join(parts)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: Counter = Counter()
        self.mismatches: list[dict] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n


def client_loop(i: int, url: str, goods: list[dict], refs: list[str], deadline: float, tally: Tally,
                mix: tuple[float, float], long_tokens: int) -> None:
    rng = random.Random(i)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < mix[0]:
                    k = rng.randrange(len(goods))
                    got = ask(client, url, goods[k], stream=rng.random() < 0.5)
                    tally.add("good answered")
                    if got != refs[k]:
                        tally.add("answers differing from single-user")
                        with tally.lock:
                            tally.mismatches.append({"request": k, "want": refs[k], "got": got})
                elif roll < mix[0] + mix[1]:
                    kind = rng.choice(list(BAD))
                    method, path, raw = BAD[kind]
                    r = client.request(method, url + path, content=raw.encode(),
                                       headers={"content-type": "application/json"})
                    err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
                    if 400 <= r.status_code < 500 and err and {"message", "type", "param", "code"} <= set(err):
                        tally.add(f"bad -> {r.status_code}")
                    else:
                        tally.add(f"bad -> UNEXPECTED {r.status_code}")
                else:
                    body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": long_tokens,
                            "ignore_eos": True}
                    if rng.random() < 0.5:  # a stream the client closes after a few chunks
                        with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
                            for n, _ in enumerate(r.iter_lines()):
                                if n >= 3:
                                    break
                        tally.add("hang-up (stream)")
                    else:  # a non-streaming client that gives up
                        try:
                            client.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
                            tally.add("hang-up (answered before the timeout)")
                        except httpx.ReadTimeout:
                            tally.add("hang-up (client timeout)")
            except Exception as e:  # anything else is a finding: count it by type
                tally.add(f"client error: {type(e).__name__}")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_samples(pid: int, threads: list[threading.Thread], every_s: float = 2.0) -> list[float]:
    """The server's RSS every `every_s` until the client threads end (joins them)."""
    out = []
    while any(t.is_alive() for t in threads):
        if (v := rss_mb(pid)) is not None:
            out.append(v)
        for t in threads:
            t.join(timeout=every_s / len(threads))
    return out


def rss_summary(samples: list[float]) -> dict:
    """Flat memory: the last third's peak against the first third's (the first includes warm-up growth)."""
    if len(samples) < 3:
        return {}
    k = len(samples) // 3
    first, last = max(samples[:k]), max(samples[-k:])
    return {"samples": len(samples), "first_third_max": round(first, 1), "last_third_max": round(last, 1),
            "growth_pct": round(100 * (last - first) / first, 2), "max": round(max(samples), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--engine", default="int8-dynamic")
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the clients run (default 3)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-users", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length of the good requests")
    ap.add_argument("--bad-share", type=float, default=0.25, help="share of bad requests (default 0.25)")
    ap.add_argument("--hangup-share", type=float, default=0.25, help="share of hang-ups (default 0.25)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "soak.json"))
    a = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "edge.cli", "serve", a.bundle, "--port", str(port), "--no-ui", "--engine", a.engine,
           "--max-users", str(a.max_users), "--max-queue", str(4 * a.clients)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    log = open(Path(a.out).with_suffix(".server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                sys.exit(f"the server exited with {proc.returncode}: see {log.name}")
            time.sleep(0.5)
        goods = good_requests(a.max_tokens)
        context = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["context_length"]
        with httpx.Client(timeout=300) as c:
            refs = [ask(c, url, g, stream=False) for g in goods]  # single-user answers, one at a time
        tally = Tally()
        t0 = time.monotonic()
        deadline = t0 + 60 * a.minutes
        threads = [threading.Thread(target=client_loop, args=(i, url, goods, refs, deadline, tally, (1 - a.bad_share - a.hangup_share, a.bad_share),
                                                                min(400, context // 2)))
                   for i in range(a.clients)]
        for t in threads:
            t.start()
        rss = rss_samples(proc.pid, threads)  # the server's resident memory every few seconds while they run
        ran_s = time.monotonic() - t0
        settle = time.monotonic()
        while time.monotonic() - settle < 5:
            h = httpx.get(url + "/health", timeout=10).json()
            if h["active"] == 0 and h["queued"] == 0:
                break
            time.sleep(0.1)
        health = httpx.get(url + "/health", timeout=10).json()
        text = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    c = tally.c
    served = {k: metric(text, f'edgechat_requests_total{{finish="{k}"}}') for k in ("stop", "length", "cancelled",
                                                                                      "timeout", "error")}
    http_errors = {m.group(1): float(m.group(2)) for m in
                   re.finditer(r'^edgechat_http_errors_total\{status="(\d+)"\} (\S+)$', text, re.M)}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "bundle": a.bundle, "engine": a.engine,
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "platform": platform.platform()},
        "clients": a.clients, "max_users": a.max_users, "minutes": round(ran_s / 60, 2),
        "client_outcomes": dict(sorted(c.items())),
        "requests_finished_by_server": served, "error_responses_by_status": http_errors,
        "slots_leaked": health["active"], "queued_at_end": health["queued"],
        "answers_differing_from_single_user": c["answers differing from single-user"],
        "unexpected_bad_answers": sum(v for k, v in c.items() if "UNEXPECTED" in k),
        "client_errors": sum(v for k, v in c.items() if k.startswith("client error")),
        "scheduler_restarts": health.get("scheduler_restarts"), "health": health["status"],
        "completion_tokens": metric(text, "edgechat_completion_tokens_total"),
        "cached_prompt_tokens": metric(text, "edgechat_prompt_tokens_cached_total"),
        "server_exit_code": code, "mismatch_examples": tally.mismatches[:3],
        "rss_mb": rss_summary(rss),
    }
    print(f"\nsoak: {a.clients} clients for {result['minutes']} min against {a.engine} ({os.cpu_count()} CPUs, "
          f"{cpu_name()})\n")
    print("| what | count |\n|---|---|")
    for k, v in sorted(c.items()):
        print(f"| {k} | {v} |")
    for k, v in served.items():
        print(f"| server: finished {k} | {v:.0f} |")
    for k, v in http_errors.items():
        print(f"| server: error responses {k} | {v:.0f} |")
    for k in ("slots_leaked", "answers_differing_from_single_user", "unexpected_bad_answers", "client_errors",
              "scheduler_restarts", "completion_tokens", "cached_prompt_tokens", "server_exit_code"):
        print(f"| {k.replace('_', ' ')} | {result[k]} |")
    r = result["rss_mb"]
    if r:
        print(f"| server RSS MB: first third max / last third max / growth | {r['first_third_max']} / "
              f"{r['last_third_max']} / {r['growth_pct']:+.1f}% |")
    out = Path(a.out)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    ok = (result["slots_leaked"] == 0 and result["answers_differing_from_single_user"] == 0
          and result["unexpected_bad_answers"] == 0 and result["client_errors"] == 0
          and result["scheduler_restarts"] == 0 and health["status"] == "ok")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
