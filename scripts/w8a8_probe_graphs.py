#!/usr/bin/env python
"""What INT8 activations per row (token) would cost in quality: fake-quantized copies of a bundle's fused fp32
graph, to score with `scripts/requantize_probe.py --graph NAME=int8-dynamic:PATH` (issue 46).

ONNX Runtime's MatMulInteger (u8 x s8, MLAS's VNNI GEMM) runs about twice as fast from 8 rows up as the 8-bit
MatMulNBits int8-dynamic runs (scripts/bench_matmul_kernels.py --integer), but it takes one activation scale per row at most
(its zero point is one number): MatMulNBits quantizes activations per block of 32. These graphs measure what that
coarser grain costs, each part alone and with the usual remedies, in fp32 arithmetic (quantize, then dequantize):

  w            weights only: INT8 per output channel, round to nearest
  a            activations only: symmetric INT8 per row (one scale per token and MatMul input)
  a:block=64   ...per block of 64 along the row instead (what a blocked kernel would need)
  wa           both (what MatMulInteger with per-row scales computes)
  wa:alpha=0.5:outliers=8
               ...after SmoothQuant (per-channel scales max|x|^a / max|w|^(1-a) moved into the weights) and with
               the 8 input channels of largest calibration range kept in float (LLM.int8()-style)

Calibration ranges: 24 calibration chats and 24 training prose texts (never the held-out ones), 512 tokens each.

  .venv/bin/python scripts/w8a8_probe_graphs.py smollm2.bundle /tmp/w8a8 w a wa wa:alpha=0.5:outliers=8
  .venv/bin/python scripts/requantize_probe.py smollm2.bundle - --graph wa=int8-dynamic:/tmp/w8a8/wa/model.onnx ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse(spec: str) -> dict:
    kind, *opts = spec.split(":")
    if kind not in ("w", "a", "wa"):
        raise ValueError(f"{spec}: the variant starts with w, a or wa")
    out = {"weights": "w" in kind, "acts": "a" in kind, "block": 0, "alpha": 0.0, "outliers": 0}
    for o in opts:
        key, _, value = o.partition("=")
        if key not in ("block", "alpha", "outliers") or not value:
            raise ValueError(f"{spec}: options are block=N, alpha=X, outliers=N")
        out[key] = float(value) if key == "alpha" else int(value)
    return out


def calibration_ranges(graph: Path, hf_dir: Path, inputs: list[str], dims) -> dict[str, np.ndarray]:
    """max |x| per channel of each MatMul input over the calibration texts (the fused fp32 graph, one text a call)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from export.load import chat_tokenizer
    from export.prose import prose_texts
    from export.quantize import QuantizeOptions, calibration_feeds

    tok = chat_tokenizer(hf_dir)
    opts = QuantizeOptions(mode="int8-dynamic", samples=24, max_calibration_tokens=512)
    seqs = [f["input_ids"][0] for f in calibration_feeds(hf_dir, opts, dims.num_layers, dims.num_kv_heads, dims.head_dim)]
    seqs += [np.array(tok.encode(t)[:512]) for t in prose_texts("train")[:24]]
    m = onnx.load(str(graph), load_external_data=False)
    for x in inputs:
        m.graph.output.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    import tempfile

    # beside the graph (ONNX Runtime reads its weights' data file relative to it), under a name of its own
    with tempfile.NamedTemporaryFile(dir=graph.parent, prefix="w8a8-ranges-", suffix=".onnx") as tmp:
        onnx.save(m, tmp.name)
        s = ort.InferenceSession(tmp.name, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    amax = {x: np.zeros(1, np.float32) for x in inputs}
    for ids in seqs:
        n = len(ids)
        feeds = {"input_ids": ids[None].astype(np.int64), "seqlens_k": np.array([n - 1], np.int32),
                 "total_sequence_length": np.array(n, np.int32), "logit_positions": np.array([[n - 1]], np.int64)}
        feeds |= {i.name: np.zeros((1, dims.num_kv_heads, n, dims.head_dim), np.float32) for i in s.get_inputs()
                  if i.name.startswith("past_key_values")}
        got = dict(zip(names, s.run(None, feeds)))
        for x in inputs:
            amax[x] = np.maximum(amax[x], np.abs(got[x]).reshape(-1, got[x].shape[-1]).max(0))
    return amax


def write(src: Path, dst: Path, v: dict, amax: dict[str, np.ndarray]) -> None:
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(src))
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    made = {o: n for n in g.node for o in n.output}
    consts = [numpy_helper.from_array(np.array(1 / 127, np.float32), "w8a8_inv127"),
              numpy_helper.from_array(np.array(1e-30, np.float32), "w8a8_eps"),
              numpy_helper.from_array(np.array([-1], np.int64), "w8a8_last")]
    weights = {n.name: w for n in g.node if (w := weight_of(n, inits, made)) is not None}
    wmax: dict[str, np.ndarray] = {}
    for n in g.node:
        if n.name in weights:
            wmax[n.input[0]] = np.maximum(wmax.get(n.input[0], 0), np.abs(weights[n.name]).max(1))
    nodes, done = [], {}
    for n in g.node:
        if n.name not in weights:
            nodes.append(n)
            continue
        p, x = n.name.replace("/", "_"), n.input[0]
        sq = np.ones_like(amax[x]) if not v["alpha"] else \
            np.maximum(amax[x], 1e-5) ** v["alpha"] / np.maximum(wmax[x], 1e-5) ** (1 - v["alpha"])
        w = weights[n.name] * sq[:, None]
        if v["weights"]:
            s = np.maximum(np.abs(w).max(0, keepdims=True), 1e-12) / 127
            w = np.clip(np.round(w / s), -127, 127) * s
        consts.append(numpy_helper.from_array(w.astype(np.float32), p + "_W"))
        if x not in done:
            done[x] = fake_quant_rows(nodes, consts, x, p, v, amax[x] / sq, (1 / sq).astype(np.float32))
        nodes.append(helper.make_node("MatMul", [done[x], p + "_W"], list(n.output), name=n.name))
    del g.node[:]
    g.node.extend(nodes)
    used = {i for nd in g.node for i in nd.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept + consts)
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              all_tensors_to_one_file=True)


def weight_source(n, inits, made) -> tuple[str, bool] | None:
    """(initializer, transposed) a MatMul's constant weight comes from (the tied head: the embedding through its
    Transpose), or None. (export.onnx_weights.weight_matmuls sees initializer weights only.)"""
    if n.op_type != "MatMul":
        return None
    b = n.input[1]
    if b in inits:
        return b, False
    t = made.get(b)
    if t is not None and t.op_type == "Transpose" and t.input[0] in inits:
        return t.input[0], True
    return None


def weight_of(n, inits, made) -> np.ndarray | None:
    """A MatMul's constant [K, N] weight in fp32, or None (see weight_source)."""
    from onnx import numpy_helper

    src = weight_source(n, inits, made)
    if src is None:
        return None
    w = numpy_helper.to_array(inits[src[0]]).astype(np.float32)
    return w.T if src[1] else w


def fake_quant_rows(nodes: list, consts: list, x: str, p: str, v: dict, amax: np.ndarray, inv_sq: np.ndarray) -> str:
    """Nodes that give x smoothed, its outlier channels kept, the rest through symmetric INT8 per row (or block)."""
    from onnx import helper, numpy_helper

    keep = np.ones(len(amax), np.float32)
    if v["outliers"]:
        keep[np.argsort(-amax)[: v["outliers"]]] = 0
    consts += [numpy_helper.from_array(inv_sq, p + "_isq"), numpy_helper.from_array(keep, p + "_in"),
               numpy_helper.from_array(1 - keep, p + "_out")]
    nodes += [helper.make_node("Mul", [x, p + "_isq"], [p + "_xs"]),
              helper.make_node("Mul", [p + "_xs", p + "_in"], [p + "_xi"]),
              helper.make_node("Mul", [p + "_xs", p + "_out"], [p + "_xo"])]
    if not v["acts"]:
        return p + "_xs"
    q = p + "_xi"
    if v["block"]:
        if len(amax) % v["block"]:
            raise SystemExit(f"{x}: {len(amax)} channels are no whole number of blocks of {v['block']}")
        consts += [numpy_helper.from_array(np.array([0, 0, -1, v["block"]], np.int64), p + "_blocks"),
                   numpy_helper.from_array(np.array([0, 0, -1], np.int64), p + "_rows")]
        nodes.append(helper.make_node("Reshape", [q, p + "_blocks"], [p + "_xb"]))
        q = p + "_xb"
    nodes += [helper.make_node("Abs", [q], [p + "_abs"]),
              helper.make_node("ReduceMax", [p + "_abs", "w8a8_last"], [p + "_mx"], keepdims=1),
              helper.make_node("Max", [p + "_mx", "w8a8_eps"], [p + "_mx1"]),
              helper.make_node("Mul", [p + "_mx1", "w8a8_inv127"], [p + "_s"]),
              helper.make_node("Div", [q, p + "_s"], [p + "_d"]), helper.make_node("Round", [p + "_d"], [p + "_r"]),
              helper.make_node("Mul", [p + "_r", p + "_s"], [p + "_fq"])]
    fq = p + "_fq"
    if v["block"]:
        nodes.append(helper.make_node("Reshape", [fq, p + "_rows"], [p + "_fqr"]))
        fq = p + "_fqr"
    nodes.append(helper.make_node("Add", [fq, p + "_xo"], [p + "_x8"]))
    return p + "_x8"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a built bundle whose work folder (BUNDLE.work) still has its stages")
    ap.add_argument("out", type=Path, help="a folder: one sub-folder per variant, named as given")
    ap.add_argument("variants", nargs="+")
    a = ap.parse_args()
    try:
        variants = {spec: parse(spec) for spec in a.variants}
    except ValueError as e:
        ap.error(str(e))
    from edge.bundle import Bundle

    work = a.bundle.parent / (a.bundle.name + ".work")
    src = work / "export" / "fused" / "model.onnx"
    if not src.is_file():
        ap.error(f"no fused fp32 graph at {src}: build the bundle with edge-export build (its work folder is kept)")
    import onnx

    m = onnx.load(str(src), load_external_data=False)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    made = {o: n for n in g.node for o in n.output}
    inputs = sorted({n.input[0] for n in g.node if weight_source(n, inits, made) is not None})
    print(f"calibration ranges of {len(inputs)} MatMul inputs ...", flush=True)
    amax = calibration_ranges(src, work / "load", inputs, Bundle.open(a.bundle).manifest.model)
    for spec, v in variants.items():
        write(src, a.out / spec.replace(":", "_").replace("=", ""), v, amax)
        print(f"wrote {a.out / spec.replace(':', '_').replace('=', '')}/model.onnx ({spec})", flush=True)


if __name__ == "__main__":
    main()
