"""Re-run one quantize stage of a built bundle with other QuantizeOptions and score the graph it writes like
`edge-export eval` does (KL to the bundle's fp32 graph on held-out chats and prose, the same token ids).
For choosing a quantization option without a whole build; prints a line per set, writes JSON.

    python scripts/requantize_probe.py smollm2.bundle head64 \
        '{"mode": "int4-weight", "int4_block_size": 64, "int4_budget_mb": 105.4, "int4_lm_head_block": 64}' \
        --out /tmp/probes

The bundle's work folder (OUT.work: its load and export stages) must still exist. The int4 sensitivity cache
is kept in --out, so probes that change only the budget or the head re-use it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("name", help="a name for this probe (its folder and JSON under --out)")
    ap.add_argument("options", type=json.loads, help="export.quantize.QuantizeOptions as JSON, with its mode")
    ap.add_argument("--out", type=Path, default=Path("probes"))
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--prose-tokens", type=int, default=2048)
    ap.add_argument("--data", action="append", default=[], metavar="FILE.txt",
                    help="also score on this text (documents split at blank lines, --prose-tokens of it), as "
                         "`edge-export eval --data FILE` does; repeatable (e.g. a domain no calibration text is from)")
    ap.add_argument("--no-default-sets", action="store_true", help="score only on the --data files")
    ap.add_argument("--score-only", action="store_true", help="score the graph an earlier run of this probe wrote")
    a = ap.parse_args()

    from edge.bundle import Bundle
    from edge.errors import EdgeChatError
    from edge.decode.tokenizer import ChatTokenizer
    from export.bundle_eval import EvalRequest, _onnx_logits, eval_sets
    from export.evaluate import summarize, token_metrics
    from export.quantize import QuantizeOptions, run

    if not isinstance(a.options, dict) or "mode" not in a.options:
        ap.error('options must be a JSON object with a "mode", e.g. \'{"mode": "int8-dynamic"}\'')
    try:
        opts = QuantizeOptions(**a.options)
        b = Bundle.open(a.bundle)
    except (TypeError, EdgeChatError) as e:  # an unknown option name, a bad value, no such bundle
        ap.error(str(e))
    m = b.manifest
    work = a.bundle.with_name(a.bundle.name + ".work")
    fused = work / "export" / "fused"
    dst = a.out / a.name
    dst.mkdir(parents=True, exist_ok=True)
    from edge import precisions

    # the graph the build quantizes for this mode: the fused one (int8-dynamic, int4-weight) where the export wrote
    # one, else the plain fp32 graph (the Q/DQ formats)
    variant = "fused" if fused.is_dir() and precisions.get(opts.mode).variant == "fused" else "plain"
    t = time.time()
    if a.score_only:
        from export.onnx_weights import graph_bytes

        metrics = {"size_bytes": graph_bytes(dst / "model.onnx")} | json.loads((a.out / f"{a.name}.json").read_text()
                                                                               if (a.out / f"{a.name}.json").is_file() else "{}")
    else:
        metrics = run(fused if variant == "fused" else work / "export", work / "load", dst, opts)
    seconds = time.time() - t
    print(f"{a.name}: {'scored the graph' if a.score_only else f'quantized in {seconds:.0f} s'}, {metrics['size_bytes'] / 1e6:.2f} MB, "
          f"{len(metrics.get('int4_8bit_matmuls', []))} MatMuls promoted to 8 bits", flush=True)
    tok = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer)
    sets = {} if a.no_default_sets else eval_sets(tok, EvalRequest(bundle=b.root, chats=a.chats, prose_tokens=a.prose_tokens),
                                                  m.model.max_context)
    for f in a.data:
        sets |= eval_sets(tok, EvalRequest(bundle=b.root, data=f, prose_tokens=a.prose_tokens), m.model.max_context)
    fp32 = m.engine("fp32")
    # the probe's graph has the I/O of the bundle's engine of that mode, else the I/O of the graph it was quantized
    # from (the fused graph's where the work folder has one and the mode quantizes it: int8-dynamic, int4-weight)
    from edge.io_contract import io_for_variant

    same = next((e for e in m.engines if e.name == a.options.get("mode")), None)
    io = m.engine_io(same) if same else io_for_variant(variant).to_dict()
    ref = _onnx_logits(b.path(fp32.file), m.model, m.engine_io(fp32), None)
    # the precision sets its session options: a Q/DQ graph runs as written (edge/precisions.py), as `eval` runs it
    probe = _onnx_logits(dst / "model.onnx", m.model, io, None, precision=a.options["mode"])
    out = {"name": a.name, "options": a.options, "size_mb": metrics["size_bytes"] / 1e6,
           "int4_8bit_matmuls": metrics.get("int4_8bit_matmuls", []), "quantize_seconds": round(seconds)}
    for kind, seqs in sets.items():
        s = summarize([token_metrics(probe(ids), ref(ids), np.array(ids[1:])) for ids in seqs])
        out[kind] = s
        print(f"{a.name} {kind}: KL {s['kl_to_fp32']:.4f}, top-1 {s['top1_agreement']:.1%}", flush=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
