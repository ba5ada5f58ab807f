#!/usr/bin/env python
"""Which ONNX Runtime settings decode fastest on this machine: one engine, several session settings and
graph variants, each in its own process, interleaved (A B C A B C ..., --rounds), median and spread.

Settings (session variants of the bundle's engine):
  default     what edge-chat uses: all graph optimizations, 2 spinning intra-op threads, the CPU arena
  no-spin     session.intra_op.allow_spinning = 0 (what the server uses)
  no-arena    enable_cpu_mem_arena = False
  pinned      session.intra_op_thread_affinities: the second thread pinned to the second core
Graph variants: --graph NAME=PATH adds another ONNX file of the same model with default settings (e.g. the
int4 engine re-quantized with --int4-block 64: its scales and zero points are fewer, its bytes per token too).

  .venv/bin/python scripts/sweep_ort.py smollm2.bundle --engine int4-weight --graph b64=/tmp/b64/model.onnx

Prints a table (decode tok/s median and min-max, ratio to default taken within each round), writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_decode import PROMPT, files_bytes  # noqa: E402  the bench's chat prompt: the same text in both scripts

SESSIONS: dict[str, dict] = {
    "default": {},
    "no-spin": {"config": {"session.intra_op.allow_spinning": "0"}},
    "no-arena": {"arena": False},
    "pinned": {"config": {"session.intra_op_thread_affinities": "2"}},  # 1-based logical CPUs of the extra thread
}


def row(spec: dict) -> dict:
    """Load one engine with one setting and time a greedy answer after a warm-up one (child process)."""
    from edge.bundle import Bundle
    from edge.io_contract import DecoderIO
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.tokenizer import ChatTokenizer

    b = Bundle.open(spec["bundle"])
    m, e = b.manifest, b.manifest.engine(spec["engine"])
    path = spec.get("path") or str(b.path(e.file))
    s = SESSIONS.get(spec.get("session", "default"), {})
    d = OrtDecoder(path, m.model, DecoderIO.from_dict(m.engine_io(e)), threads=spec["threads"],
                   session_config=s.get("config"), arena=s.get("arena", True))
    ids = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer).encode_chat(PROMPT)
    new = spec["new"]
    for warm in (True, False):
        cache = d.new_cache(capacity=len(ids) + new)
        t0 = time.perf_counter()
        tok = int(np.argmax(d.prefill(ids, cache)[0]))
        t1 = time.perf_counter()
        tokens = [tok]
        for _ in range(new - 1):
            tokens.append(int(np.argmax(d.forward(np.array([[tokens[-1]]]), cache)[0])))
        t2 = time.perf_counter()
    return {"ttft_ms": 1000 * (t1 - t0), "decode_tok_s": (new - 1) / (t2 - t1), "tokens": tokens,
            "file_bytes": files_bytes(Path(path))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--engine", default="int8-dynamic")
    ap.add_argument("--sessions", nargs="+", default=list(SESSIONS), choices=list(SESSIONS))
    ap.add_argument("--graph", action="append", default=[], metavar="NAME=PATH", help="another ONNX file of the same engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-results/sweep-ort.json"))
    ap.add_argument("--_row", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._row:
        print(json.dumps(row(json.loads(a._row))))
        return 0
    if not a.bundle:
        ap.error("give a bundle")
    base = {"bundle": a.bundle, "engine": a.engine, "threads": a.threads, "new": a.new_tokens}
    rows = {f"{a.engine} {s}": base | {"session": s} for s in a.sessions}
    for g in a.graph:
        name, _, path = g.partition("=")
        if not path or not Path(path).is_file():
            ap.error(f"--graph {g}: give NAME=PATH to an existing .onnx file")
        rows[f"{a.engine} {name}"] = base | {"path": path}
    per_round: dict[str, list[dict]] = {k: [] for k in rows}
    print(f"{a.engine} of {a.bundle}: {len(rows)} rows x {a.rounds} rounds, {a.threads} threads, {a.new_tokens} greedy tokens; "
          f"load average {os.getloadavg()[0]:.2f}")
    for r in range(a.rounds):
        for name, spec in rows.items():
            p = subprocess.run([sys.executable, __file__, "--_row", json.dumps(spec)], capture_output=True, text=True,
                               cwd=ROOT, timeout=1800)
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            res = json.loads(lines[-1]) if p.returncode == 0 and lines else {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            res["load_avg_1m"] = os.getloadavg()[0]
            per_round[name].append(res)
            print(f"  round {r + 1}/{a.rounds} {name}: " + (f"{res['decode_tok_s']:.1f} tok/s" if "error" not in res else res["error"]))
    first = next(iter(rows))
    print(f"\n{'row':<28} {'decode tok/s':>12} {'spread':>12} {'vs default':>16} {'TTFT ms':>8} {'MB':>6}  same tokens")
    summary = {}
    for name, res in per_round.items():
        ok = [x for x in res if "error" not in x]
        if not ok:
            print(f"{name:<28} failed: {res[-1]['error']}")
            continue
        tok = [x["decode_tok_s"] for x in ok]
        ratios = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(res, per_round[first])
                  if "error" not in x and "error" not in y]
        same = all(x["tokens"] == per_round[first][0].get("tokens") for x in ok)
        summary[name] = {"decode_tok_s": statistics.median(tok), "range": [min(tok), max(tok)],
                         "ratio_to_default": statistics.median(ratios) if ratios else None,
                         "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                         "ttft_ms": statistics.median(x["ttft_ms"] for x in ok), "file_bytes": ok[0]["file_bytes"],
                         "same_tokens_as_default": same}
        s = summary[name]
        print(f"{name:<28} {s['decode_tok_s']:>12.1f} {s['range'][0]:>5.0f}-{s['range'][1]:<5.0f} "
              f"{s['ratio_to_default']:>7.2f}x {s['ratio_range'][0]:.2f}-{s['ratio_range'][1]:.2f} "
              f"{s['ttft_ms']:>8.0f} {s['file_bytes'] / 1e6:>6.1f}  {same}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                                 "threads": a.threads, "engine": a.engine, "rows": summary, "per_round": per_round}, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
