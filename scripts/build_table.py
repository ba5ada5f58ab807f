#!/usr/bin/env python3
"""Print (and write as JSON) what real builds cost and kept: per bundle, each stage's wall time and peak
resident memory as its manifest records them, and each engine's size, perplexity delta, KL and decode tok/s.

    python scripts/build_table.py smollm2.bundle qwen05.bundle [--json out.json]

The figures are the build's own measurements (stage records, the evaluate stage), so the table in
docs/models.md is reproduced by running the same builds and this script on a machine of the same kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge.bundle import Bundle  # noqa: E402


def machine() -> str:
    import os

    from edge.device.probe import cpu_name, mem_total_bytes

    return f"{cpu_name()}, {os.cpu_count()} cores, {(mem_total_bytes() or 0) / 1024 ** 3:.0f} GiB"


def rows(path: Path) -> dict:
    m = Bundle.open(path, verify="none").manifest
    stages = [{"stage": s.name, "seconds": s.seconds, "peak_rss_bytes": s.memory.get("peak_rss_bytes")}
              for s in m.stages]
    ev = next((s.metrics for s in m.stages if s.name == "evaluate"), {})
    engines = [{"engine": n, "shipped": q.get("shipped", True), "size_bytes": q.get("size_bytes"),
                "perplexity": q.get("perplexity"), "perplexity_delta_pct": q.get("perplexity_delta_pct"),
                "kl_to_fp32": q.get("kl_to_fp32"), "top1_agreement": q.get("top1_agreement"),
                "decode_tok_s": q.get("decode_tok_s"), "golden_passed": q.get("golden_passed")}
               for n, q in ev.get("engines", {}).items()]
    return {"bundle": str(path), "model": m.model_name, "parameters": m.model.num_parameters,
            "eval_chats": ev.get("eval_chats"), "stages": stages, "engines": engines}


def fmt(n, unit=1e9, digits=1, suffix=" GB"):
    return "-" if n is None else f"{n / unit:.{digits}f}{suffix}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    data = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "bundles": [rows(b) for b in a.bundles]}
    print(f"{data['date']}, {data['machine']}\n")
    for b in data["bundles"]:
        print(f"### {b['model']} ({b['parameters'] / 1e6:,.0f}M parameters; quality on {b['eval_chats']} held-out chats)\n")
        print("| stage | wall time | peak RSS |\n|---|---|---|")
        for s in b["stages"]:
            print(f"| {s['stage']} | {s['seconds']:.0f} s | {fmt(s['peak_rss_bytes'])} |")
        print("\n| engine | shipped | size | perplexity delta | KL to fp32 | top-1 agree | decode tok/s | golden |")
        print("|---|---|---|---|---|---|---|---|")
        for e in b["engines"]:
            role = "yes" if e["shipped"] else "reference" if e["engine"] == "fp32" else "report only"
            print(f"| {e['engine']} | {role} | {fmt(e['size_bytes'], 1e6, 0, ' MB')} | "
                  f"{'-' if e['perplexity_delta_pct'] is None else format(e['perplexity_delta_pct'], '+.2f') + '%'} | "
                  f"{'-' if e['kl_to_fp32'] is None else format(e['kl_to_fp32'], '.4f')} | "
                  f"{'-' if e['top1_agreement'] is None else format(100 * e['top1_agreement'], '.1f') + '%'} | "
                  f"{'-' if e['decode_tok_s'] is None else format(e['decode_tok_s'], '.1f')} | {e['golden_passed'] or '-'} |")
        print()
    if a.json:
        a.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
