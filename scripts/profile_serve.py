#!/usr/bin/env python
"""Where a served token's time goes: py-spy samples a real `edge-chat serve` while --users clients stream
answers, and every sample is put in one bucket by its stack (the first rule below that matches). Prints a table
(milliseconds per generated token and per decode step, by thread and bucket) and writes JSON.

  .venv/bin/pip install py-spy        # once (on the registry)
  .venv/bin/python scripts/profile_serve.py smollm2.bundle --engine int8-dynamic --users 1
  .venv/bin/python scripts/profile_serve.py smollm2.bundle --engine int8-dynamic --users 8 --answers 2

py-spy sees Python threads only: ONNX Runtime's worker threads do not appear, and the scheduler thread's time
inside the ONNX Runtime call is the decoder's step (its own share of the work plus waiting for its workers).
Samples are taken without pausing the server (--nonblocking), so the profile does not slow what it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import run_level, start_server  # noqa: E402

# (thread role, bucket, any of these substrings in a frame): first match wins, so the specific rules come first
RULES = [
    ("scheduler", "decoder call (ONNX Runtime run)", ("run_with_iobinding", "Session.run (", "execute_async")),
    ("scheduler", "binding inputs / reading outputs", ("IOBinding.", "OrtValue")),
    ("scheduler", "prefill (admitting a prompt)", ("Scheduler._admit", "Scheduler._prefill_next_chunk")),
    ("scheduler", "detokenize + stop strings", ("TextStream.push", "ChatTokenizer.decode", "streamer")),
    ("scheduler", "hand-off to the event loop", ("Request.emit",)),
    ("scheduler", "sampling + logits processors", ("Sampler.", "RowLogits.", "Scheduler._accept")),
    ("scheduler", "waiting for work", ("Condition.wait", "Event.wait")),
    ("scheduler", "scheduler bookkeeping", ("",)),
    ("event loop", "waiting in select (idle)", ("EpollSelector.select", "select.epoll")),
    ("event loop", "SSE: socket writes", ("RequestResponseCycle.send", "Transport.write", "_write_to_self")),
    ("event loop", "SSE: answer shapes + JSON", ("openai_writer.py", "openai_answers.py", "json/")),
    ("event loop", "event loop: other", ("",)),
    ("other threads", "waiting (idle)", ("Condition.wait", "Event.wait", "queue.py", "_worker (concurrent")),
    ("other threads", "other threads: work", ("",)),
]
IDLE = {"waiting for work", "waiting in select (idle)", "waiting (idle)"}


def role(thread: str) -> str:
    if "edgechat-scheduler" in thread:
        return "scheduler"
    return "event loop" if "MainThread" in thread else "other threads"


def bucket(thread: str, frames: list[str]) -> tuple[str, str]:
    r = role(thread)
    leaf_first = frames[::-1]
    for rl, name, keys in RULES:
        if rl != r:
            continue
        if name in IDLE:  # idle only when the thread is parked there (the leaf), not when work sits above it
            if any(k in leaf_first[0] for k in keys):
                return r, name
            continue
        if any(k in f for f in leaf_first for k in keys):
            return r, name
    return r, "?"


def read_samples(path: Path) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        key = bucket(frames[0], frames[1:] or [""])
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--engine")
    ap.add_argument("--users", type=int, default=1)
    ap.add_argument("--answers", type=int, default=4, help="answers per client while sampling")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second per thread")
    ap.add_argument("--json", default="bench-results/profile-serve.json")
    a = ap.parse_args()
    for flag in ("users", "answers", "max_tokens", "threads", "rate"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("py-spy is not installed: .venv/bin/pip install py-spy")
    proc, url = start_server(a.bundle, a.engine, max(a.users, 1), a.threads)
    try:
        run_level(url, a.users, 1, a.max_tokens)  # warm-up: first-call allocations, prompt cache of the questions
        steps0, tokens0 = metric(url, "edgechat_decode_steps_total"), metric(url, "edgechat_completion_tokens_total")
        raw = Path(tempfile.mkdtemp()) / "samples.txt"
        rec = subprocess.Popen([spy, "record", "-p", str(proc.pid), "-r", str(a.rate), "-f", "raw", "-o", str(raw),
                                "--threads", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
        time.sleep(1.0)
        t0 = time.perf_counter()
        level = run_level(url, a.users, a.answers, a.max_tokens)
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        rec.send_signal(signal.SIGINT)
        err = rec.communicate(timeout=60)[1]
        if not raw.exists():
            sys.exit(f"py-spy wrote no samples (needs ptrace rights: run as the server's user, or "
                     f"sysctl kernel.yama.ptrace_scope=0):\n{err}")
        steps = metric(url, "edgechat_decode_steps_total") - steps0
        tokens = metric(url, "edgechat_completion_tokens_total") - tokens0
    finally:
        proc.terminate()
        proc.wait(30)
    counts = read_samples(raw)
    per_s = 1.0 / a.rate
    rows = []
    for (r, name), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1])):
        s = n * per_s
        rows.append({"thread": r, "bucket": name, "samples": n, "ms_per_token": 1000 * s / tokens,
                     "ms_per_step": 1000 * s / steps if steps else None, "idle": name in IDLE})
    tok_wall_ms = 1000 * wall / tokens * a.users  # one client's wall time per token it received
    print(f"\n{a.users} user(s), {level['requests']} answers, {int(tokens)} tokens in {int(steps)} decode steps, "
          f"{wall:.1f} s; per client: median {level['per_user_tok_s']:.1f} tok/s, TTFT median "
          f"{level['ttft_p50_ms']:.0f} ms; load {os.getloadavg()[0]:.2f}")
    print(f"{'thread':<14} {'bucket':<36} {'ms/token':>9} {'ms/step':>8}")
    for r in rows:
        if not r["idle"]:
            print(f"{r['thread']:<14} {r['bucket']:<36} {r['ms_per_token']:9.3f} {r['ms_per_step'] or 0:8.3f}")
    busy = [r for r in rows if r["thread"] == "scheduler" and not r["idle"]]
    call = sum(r["ms_per_step"] or 0 for r in busy if r["bucket"].startswith("decoder call"))
    rest = sum(r["ms_per_step"] or 0 for r in busy) - call
    print(f"scheduler thread per step: decoder call {call:.2f} ms, everything else {rest:.2f} ms "
          f"({100 * rest / (call + rest):.1f}%)" if call + rest else "")
    out = {"script": "scripts/profile_serve.py", "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "bundle": a.bundle,
           "engine": a.engine, "users": a.users, "threads": a.threads, "rate_hz": a.rate, "clients": level,
           "tokens": tokens, "steps": steps, "wall_s": wall, "client_ms_per_token": tok_wall_ms,
           "scheduler_ms_per_step": {"decoder_call": call, "other": rest}, "buckets": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
