#!/usr/bin/env python
"""Where a batched decode step's time goes inside ONNX Runtime: its own profiler (SessionOptions.enable_profiling)
over greedy steps of N rows after one batched prefill of N chat prompts, summed by operator type. Prints a table per
row count and writes JSON. Issue 46: at 8 rows the step is ONNX Runtime's kernels, not the serving path.

  .venv/bin/python scripts/profile_step.py smollm2.bundle --engine int8-dynamic --rows 1,8 --json bench-results/profile-step.json
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def profile(bundle: str, engine: str | None, threads: int, rows: int, steps: int, top: int) -> dict:
    """One session with profiling on (a fresh one per row count: its trace holds that run alone)."""
    import edge.backends.onnxruntime as ort_backend
    from edge.bundle import Bundle
    from edge.decode.cache import batch_cache
    from edge.decode.conversation import prompt
    from edge.decode.generate import Generator

    prefix = tempfile.mkdtemp(prefix="edgechat-profile-") + "/ort"
    plain = ort_backend.session_options

    def profiled(*a, **kw):
        so = plain(*a, **kw)
        so.enable_profiling, so.profile_file_prefix = True, prefix
        return so

    ort_backend.session_options = profiled
    try:
        gen = Generator.from_bundle(Bundle.open(bundle), engine=engine, threads=threads)
    finally:
        ort_backend.session_options = plain
    prompts = [prompt(gen.tokenizer, [{"role": "user", "content": f"Tell me about the temples of Kyoto (user {i})"}]).ids
               for i in range(rows)]
    cache = batch_cache(gen.decoder, rows)
    toks = cache.prefill_rows(prompts).argmax(-1).tolist()
    t = time.perf_counter()
    for _ in range(steps):
        toks = np.asarray(cache.step(toks)).argmax(-1).tolist()
    wall = (time.perf_counter() - t) / steps
    events = json.loads(Path(gen.decoder.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][-steps:]  # the steps, not the prefill
    start, total = runs[0]["ts"], sum(r["dur"] for r in runs)
    by: collections.Counter = collections.Counter()
    nodes: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["ts"] >= start and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
    return {"rows": rows, "steps": steps, "step_ms_wall": 1000 * wall, "model_run_ms": total / len(runs) / 1000,
            "ops": {op: {"ms_per_step": d / len(runs) / 1000, "nodes": nodes[op] // len(runs), "share": d / total}
                    for op, d in by.most_common(top)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8", help="row counts, comma-separated")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=8, help="operator types shown")
    ap.add_argument("--json", type=Path, default=Path("bench-results/profile-step.json"))
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if any(r < 1 for r in rows) or a.steps < 1:
        ap.error(f"--rows takes counts >= 1 and --steps >= 1, got {a.rows} and {a.steps}")
    out = {"bundle": a.bundle, "engine": a.engine, "threads": a.threads, "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": []}
    for r in rows:
        got = profile(a.bundle, a.engine, a.threads, r, a.steps, a.top)
        out["results"].append(got)
        print(f"{r} row(s): {got['model_run_ms']:.2f} ms per step in ONNX Runtime ({got['step_ms_wall']:.2f} ms wall)")
        for op, v in got["ops"].items():
            print(f"  {op:34s} {v['ms_per_step']:7.3f} ms  {v['nodes']:4d} nodes  {100 * v['share']:5.1f}%")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
