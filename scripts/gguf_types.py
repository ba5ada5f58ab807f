#!/usr/bin/env python
"""What a GGUF file really stores: tensors, weights and bits per weight by quantization type.

llama.cpp falls back to another type where a row's length is not a multiple of the type's block
(llama-quant.cpp, tensor_type_fallback: Q4_K -> Q5_0, Q6_K -> Q8_0 when ncols % 256 != 0), so a file's
name ("Q4_K_M") can hide what most of its weights are. Prints a table, writes JSON with --out.

  .venv/bin/python scripts/gguf_types.py ~/.cache/edgechat/gguf/SmolLM2-135M-Instruct.Q4_1/q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def composition(path: Path) -> dict:
    from gguf import GGUFReader

    rows: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "weights": 0, "bytes": 0, "names": set()})
    for t in GGUFReader(str(path)).tensors:
        r = rows[t.tensor_type.name]
        r["tensors"] += 1
        r["weights"] += int(np.prod(t.shape))
        r["bytes"] += int(t.n_bytes)
        r["names"].add(t.name.split(".")[-2] if t.name.startswith("blk.") else t.name)
    total_w = sum(r["weights"] for r in rows.values())
    total_b = sum(r["bytes"] for r in rows.values())
    return {"file": str(path), "weights": total_w, "bytes": total_b, "bits_per_weight": 8 * total_b / total_w,
            "types": {k: {**{f: v for f, v in r.items() if f != "names"}, "names": sorted(r["names"]),
                          "share_of_weights": r["weights"] / total_w, "bits_per_weight": 8 * r["bytes"] / r["weights"]}
                      for k, r in sorted(rows.items(), key=lambda kv: -kv[1]["weights"])}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, help="write the JSON here")
    a = ap.parse_args()
    out = [composition(p) for p in a.gguf]
    for c in out:
        print(f"{c['file']}: {c['weights'] / 1e6:.1f}M weights, {c['bytes'] / 1e6:.1f} MB, {c['bits_per_weight']:.2f} bits/weight")
        print(f"  {'type':<8} {'tensors':>7} {'weights':>9} {'share':>6} {'bits/w':>6}  tensors named")
        for k, r in c["types"].items():
            print(f"  {k:<8} {r['tensors']:>7} {r['weights'] / 1e6:>8.1f}M {100 * r['share_of_weights']:>5.0f}% "
                  f"{r['bits_per_weight']:>6.2f}  {', '.join(r['names'])}")
    if a.out:
        a.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
