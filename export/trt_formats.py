"""TensorRT's own quantized formats, written as explicit Q/DQ on the fp16 plain graph (export/fp16.py):

- `int4-qdq` (W4A16, Ampere and later): each weight MatMul reads its weight through
  DequantizeLinear(INT4 [K, N], fp16 scales [K / block, N], axis 0, block_size), opset 21, symmetric (no zero
  point: TensorRT's dequantize layer takes zero points of 0 only), the form onnx-tensorrt's importer reads as a
  block-quantized weight (scale of the input's rank, one blocked axis, an even last dimension). The levels are
  rounded by the project's GPTQ (export/gptq.py, symmetric), with the int4 engine's block size and, within its
  byte budget, the MatMuls whose 4-bit form hurts most (export/sensitivity.py) kept at INT8 per output channel,
  as the LM head always is (which the embedding gathers its rows from, export/embedding.py). Activations stay
  fp16: TensorRT runs these as weight-only GEMMs.
- `fp8-qdq` (Ada and later): FP8 E4M3 weights per output channel (GPTQ-rounded on the E4M3 grid), and each weight
  MatMul's input through QuantizeLinear/DequantizeLinear to FP8 per tensor, its scale the calibrated range / 448
  over the calibration chats' prefill on the fp32 graph (max |x|, or clipped where the output error is less), opset
  19; the activations whose FP8 form hurts most per byte stay fp16 within int8-qdq's byte budget. The LM head stays
  fp16 (as int8-qdq keeps it float).

ONNX Runtime's CPU kernels run both (DequantizeLinear with INT4 blocks and FP8 Q/DQ, checked on onnxruntime
1.32) with `session.disable_quant_qdq` (edge/precisions.py): the float arithmetic Q/DQ defines, so the evaluate
stage scores them before any GPU sees them. Without it ONNX Runtime fuses DQ(INT4) -> MatMul into MatMulNBits
with 8-bit activations, which is not what TensorRT computes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from edge.errors import RecipeError
from edge.precisions import FP8, INT4_QDQ
from export.int8_search import FP8_MAX, FP8_OPSET
from export.onnx_weights import GraphWeights, graph_bytes, set_opset, untie_lm_head, weight_matmuls

log = logging.getLogger("edgechat")
INT4_OPSET = 21  # INT4 in DequantizeLinear and its block_size attribute are opset 21's
FP16_TINY = float(np.finfo(np.float16).tiny)  # the smallest normal fp16 scale (TensorRT wants scales > 0)
INT4_BLOCKS = (128, 64, 32, 16)  # the block sizes tried, largest first, when the asked one does not divide K


def block_for(k: int, asked: int) -> int:
    """The block size of a weight with `k` input rows: `asked` if it divides k, else the largest smaller one that
    does (TensorRT infers the block from the shapes: it must tile K exactly). 0: none does."""
    return next((b for b in (asked, *INT4_BLOCKS) if b <= asked and k % b == 0), 0)


def head_matmul(model) -> object | None:
    """The LM head: the weight MatMul whose output is the logits output, or reaches it through one Cast."""
    outs = {o.name for o in model.graph.output}
    casts = {n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.output[0] in outs}
    return next((n for n in weight_matmuls(model) if n.output[0] in outs | casts), None)


def fp16_graph(fp32_dir: Path, work: Path) -> GraphWeights:
    """The fp16 plain graph of export/fp16.py, written under `work`, untied (the head its own weight)."""
    from export import fp16

    work.mkdir(parents=True, exist_ok=True)
    fp16.run(fp32_dir, work)
    gw = GraphWeights(work / "model.onnx")
    untie_lm_head(gw)
    return gw


def int8_channel(w: np.ndarray, h: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 per output channel: (q [K, N] int8, scales [N] fp32), GPTQ-rounded when `h` is given."""
    k, n = w.shape
    if h is not None:
        from export.gptq import gptq_block_quant

        q, s, _ = gptq_block_quant(w, h, 8, k, symmetric=True)
        return np.ascontiguousarray((q[:, 0, :k].astype(np.int16) - 128).astype(np.int8).T), s[:, 0]
    s = np.maximum(np.maximum(w.max(axis=0), -w.min(axis=0)), 1e-8) / 127.0
    q = np.empty(w.shape, np.int8)
    for j in range(0, n, 4096):  # a slab of columns at a time: no weight-sized fp32 temporaries (the LM head)
        q[:, j:j + 4096] = np.clip(np.round(w[:, j:j + 4096] / s[j:j + 4096]), -127, 127)
    return q, s.astype(np.float32)


def _int4_blocks(w: np.ndarray, h: np.ndarray | None, block: int, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4 blocks along K: (levels [K, N] in -8..7, scales [K / block, N] fp32), GPTQ-rounded when `h`
    is given, else round to nearest with each block's scale max |w| / 7 (`--int4-rounding minmax`)."""
    k, n = w.shape
    if h is None:
        s = np.maximum(np.abs(w.reshape(k // block, block, n)).max(axis=1), 1e-8) / 7.0  # [K / block, N]
        q = np.clip(np.round(w / np.repeat(s, block, axis=0)), -8, 7).astype(np.int8)
        return q, s.astype(np.float32)
    from export.gptq import gptq_block_quant

    q, s, _ = gptq_block_quant(w, h, 4, block, damp=damp, symmetric=True)  # q [N, K / block, block], zero point 8
    return np.ascontiguousarray((q.reshape(q.shape[0], k).astype(np.int8) - 8).T), np.ascontiguousarray(s.T)


def _fp16_scale(s: np.ndarray) -> np.ndarray:
    return np.maximum(s, FP16_TINY).astype(np.float16)


def _dequantize_weight(gw: GraphWeights, node, q, scale, axis: int, block: int = 0, zero_point: bool = False,
                       shapes: tuple | None = None) -> None:
    """Replace the MatMul's weight by DequantizeLinear(q, scale) right before it (in place in the node list).
    `q` and `scale` are arrays, or callables computed when the graph is saved, whose (dims, dtype) `shapes` gives."""
    from onnx import helper

    wname = node.input[1]
    qname = wname + "_quantized"
    (q_dims, q_type), (s_dims, s_type) = shapes or ((q.shape, q.dtype), (scale.shape, scale.dtype))
    gw.set(qname, q, dims=q_dims, dtype=q_type)
    gw.set(wname + "_scale", scale, dims=s_dims, dtype=s_type)
    inputs = [qname, wname + "_scale"]
    if zero_point:  # the head: export/embedding.py gathers a tied embedding's rows from it and reads its zeros
        gw.set(wname + "_zero_point", np.zeros(s_dims, q_type))
        inputs.append(wname + "_zero_point")
    attrs = {"axis": axis} | ({"block_size": block} if block else {})
    dq = helper.make_node("DequantizeLinear", inputs, [wname + "_dq"], name=node.name + "/DequantizeLinear", **attrs)
    node.input[1] = wname + "_dq"
    nodes = gw.model.graph.node
    nodes.insert(list(nodes).index(node), dq)


class _Once:
    """One weight's quantization (levels, scales), computed when the first of its parts is written and dropped
    once both are: the streamed graph holds one weight's result at a time, not the model's."""

    def __init__(self, fn: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
        self.fn, self.value, self.read = fn, None, set()

    def part(self, i: int) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            if self.value is None:
                self.value, self.read = self.fn(), set()
            v = self.value[i]
            self.read.add(i)
            if len(self.read) == 2:
                self.value = None
            return v
        return get


def _int4():
    import ml_dtypes

    return np.dtype(ml_dtypes.int4)


def _finish(gw: GraphWeights, dst: Path) -> None:
    from export.embedding import quantize_embedding

    gw.drop_unused()
    quantize_embedding(gw, dequantize_first=True)  # TensorRT's form: DequantizeLinear then Gather
    gw.save(dst / "model.onnx")


# ----------------------------------------------------------------------------- int4-qdq


def write_int4_qdq(fp32_dir: Path, dst: Path, block: int, hessian, promoted: set[str],
                   levels: dict | None = None, damp: float = 0.03) -> dict:
    """The int4-qdq graph of the fp32 plain graph in `fp32_dir` (see `int4_qdq_graph`)."""
    work = dst / "fp16-graph"
    metrics = int4_qdq_graph(fp16_graph(fp32_dir, work), dst, block, hessian, promoted, levels, damp)
    shutil.rmtree(work, ignore_errors=True)
    return metrics


def int4_qdq_graph(gw: GraphWeights, dst: Path, block: int, hessian, promoted: set[str], levels: dict | None = None,
                   damp: float = 0.03, lazy: bool = False) -> dict:
    """`gw` (the fp16 plain graph, untied) -> dst/model.onnx: every weight MatMul INT4 in blocks (GPTQ when
    `hessian` is given, else round to nearest), the head and `promoted` INT8 per channel. `levels` (MatMul name
    -> its result) is filled and read, so a second graph of the same weights (the budget's) rounds only what
    changed: GPTQ is most of the build's time (minutes per pass over 210 MatMuls). `lazy` (the streaming build):
    each weight is read and quantized when the graph is saved, one at a time, and nothing is kept."""
    levels = {} if levels is None else levels
    set_opset(gw, INT4_OPSET)
    head = head_matmul(gw.model)
    blocks: dict[str, int] = {}
    eight: list[str] = []
    for node in weight_matmuls(gw.model):
        k, n = gw.shape(node.input[1])
        b = block_for(k, block)
        bits = 8 if node is head or node.name in promoted or not b or n % 2 else 4

        def quantized(node=node, weight=node.input[1], bits=bits, b=b) -> tuple[np.ndarray, np.ndarray]:
            if (node.name, bits) in levels:
                return levels[node.name, bits]
            w = gw.array(weight).astype(np.float32)
            h = hessian(node.name) if hessian is not None else None
            q, s = int8_channel(w, h) if bits == 8 else _int4_blocks(w, h, b, damp)
            q, s = (q if bits == 8 else q.astype(_int4())), _fp16_scale(s)
            if not lazy:
                levels[node.name, bits] = q, s
            return q, s

        s_dims = (n,) if bits == 8 else (k // b, n)
        shapes = ((k, n), np.int8 if bits == 8 else _int4()), (s_dims, np.float16)
        if lazy:
            once = _Once(quantized)
            q, s = once.part(0), once.part(1)
        else:
            q, s = quantized()
        if bits == 8:
            _dequantize_weight(gw, node, q, s, axis=1, zero_point=node is head, shapes=shapes)
            eight.append(node.name)
        else:
            _dequantize_weight(gw, node, q, s, axis=0, block=b, shapes=shapes)
            blocks[node.name] = b
    _finish(gw, dst)
    return {"int4_matmuls": len(blocks), "int4_blocks": sorted(set(blocks.values())), "int8_matmuls": eight}


def int4_qdq(fp32_dir: Path, dst: Path, opts, hessian, sensitivity_feeds: Callable[[], list[dict]]) -> dict:
    """quantize.run's int4-qdq: the all-4-bit graph, then, given a budget (int4_budget_mb / int4_extra_ratio),
    the MatMuls whose 4-bit form moves KL to fp32 most per extra byte promoted to INT8 while the file fits."""
    from export import sensitivity

    levels: dict = {}
    metrics = write_int4_qdq(fp32_dir, dst, opts.int4_block_size, hessian, set(), levels, opts.int4_gptq_damp)
    base = graph_bytes(dst / "model.onnx")
    metrics |= {"int4_block_size": opts.int4_block_size, "int4_all4_bytes": base,
                "int4_rounding": f"{'gptq' if hessian is not None else 'minmax'} (symmetric)"}
    if opts.int4_budget_mb is None and opts.int4_extra_ratio <= 0:
        return metrics
    budget = int(opts.int4_budget_mb * 1e6) if opts.int4_budget_mb is not None else int(base * (1 + opts.int4_extra_ratio))
    if budget < base:
        raise RecipeError(f"int4_budget_mb {budget / 1e6:.1f} is less than the all-4-bit int4-qdq engine "
                          f"({base / 1e6:.1f} MB): raise it, or leave it unset")
    gw = GraphWeights(fp32_dir / "model.onnx")
    untie_lm_head(gw)
    head = head_matmul(gw.model)
    shapes = {n.name: gw.shape(n.input[1]) for n in weight_matmuls(gw.model) if n is not head}
    del gw
    cost = {t: k * n + 2 * n - (k * n // 2 + 2 * n * k // max(block_for(k, opts.int4_block_size), 1))
            for t, (k, n) in shapes.items() if block_for(k, opts.int4_block_size) and n % 2 == 0}
    feeds = sensitivity_feeds()
    cache = sensitivity.cache_path(dst, fp32_dir / "model.onnx", opts, list(cost), feeds)  # another budget's, if measured
    kept = sensitivity.read_kept(cache)
    if kept:
        sens = kept[0]
    else:
        probe = sensitivity.Probe(fp32_dir / "model.onnx", dst, feeds)
        try:
            def quant(node: str, w: np.ndarray) -> np.ndarray:
                b = block_for(w.shape[0], opts.int4_block_size)
                q, s = _int4_blocks(w, hessian(node) if hessian is not None else None, b, opts.int4_gptq_damp)
                return q.astype(np.float32) * np.repeat(s, b, axis=0)

            sens = sensitivity.measure(probe, quant, False, skip=lambda t: t not in cost)
            sensitivity.write_kept(cache, sens, probe.tokens)
        finally:
            del probe
            for f in ("probe.onnx", "probe.onnx.data", "probe-inputs.onnx"):
                (dst / f).unlink(missing_ok=True)
    chosen = sensitivity.allocate(sens, cost, budget - base)
    while True:
        metrics |= write_int4_qdq(fp32_dir, dst, opts.int4_block_size, hessian, set(chosen), levels, opts.int4_gptq_damp)
        if graph_bytes(dst / "model.onnx") <= budget or not chosen:
            break
        chosen.pop()  # the graph's own records grew past the plan: the least KL per byte goes back to 4 bits
    return metrics | {"int4_budget_bytes": budget, "int4_8bit_matmuls": chosen,
                      "int4_sensitivity": dict(sorted(sens.items(), key=lambda kv: -kv[1]))}


# ----------------------------------------------------------------------------- fp8-qdq


def activation_ranges(plain: Path, work: Path, feeds: list[dict], names: list[str],
                      rows_per_text: int = 16) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Max |x| per channel of each named weight MatMul's input over the calibration feeds, on the plain fp32 graph,
    and `rows_per_text` rows of each text's input (evenly spaced, the first included), both by input tensor name
    (export/int8_search.py `Search` reads them as int8-qdq's block-by-block pass writes them)."""
    import onnx
    import onnxruntime as ort

    gw = GraphWeights(plain)
    model = gw.model
    inputs = {n.name: n.input[0] for n in model.graph.node if n.name in names}
    have = {o.name for o in model.graph.output}
    for t in sorted(set(inputs.values()) - have):
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    gw.save(work / "ranges.onnx")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    amax: dict[str, np.ndarray] = {}
    rows: dict[str, list[np.ndarray]] = {}
    try:
        sess = ort.InferenceSession(str(work / "ranges.onnx"), so, providers=["CPUExecutionProvider"])
        tensors = sorted(set(inputs.values()))
        for f in feeds:
            for t, v in zip(tensors, sess.run(tensors, f)):
                v = v.reshape(-1, v.shape[-1])
                m = np.abs(v).max(axis=0)
                amax[t] = m if t not in amax else np.maximum(amax[t], m)
                if rows_per_text:
                    rows.setdefault(t, []).append(v[np.unique(np.linspace(0, len(v) - 1, min(rows_per_text, len(v))).astype(int))])
    finally:
        for f in ("ranges.onnx", "ranges.onnx.data"):
            (work / f).unlink(missing_ok=True)
    return ({t: m.astype(np.float32) for t, m in amax.items()},
            {t: np.concatenate(r).astype(np.float32) for t, r in rows.items()})


def fp8_weight(w: np.ndarray, h: np.ndarray | None, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """FP8 E4M3 per output channel: (levels [K, N] float8_e4m3fn, fp16 scales [N]: max |w| / 448), GPTQ-rounded
    on the inputs' X^T X `h` where given, else rounded to nearest."""
    import ml_dtypes

    s = _fp16_scale(np.maximum(np.abs(w).max(axis=0), 1e-8) / FP8_MAX)
    if h is not None:
        from export.gptq import gptq_fp8

        return gptq_fp8(w, h, s.astype(np.float32), damp), s
    return np.clip(w / s.astype(np.float32), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), s


def fp8_qdq(fp32_dir: Path, dst: Path, opts, calibration_feeds: Callable[[], list[dict]],
            keep_float: set[str] = frozenset(), hessian=None,
            sensitivity_feeds: Callable[[], list[dict]] | None = None) -> dict:
    """quantize.run's fp8-qdq: FP8 E4M3 weights per output channel and FP8 activations per tensor on every weight
    MatMul but the LM head and those in `keep_float` (fp16), int8-qdq's measured choices with FP8's errors:

    - ranges: `opts.qdq_range` "max", or "mse" (max |x| times the clip whose quantized output error is least);
    - weights GPTQ-rounded on the FP8 grid with `hessian`, damping `opts.int8_gptq_damp`;
    - with `sensitivity_feeds`, the activations whose FP8 form moves KL most per byte stay fp16 within
      `opts.qdq_float_ratio` of the FP8 weights' bytes.
    No SmoothQuant: per-activation SmoothQuant measured worse for FP8 on SmolLM2 (docs/quality.md, "fp8-qdq with
    int8-qdq's measured choices")."""
    import ml_dtypes
    from onnx import helper

    from export.int8_search import Search

    plain = GraphWeights(fp32_dir / "model.onnx")
    head = head_matmul(plain.model)
    matmuls = {n.name: n for n in weight_matmuls(plain.model) if n is not head and n.name not in keep_float}
    readers: dict[str, list[str]] = {}  # by the fp32 graph's tensor: q, k and v (gate and up) share one range and Q/DQ
    for n in matmuls.values():
        readers.setdefault(n.input[0], []).append(n.name)
    feeds = calibration_feeds()
    amax, rows = activation_ranges(fp32_dir / "model.onnx", dst, feeds, list(matmuls),
                                   rows_per_text=16 if opts.qdq_range == "mse" else 0)
    search = Search(amax, rows, range_method=opts.qdq_range, fp8=True)
    del rows
    ranges: dict[str, float] = {}
    levels: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for x, ns in readers.items():  # each weight read once: its range's error, then its levels
        weights = [plain.array(matmuls[n].input[1]).astype(np.float32) for n in ns]
        ranges[x] = search.range(x, weights, None) if x in amax else 0.0
        search.rows.pop(x, None)  # its sample rows are done with
        if ranges[x] > 0:  # else never reached by the calibration: no scale > 0, the MatMuls stay fp16
            levels |= {n: fp8_weight(w, hessian(n) if hessian else None, opts.int8_gptq_damp) for n, w in zip(ns, weights)}
    unused = [n for x, ns in readers.items() for n in ns if not ranges[x] > 0]
    budget: dict = {}
    if sensitivity_feeds is not None and opts.qdq_float_ratio > 0:
        from export.int8_search import budget_record, float_groups

        groups = {x: ns for x, ns in readers.items() if ranges[x] > 0}
        chosen, sens = float_groups(fp32_dir / "model.onnx", dst, groups, ranges,
                                    {n: q.astype(np.float32) * s.astype(np.float32) for n, (q, s) in levels.items()},
                                    sensitivity_feeds(), opts.qdq_float_ratio, opts.qdq_float_kl, fp8=True)
        for x in chosen:
            for n in groups[x]:
                del levels[n]
        budget = budget_record(opts.qdq_float_ratio, opts.qdq_float_kl, chosen, sens)
    del plain
    work = dst / "fp16-graph"
    gw = fp16_graph(fp32_dir, work)
    set_opset(gw, FP8_OPSET)
    zero = "fp8_zero_point"
    gw.set(zero, np.zeros((), ml_dtypes.float8_e4m3fn))
    quantized: set[str] = set()
    for node in [n for n in weight_matmuls(gw.model) if n.name in levels]:
        q, s = levels.pop(node.name)
        if q.shape != gw.shape(node.input[1]):
            raise ValueError(f"fp8-qdq: {node.name}'s FP8 levels are {q.shape}, its fp16 weight {gw.shape(node.input[1])}")
        _dequantize_weight(gw, node, q, s, axis=1)
        x = node.input[0]  # the fp16 graph's name of the fp32 graph's matmuls[node.name].input[0]
        if x not in quantized:  # one Q/DQ pair per input tensor, before its first reader
            xs = node.name + "/input_scale"
            gw.set(xs, _fp16_scale(np.array(ranges[matmuls[node.name].input[0]] / FP8_MAX, np.float32)))
            at = list(gw.model.graph.node).index(node)
            gw.model.graph.node.insert(at, helper.make_node("QuantizeLinear", [x, xs, zero], [x + "/fp8"],
                                                             name=node.name + "/QuantizeLinear"))
            gw.model.graph.node.insert(at + 1, helper.make_node("DequantizeLinear", [x + "/fp8", xs, zero],
                                                                 [x + "/fp8_dq"], name=node.name + "/input/DequantizeLinear"))
            quantized.add(x)
        node.input[0] = x + "/fp8_dq"
    if levels:  # the fp16 graph renamed a MatMul: it would stay fp16 unannounced
        raise ValueError(f"fp8-qdq: the fp16 graph has no MatMul named {next(iter(levels))}, which the fp32 graph has")
    fp8 = sum(1 for n in gw.model.graph.node if n.op_type == "MatMul" and n.input[0].endswith("/fp8_dq"))
    floats = [n.name for n in weight_matmuls(gw.model) if not n.input[0].endswith("/fp8_dq")]
    _finish(gw, dst)
    shutil.rmtree(work, ignore_errors=True)
    clips = [c["clip"] for c in search.chosen.values() if "clip" in c]
    return {"fp8_matmuls": fp8, "calibration_samples": len(feeds), "float_matmuls": floats, "never_calibrated": unused,
            "fp8_range": opts.qdq_range, "fp8_rounding": "gptq" if hessian else "minmax",
            "activation_clips": {str(c): clips.count(c) for c in sorted(set(clips))},
            "activation_ranges": {x: float(r) for x, r in sorted(ranges.items())}} | budget


def run(fp32_dir: Path, dst: Path, opts, hessian, calibration_feeds: Callable[[], list[dict]],
        sensitivity_feeds: Callable[[], list[dict]], keep_float: set[str] = frozenset()) -> dict:
    """quantize.run's entry for the TensorRT formats (opts: export.quantize.QuantizeOptions; the feeds: the
    calibration chats' prefill, and the sensitivity texts GPTQ did not fit on, both from export/quantize.py;
    `keep_float`: fp8-qdq's MatMuls left fp16, as int8-qdq's qdq_float_nodes)."""
    if opts.mode == INT4_QDQ:
        return int4_qdq(fp32_dir, dst, opts, hessian, sensitivity_feeds)
    if opts.mode == FP8:
        return fp8_qdq(fp32_dir, dst, opts, calibration_feeds, keep_float, hessian, sensitivity_feeds)
    raise ValueError(f"trt_formats: not a TensorRT Q/DQ format: {opts.mode}")
