#!/usr/bin/env python
"""What a long prompt costs the users already streaming, in one run: the prompt prefilled a chunk at
a time between decode steps (the scheduler's default) against all at once (as before: every stream
freezes until it is in).

`--users` answers stream (EOS ignored); once each has a few tokens, a ~`--prompt-tokens` prompt arrives.
Reported per mode, over the window from its arrival to its first token: the longest gap between two
tokens of a streaming user, the tokens they got, and the long prompt's TTFT. The KV buffers are grown
for the long prompt first (timed apart: a server pays that once, for its first prompt that long). In process (the scheduler
without HTTP), so nothing else shares the CPU. Prints a table and writes JSON.

  .venv/bin/python scripts/bench_long_prompt.py smollm2.bundle --engine int8-dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PARAGRAPH = ("Kyoto was the capital of Japan for more than a thousand years. Its temples, shrines and gardens "
             "draw visitors in every season, and in autumn the maple leaves turn red along the hills. ")


def run_mode(gen, chunk: int | None, users: int, prompt_ids: list[int], stream_tokens: int) -> dict:
    from edge.decode.scheduler import Scheduler

    s = Scheduler(gen, max_batch=users + 1, max_queue=4)
    s.admission.interleaved_span = chunk
    t = time.perf_counter()
    s.cache._reserve(len(prompt_ids) + 64)  # as after a first long prompt: the one-time growth is timed apart
    grow_s = time.perf_counter() - t
    s.start()
    times: dict[str, list[float]] = {}

    def recorder(name: str):
        times[name] = []
        return lambda ev: times[name].append(time.perf_counter())

    try:
        streams = [s.submit(gen.tokenizer.encode_chat([{"role": "user", "content": f"Tell me story number {i}."}]),
                            gen.sampling(max_new_tokens=stream_tokens, ignore_eos=True), on_event=recorder(f"u{i}"))
                   for i in range(users)]
        while min(len(times[f"u{i}"]) for i in range(users)) < 5:
            time.sleep(0.002)
        t0 = time.perf_counter()
        long = s.submit(prompt_ids, gen.sampling(max_new_tokens=16, ignore_eos=True), on_event=recorder("long"))
        long.done.wait(300)
        for r in streams:
            r.cancel()
    finally:
        s.stop()
    t1 = times["long"][0]
    gaps, got = [], 0
    for i in range(users):
        ts = [t for t in times[f"u{i}"]]
        inside = [t for t in ts if t0 <= t <= t1]
        before = [t for t in ts if t < t0][-1:]
        after = [t for t in ts if t > t1][:1]
        edge = before + inside + after  # the gap that spans the window's edges counts too
        gaps += [b - a for a, b in zip(edge, edge[1:])]
        got += len(inside)
    return {"chunk": chunk or "spans <= 128", "buffer_growth_s": round(grow_s, 3), "long_ttft_s": round(t1 - t0, 3), "max_gap_ms": round(1000 * max(gaps), 1),
            "median_gap_ms": round(1000 * statistics.median(gaps), 1), "tokens_streamed_meanwhile": got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--engine", default="int8-dynamic")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "long-prompt.json"))
    a = ap.parse_args()

    from edge.decode.scheduler import Admission
    from edge.bundle import Bundle
    from bench_decode import cpu_name
    from edge.decode.generate import Generator

    gen = Generator.from_bundle(Bundle.open(a.bundle), engine=a.engine, threads=a.threads)
    if not gen.decoder.io.fused:
        sys.exit(f"{a.engine} is not a fused graph: this benchmark measures the fused graph's prefill spans")
    text, ids = "", []
    while len(ids) < a.prompt_tokens:
        text += PARAGRAPH
        ids = gen.tokenizer.encode_chat([{"role": "user", "content": text + "Summarize this."}])
    prompt_ids = ids
    modes = [("between steps", Admission().interleaved_span), ("all at once (before)", len(prompt_ids))]
    run_mode(gen, Admission().interleaved_span, a.users, prompt_ids[:200], 40)  # warm-up
    rows = []
    for name, chunk in modes:
        r = run_mode(gen, chunk, a.users, prompt_ids, 10_000)
        rows.append({"mode": name, **r})
    print(f"\n{a.users} users streaming, a {len(prompt_ids)}-token prompt arrives ({a.engine}, {os.cpu_count()} CPUs, {cpu_name()})\n")
    print("| long prompt prefilled | chunk | streaming users' longest gap | median gap | tokens they got meanwhile | long prompt TTFT |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['chunk']} | {r['max_gap_ms']:.0f} ms | {r['median_gap_ms']:.0f} ms | "
              f"{r['tokens_streamed_meanwhile']} | {r['long_ttft_s']:.2f} s |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bundle": a.bundle, "engine": a.engine, "users": a.users, "prompt_tokens": len(prompt_ids),
                               "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "platform": platform.platform()}, "rows": rows}, indent=2))
    print(f"\n(the first prompt this long also grows the KV buffers once: {rows[0]['buffer_growth_s']:.2f} s here, "
          "before either mode starts)")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
