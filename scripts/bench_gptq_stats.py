"""How long GPTQ's input statistics take: passes of the whole ONNX graph against the model block by block.

Reads a build's work folder (load/ and export/model.onnx, as `edge-export build` leaves them), asks for
every weight MatMul's X^T X in graph order, as the quantize stage does, once with `Hessians` (one pass
of the plain graph per ONE_PASS_BYTES of matrices) and once with `LayerHessians` (one decoder block at a
time, one forward pass in all). Each run is its own process (peak memory is per process), interleaved
A B A B over --rounds; prints a table (median and spread) and writes JSON.

    .venv/bin/python scripts/bench_gptq_stats.py --work qwen.bundle.work --samples 16 --tokens 256
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("graph", "blocks")


def one(method: str, work: Path, samples: int, tokens: int, threads: int) -> dict:
    """Collect every matrix with one method in this process; seconds, passes, peak RSS, a checksum."""
    import numpy as np

    from export.hessians import Hessians, LayerHessians, statistics_bytes
    from export.load import model_dims
    from export.quantize import QuantizeOptions, sensitivity_feeds

    plain = work / "export" / "model.onnx"
    feeds = sensitivity_feeds(work / "load", QuantizeOptions(mode="int4-weight", sensitivity_samples=samples,
                                                              sensitivity_tokens=tokens), model_dims(work / "load"))
    t0 = time.perf_counter()
    hess = Hessians(plain, work, feeds, threads=threads) if method == "graph" else LayerHessians(work / "load", plain, feeds, threads)
    with hess:
        trace = sum(float(np.trace(hess(n))) for n in hess.input_of)
        passes, rows = hess.passes, hess.rows
    return {"method": method, "seconds": round(time.perf_counter() - t0, 1), "passes": passes, "tokens": rows,
            "statistics_gb": round(statistics_bytes(plain) / 1e9, 2), "trace_sum": trace,
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a build's work folder (load/, export/model.onnx)")
    ap.add_argument("--samples", type=int, default=16, help="calibration texts (the build's default is 96)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per text (the build's default is 512)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # internal: one run in this process
    a = ap.parse_args()
    if a.samples < 1 or a.tokens < 8 or a.rounds < 1 or a.threads < 1:
        ap.error("--samples, --rounds and --threads must be >= 1 and --tokens >= 8")
    if not (a.work / "load" / "config.json").is_file() or not (a.work / "export" / "model.onnx").is_file():
        ap.error(f"{a.work} has no load/config.json or export/model.onnx: pass a build's work folder")
    if a.one:
        print(json.dumps(one(a.one, a.work, a.samples, a.tokens, a.threads)))
        return
    runs: list[dict] = []
    for r in range(a.rounds):
        for method in METHODS:
            cmd = [sys.executable, __file__, "--work", str(a.work), "--samples", str(a.samples), "--tokens",
                   str(a.tokens), "--threads", str(a.threads), "--one", method]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{method} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]) | {"round": r})
            print(json.dumps(runs[-1]), flush=True)
    print(f"\n{'method':8s} {'seconds (median, min-max)':>28s} {'passes':>7s} {'peak RSS GB':>12s}")
    rows = {}
    for m in METHODS:
        got = [x for x in runs if x["method"] == m]
        s = [x["seconds"] for x in got]
        rows[m] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s), "passes": got[0]["passes"],
                   "peak_rss_gb": max(x["peak_rss_gb"] for x in got)}
        print(f"{m:8s} {rows[m]['median_s']:>12.1f} ({min(s):.1f}-{max(s):.1f}) {' ':9s} {rows[m]['passes']:>7d} "
              f"{rows[m]['peak_rss_gb']:>12.2f}")
    ratio = rows["graph"]["median_s"] / rows["blocks"]["median_s"]
    print(f"graph / blocks: {ratio:.2f}x the time; matrices {runs[0]['statistics_gb']} GB, {runs[0]['tokens']} tokens")
    if a.json:
        a.json.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                                      "machine": platform.processor() or platform.machine(), "work": str(a.work),
                                      "samples": a.samples, "tokens": a.tokens, "rounds": a.rounds, "threads": a.threads,
                                      "summary": rows, "graph_over_blocks": round(ratio, 2), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
