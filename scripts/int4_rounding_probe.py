"""How much each 4-bit rounding costs, all weight MatMuls at 4 bits (the LM head kept fp32), as KL to the
fp32 graph on text no calibration reaches (the last training-prose documents; --held-out: the first
held-out ones; --score FILE: documents of a text file, split at blank lines, e.g. a domain no calibration set is
from). With --calib, GPTQ's statistics come from each named mix of calibration domains in turn
(export/calibration_texts.py), so calibration sets and roundings are compared on the same scored tokens.
Prints a table, writes JSON. Uses a build's work folder (its load and export stages):

    python scripts/int4_rounding_probe.py smollm2.bundle.work --samples 96 --block 64 --json probe.json
    python scripts/int4_rounding_probe.py W --samples 32 --calib two=chat,news --calib five=chat,news,literature,code,docs \
        --variant 'damp 0.01={"damp": 0.01}' --score fortunes.txt --json probe.json
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
    "gptq+act+search, damp 0.003 (GPTQ's own default)": {},
}


def _pair(text: str, parse=lambda v: v) -> tuple[str, object]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, parse(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="a build's OUT.work folder (load/ and export/model.onnx)")
    ap.add_argument("--samples", type=int, default=96, help="calibration texts for GPTQ")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration text")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--docs", type=int, default=6, help="scoring documents, 256 tokens each")
    ap.add_argument("--held-out", action="store_true", help="score on held-out prose instead of unused training prose")
    ap.add_argument("--score", type=Path, action="append", default=[], help="also score on this text file's documents")
    ap.add_argument("--score-tokens", type=int, default=2048, help="tokens scored per --score file (512-token windows)")
    ap.add_argument("--calib", type=lambda t: _pair(t, lambda v: tuple(v.split(","))), action="append", default=[],
                    help="NAME=domain,domain,...: a calibration mix, the texts split evenly (default chat,news)")
    ap.add_argument("--variant", type=lambda t: _pair(t, json.loads), action="append", default=[],
                    help='NAME=JSON of gptq_block_quant options, or NAME=null for min-max (default: the built-in table)')
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from export import gptq, hessians, sensitivity
    from export.evaluate import prose_windows
    from export.int4 import dequantize, fake_quant
    from export.load import chat_tokenizer, model_dims
    from export.prose import prose_texts
    from export.quantize import QuantizeOptions, gptq_feeds

    hf, plain = a.work / "load", a.work / "export" / "model.onnx"
    dims = model_dims(hf)
    calibs = dict(a.calib) or {"chat+news": ("chat", "news")}
    variants = dict(a.variant) or VARIANTS
    tok = chat_tokenizer(hf)
    base = gptq_feeds(hf, QuantizeOptions(mode="int4-weight", gptq_samples=1, gptq_tokens=8), dims)[0]

    def as_feeds(seqs: list[list[int]]) -> list[dict]:
        return [base | {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                        "position_ids": np.arange(len(ids), dtype=np.int64)[None]} for ids in seqs]

    docs = prose_texts("eval")[: a.docs] if a.held_out else prose_texts("train")[-a.docs:]
    sets = {"held-out prose" if a.held_out else "training prose no calibration reaches":
            as_feeds([tok.encode(t)[:256] for t in docs])}
    for f in a.score:
        texts = [d.strip() for d in f.read_text(encoding="utf-8").split("\n\n") if d.strip()]
        sets[f.name] = as_feeds(prose_windows(tok, texts, 512, a.score_tokens))
    work = a.work / "probe-tmp"
    work.mkdir(exist_ok=True)
    probes: dict = {}
    rows = []
    try:
        for i, (name, feeds) in enumerate(sets.items()):
            d = work / f"score{i}"
            d.mkdir(exist_ok=True)
            probes[name] = sensitivity.Probe(plain, d, feeds)
        first = next(iter(probes.values()))
        targets = {n: w for n, w in first.nodes.items() if "lm_head" not in n}
        for cname, domains in calibs.items():
            cal = gptq_feeds(hf, QuantizeOptions(mode="int4-weight", gptq_samples=a.samples, gptq_tokens=a.tokens,
                                                 gptq_domains=domains, gptq_chat_share=1 / len(domains)), dims)
            hess = hessians.Hessians(plain, work, cal)
            try:
                for vname, kw in variants.items():
                    if kw is None and rows and any(r["rounding"] == vname for r in rows):
                        continue  # min-max uses no calibration: once is enough
                    t = time.time()
                    if kw is None:
                        swap = {w: fake_quant(first.weights[w], 4, a.block, "minmax") for w in targets.values()}
                    else:
                        swap = {w: dequantize(*gptq.gptq_block_quant(first.weights[w], hess(n), 4, a.block, **kw),
                                              k=first.weights[w].shape[0]) for n, w in targets.items()}
                    row = {"calibration": None if kw is None else cname, "domains": None if kw is None else list(domains),
                           "rounding": vname, "options": kw}
                    row |= {f"kl {s}": p.kl(swap) for s, p in probes.items()}
                    row["seconds"] = round(time.time() - t)
                    rows.append(row)
                    print(f"{row['calibration'] or '-':12s} {vname:34s} " +
                          "  ".join(f"{s[:24]} {row[f'kl {s}']:.4f}" for s in probes) + f"  ({row['seconds']} s)", flush=True)
            finally:
                hess.close()
    finally:
        probes.clear()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    out = {"work": str(a.work), "samples": a.samples, "calibration_tokens": a.tokens, "block": a.block,
           "scored_tokens": {s: sum(f["input_ids"].shape[1] for f in feeds) for s, feeds in sets.items()}, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
