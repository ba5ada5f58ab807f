"""Re-run one quantize stage of a built bundle with other QuantizeOptions and score the graph it writes like
`edge-export eval` does (KL, top-1 and perplexity against the bundle's fp32 graph on held-out chats and prose,
the same token ids). For choosing a quantization option without a whole build; prints a line per set, writes JSON.

    python scripts/requantize_probe.py smollm2.bundle head64 \
        '{"mode": "int4-weight", "int4_block_size": 64, "int4_budget_mb": 105.4, "int4_lm_head_block": 64}' \
        --out /tmp/probes

Several probes in one run (the fp32 reference's logits computed once): NAME OPTIONS pairs, e.g.
`... int8 '{"mode": "int8-qdq", "samples": 32}' fp8 '{"mode": "fp8-qdq", "samples": 32}'`.

`--graph NAME=PRECISION:PATH` scores a graph written elsewhere (scripts/modelopt_qdq.py: NVIDIA Model Optimizer's)
beside the probes; `--dump-feeds DIR` writes what such a tool needs to quantize on the same data: the untied plain
fp32 graph, the calibration feeds of the first probe's options (feeds.npz) and the MatMuls its int8-qdq graph
quantizes (nodes.json), then stops.

The bundle's work folder (OUT.work: its load and export stages) must still exist. Each mode is quantized from the
graph a build quantizes it from (edge/precisions.py `variant`: the fused graph for the ONNX Runtime CPU engines,
the plain one for TensorRT's Q/DQ formats) and scored with the session settings the runtime gives that precision
(`session.disable_quant_qdq` for the Q/DQ graphs). The int4 sensitivity cache is kept in --out, so probes that
change only the budget or the head re-use it.
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
    ap.add_argument("probes", nargs="+", help="NAME OPTIONS pairs: a name for the probe (its folder and JSON under "
                                              "--out), then export.quantize.QuantizeOptions as JSON, with its mode")
    ap.add_argument("--out", type=Path, default=Path("probes"))
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--prose-tokens", type=int, default=2048)
    ap.add_argument("--data", action="append", default=[], metavar="FILE.txt",
                    help="also score on this text (documents split at blank lines, --prose-tokens of it), as "
                         "`edge-export eval --data FILE` does; repeatable (e.g. a domain no calibration text is from)")
    ap.add_argument("--no-default-sets", action="store_true", help="score only on the --data files")
    ap.add_argument("--score-only", action="store_true", help="score the graph an earlier run of this probe wrote")
    ap.add_argument("--keep", action="store_true", help="keep each probe's graph (default: deleted once scored)")
    ap.add_argument("--graph", action="append", default=[], metavar="NAME=PRECISION:PATH",
                    help="also score this graph (written by another tool) as that precision")
    ap.add_argument("--dump-feeds", type=Path, metavar="DIR",
                    help="write the plain graph, calibration feeds and quantized MatMul names for another tool, then stop")
    a = ap.parse_args()

    from edge import precisions
    from edge.bundle import Bundle
    from edge.errors import EdgeChatError
    from edge.decode.tokenizer import ChatTokenizer
    from export.bundle_eval import EvalRequest, _onnx_logits, eval_sets
    from export.evaluate import summarize, token_metrics
    from export.quantize import QuantizeOptions, run

    if a.probes == ["-"]:  # no probes: --dump-feeds, or only --graph
        a.probes = []
    if len(a.probes) % 2:
        ap.error("probes come in NAME OPTIONS pairs")
    pairs = []
    for name, text in zip(a.probes[::2], a.probes[1::2]):
        try:
            options = json.loads(text)
            if not isinstance(options, dict) or "mode" not in options:
                raise ValueError('options must be a JSON object with a "mode", e.g. \'{"mode": "int8-dynamic"}\'')
            pairs.append((name, options, QuantizeOptions(**options)))
        except (TypeError, ValueError, EdgeChatError) as e:  # bad JSON, an unknown option name, a bad value
            ap.error(f"{name}: {e}")
    if a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out} is a file: give a folder for the probes' graphs and JSON")
    graphs = []
    for spec in a.graph:
        name, _, rest = spec.partition("=")
        precision, _, path = rest.partition(":")
        if not name or not path:
            ap.error(f"--graph takes NAME=PRECISION:PATH, got {spec!r}")
        try:
            precisions.get(precision)
        except ValueError as e:
            ap.error(f"--graph {spec}: {e}")
        if not Path(path).is_file():
            ap.error(f"--graph {spec}: no graph file at {path}")
        graphs.append((name, precision, path))
    try:
        b = Bundle.open(a.bundle)
    except EdgeChatError as e:
        ap.error(str(e))
    m = b.manifest
    work = a.bundle.with_name(a.bundle.name + ".work")
    a.out.mkdir(parents=True, exist_ok=True)
    fused = work / "export" / "fused"
    _reuse_between_probes()
    if a.dump_feeds:
        dump_feeds(work, a.dump_feeds, pairs[0][2] if pairs else QuantizeOptions(mode="int8-qdq", samples=32))
        return
    tok = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer)
    sets = {} if a.no_default_sets else eval_sets(tok, EvalRequest(bundle=b.root, chats=a.chats, prose_tokens=a.prose_tokens),
                                                  m.model.max_context)
    for f in a.data:
        sets |= eval_sets(tok, EvalRequest(bundle=b.root, data=f, prose_tokens=a.prose_tokens), m.model.max_context)
    fp32 = m.engine("fp32")
    ref_logits = _onnx_logits(b.path(fp32.file), m.model, m.engine_io(fp32), None)
    refs = {kind: [ref_logits(ids) for ids in seqs] for kind, seqs in sets.items()}
    ref_ppl = {kind: summarize([token_metrics(r, r, np.array(ids[1:])) for r, ids in zip(refs[kind], seqs)])["perplexity"]
               for kind, seqs in sets.items()}
    print("fp32: perplexity " + ", ".join(f"{k} {v:.2f}" for k, v in ref_ppl.items()), flush=True)

    def score(name: str, probe, out: dict) -> None:
        """The probe graph's KL, top-1 and perplexity per text set, printed and written to --out/NAME.json."""
        for kind, seqs in sets.items():
            s = summarize([token_metrics(probe(ids), r, np.array(ids[1:])) for ids, r in zip(seqs, refs[kind])])
            out[kind] = s
            print(f"{name} {kind}: KL {s['kl_to_fp32']:.4f}, top-1 {s['top1_agreement']:.1%}, perplexity "
                  f"{s['perplexity']:.2f} ({s['perplexity'] / ref_ppl[kind] - 1:+.1%})", flush=True)
        (a.out / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))

    from edge.io_contract import io_for_variant

    for name, precision, path in graphs:  # with the I/O its inputs show: fused (seqlens_k, in-place K/V) or plain
        import onnx

        inputs = {i.name for i in onnx.load(path, load_external_data=False).graph.input}
        variant = "fused" if "seqlens_k" in inputs else "plain"
        probe = _onnx_logits(Path(path), m.model, io_for_variant(variant).to_dict(), None, precision=precision)
        score(name, probe, {"name": name, "graph": path, "precision": precision, "fp32_perplexity": ref_ppl})
        del probe
    for name, options, opts in pairs:
        plain = precisions.get(opts.mode).variant == "plain" or not fused.is_dir()
        dst = a.out / name
        dst.mkdir(parents=True, exist_ok=True)
        t = time.time()
        if a.score_only:  # the graph an earlier run of this probe wrote (with --keep)
            from export.onnx_weights import graph_bytes

            earlier = a.out / f"{name}.json"
            metrics = (json.loads(earlier.read_text()).get("metrics", {}) if earlier.is_file() else {}) | {
                "size_bytes": graph_bytes(dst / "model.onnx")}
        else:
            metrics = run(work / "export" if plain else fused, work / "load", dst, opts)
        took = time.time() - t
        print(f"{name}: {'scored the graph' if a.score_only else f'quantized in {took:.0f} s'}, "
              f"{metrics['size_bytes'] / 1e6:.2f} MB, {len(metrics.get('int4_8bit_matmuls', []))} weights (MatMuls or "
              "packed projections) promoted to 8 bits", flush=True)
        # the probe's graph has the I/O of the bundle's engine of that mode, else that of the graph it was
        # quantized from (the fused graph's for int8-dynamic and int4-weight, the plain one's for the Q/DQ formats)
        same = next((e for e in m.engines if e.name == opts.mode), None)
        io = m.engine_io(same) if same else io_for_variant("plain" if plain else "fused").to_dict()
        probe = _onnx_logits(dst / "model.onnx", m.model, io, None, precision=opts.mode)
        score(name, probe, {"name": name, "options": options, "size_mb": metrics["size_bytes"] / 1e6,
                            "quantize_s": round(took), "fp32_perplexity": ref_ppl,
                            "metrics": {k: v for k, v in metrics.items() if not isinstance(v, dict)},
                            "int4_8bit_matmuls": metrics.get("int4_8bit_matmuls", []),
                            **{k: metrics[k] for k in ("qdq_sensitivity", "smoothquant_alphas", "activation_clips")
                               if k in metrics}})
        del probe
        if not a.keep and not a.score_only:
            import shutil

            shutil.rmtree(dst, ignore_errors=True)


def _reuse_between_probes() -> None:
    """Probes of one run that differ only in later choices re-use the earlier steps' results (in memory, this
    process only): int8-qdq's activation statistics (same graph and feeds), GPTQ's INT8 levels (same weight and
    statistics) and the float budget's sensitivity (same groups and ranges: only the allocation is redone)."""
    import hashlib

    from export import int8_qdq, int8_search, sensitivity, trt_formats

    def digest(*arrays) -> str:
        h = hashlib.sha1()
        for x in arrays:
            h.update(np.ascontiguousarray(x).tobytes())
        return h.hexdigest()

    memo: dict = {}
    stats, channel, groups = int8_qdq.activation_stats, trt_formats.int8_channel, int8_search.float_groups

    def activation_stats(hf_dir, graph, feeds):
        key = ("stats", str(hf_dir), digest(*[f["input_ids"] for f in feeds]))
        if key not in memo:
            memo[key] = stats(hf_dir, graph, feeds)
        return memo[key]

    def int8_channel(w, h):
        key = ("gptq8", digest(w, h) if h is not None else digest(w))
        if key not in memo:
            memo[key] = channel(w, h)
        return memo[key]

    def float_groups(smoothed, work, grp, ranges, dequantized, feeds, ratio, enough=0.0, fp8=False):
        key = ("sens", fp8, repr(sorted(grp.items())), repr(sorted(ranges.items())),
               digest(*[dequantized[n] for ns in grp.values() for n in ns]))
        if key not in memo:
            memo[key] = groups(smoothed, work, grp, ranges, dequantized, feeds, ratio, fp8)[1]
        sens = memo[key]
        cost = {x: sum(int(dequantized[n].size) for n in ns) for x, ns in grp.items()}
        return sensitivity.allocate(sens, cost, int(ratio * sum(cost.values())), enough), sens

    int8_qdq.activation_stats, trt_formats.int8_channel, int8_search.float_groups = activation_stats, int8_channel, float_groups


def dump_feeds(work: Path, out: Path, opts) -> None:
    """The untied plain fp32 graph, `opts`' calibration feeds and the MatMuls int8-qdq quantizes, under `out`."""
    from export.load import model_dims
    from export.onnx_weights import GraphWeights, untie_lm_head, weight_matmuls
    from export.quantize import calibration_feeds, matching_matmuls

    out.mkdir(parents=True, exist_ok=True)
    dims = model_dims(work / "load")
    feeds = calibration_feeds(work / "load", opts, dims.num_layers, dims.num_kv_heads, dims.head_dim)
    np.savez(out / "feeds.npz", **{f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
    gw = GraphWeights(work / "export" / "model.onnx")
    untie_lm_head(gw)
    skip = set(matching_matmuls(gw.model, tuple(opts.qdq_float_nodes), dims.num_layers))
    nodes = [n.name for n in weight_matmuls(gw.model) if not n.input[1].endswith(".lm_head_T") and n.name not in skip]
    gw.save(out / "model.onnx")
    (out / "nodes.json").write_text(json.dumps(nodes))
    print(f"{out}: {len(feeds)} feeds, {len(nodes)} MatMuls to quantize")


if __name__ == "__main__":
    main()
