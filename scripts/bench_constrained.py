#!/usr/bin/env python
"""Decode speed with and without constrained decoding, through a real `edge-chat serve` and the openai client.

Alternates, `--rounds` times: a plain greedy answer (EOS ignored, --tokens long) and a greedy
response_format json_schema answer whose schema makes it long (a list of short strings), one request
at a time. Decode tok/s = (completion tokens - 1) / (last chunk - first chunk), per request; prints the
medians, their ratio and JSON. The grammar's mask is computed on the scheduler thread between steps.

  .venv/bin/python scripts/bench_constrained.py /tmp/soak/smol.bundle [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from edge.device.probe import cpu_name  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "cities": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 12, "maxItems": 12},
    "country": {"type": "string", "maxLength": 24}},
    "required": ["cities", "country"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "List twelve big cities of Japan as JSON: {\"cities\": [...], \"country\": ...}."}]


def _timed(client, **kw) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], None
    for ch in client.chat.completions.create(model="x", messages=PROMPT, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(ch.choices[0].delta.content)
    n = usage.completion_tokens
    return {"tokens": n, "ttft_s": round(first - t0, 3), "decode_tok_s": round((n - 1) / (last - first), 2),
            "text": "".join(text)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import openai

    from conftest import ServerProcess

    extra = ["--threads", str(args.threads)] if args.threads else []
    server = ServerProcess(args.bundle, "--no-ui", "--max-users", "2", *extra)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        fmt = {"type": "json_schema", "json_schema": {"name": "cities", "schema": SCHEMA}}
        _timed(client, max_tokens=8)  # warm-up (and the grammar engine's vocabulary)
        _timed(client, max_tokens=8, response_format=fmt)
        plain, constrained = [], []
        for _ in range(args.rounds):
            plain.append(_timed(client, max_tokens=args.tokens, extra_body={"ignore_eos": True}))
            constrained.append(_timed(client, max_tokens=400, response_format=fmt))
    finally:
        server.stop()
    p = statistics.median(r["decode_tok_s"] for r in plain)
    c = statistics.median(r["decode_tok_s"] for r in constrained)
    json.loads(constrained[0]["text"])  # it is JSON
    out = {"cpu": cpu_name(), "machine": platform.machine(), "bundle": str(args.bundle), "rounds": args.rounds,
           "plain_tok_s": p, "constrained_tok_s": c, "ratio": round(c / p, 3),
           "plain": [{k: v for k, v in r.items() if k != "text"} for r in plain],
           "constrained": [{k: v for k, v in r.items() if k != "text"} for r in constrained],
           "constrained_answer": constrained[0]["text"]}
    print(f"decode tok/s on {out['cpu']}: plain {p}, json_schema constrained {c} (ratio {out['ratio']}), "
          f"median of {args.rounds}, one request at a time")
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
