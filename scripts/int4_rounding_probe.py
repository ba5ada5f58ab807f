"""How much each 4-bit rounding costs, all weight MatMuls at 4 bits (the LM head kept fp32), as KL to the
fp32 graph on text no calibration reaches (the last training-prose documents; --held-out: the first
held-out ones). Prints a table, writes JSON. Uses a build's work folder (its load and export stages):

    python scripts/int4_rounding_probe.py smollm2.bundle.work --samples 96 --block 64 --json probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {  # name -> export.gptq.gptq_block_quant options (None: round to nearest, min-max)
    "minmax": None,
    "gptq": {"act_order": False, "search": 0, "damp": 0.01},
    "gptq+act": {"act_order": True, "search": 0, "damp": 0.01},
    "gptq+act+search": {"act_order": True, "search": 20, "damp": 0.01},
    "gptq+act+search, damp 0.003 (default)": {},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="a build's OUT.work folder (load/ and export/model.onnx)")
    ap.add_argument("--samples", type=int, default=96, help="calibration texts for GPTQ (half chats, half prose)")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--docs", type=int, default=6, help="scoring documents, 256 tokens each")
    ap.add_argument("--held-out", action="store_true", help="score on held-out prose instead of unused training prose")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from export import gptq, sensitivity
    from export.int4 import dequantize, fake_quant
    from export.load import chat_tokenizer, model_dims
    from export.prose import prose_texts
    from export.quantize import QuantizeOptions, sensitivity_feeds

    hf, plain = a.work / "load", a.work / "export" / "model.onnx"
    dims = model_dims(hf)
    cal = sensitivity_feeds(hf, QuantizeOptions(mode="int4-weight", sensitivity_samples=a.samples, sensitivity_tokens=256), dims)
    tok = chat_tokenizer(hf)
    docs = prose_texts("eval")[: a.docs] if a.held_out else prose_texts("train")[-a.docs:]
    feeds = []
    for text in docs:
        ids = tok.encode(text)[:256]
        n = len(ids)
        feeds.append(cal[0] | {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                               "position_ids": np.arange(n, dtype=np.int64)[None]})
    work = a.work / "probe-tmp"
    work.mkdir(exist_ok=True)
    hess = gptq.Hessians(plain, work, cal)
    probe = sensitivity.Probe(plain, work, feeds)
    targets = {n: w for n, w in probe.nodes.items() if "lm_head" not in n}
    rows = []
    try:
        for name, kw in VARIANTS.items():
            t = time.time()
            if kw is None:
                swap = {w: fake_quant(probe.weights[w], 4, a.block, "minmax") for w in targets.values()}
            else:
                swap = {w: dequantize(*gptq.gptq_block_quant(probe.weights[w], hess(n), 4, a.block, **kw), k=probe.weights[w].shape[0])
                        for n, w in targets.items()}
            rows.append({"rounding": name, "kl": probe.kl(swap), "seconds": time.time() - t})
            print(f"{name:40s} KL {rows[-1]['kl']:.4f}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    finally:
        hess.close()
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    out = {"work": str(a.work), "samples": a.samples, "calibration_tokens": hess.rows, "block": a.block,
           "scored_on": "held-out prose" if a.held_out else "training prose no calibration set reaches",
           "scored_tokens": probe.tokens, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
