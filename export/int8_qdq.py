"""int8-qdq (TensorRT, W8A8): SmoothQuant folded into the weights, then symmetric Q/DQ on the weight MatMuls'
inputs, its activation ranges collected with the model run one decoder block at a time.

Why block by block: ONNX Runtime's `quantize_static` calibrates by running an augmented copy of the whole graph
(every MatMul's input and output made a graph output) in a session of its own, beside the graph it loaded and
the one it writes: several copies of the model's weights at once. Here the ranges come from the Hugging Face
model one block at a time (`ActivationAbsMax`, the way GPTQ's statistics are collected, export/hessians.py
`LayerHessians`): max |x| per input channel of every weight MatMul over the calibration chats. SmoothQuant's
scales s come from the same numbers, and the smoothed graph's range of an input is max_c(max|x_c| / s_c),
the same range (within float rounding) ONNX Runtime's MinMax calibrator measures on the smoothed graph, handed
to `quantize_static` as its calibration cache, so it never runs the model. A model whose blocks cannot run
alone (or an ONNX Runtime without the cache) falls back to the whole-graph calibration, as before.

The same pass keeps a sample of each input's rows, on which export/int8_search.py measures each activation's
SmoothQuant alpha and range (max, or clipped where that reproduces the MatMuls' outputs better). ONNX Runtime
writes the Q/DQ graph; its round-to-nearest INT8 weights are then replaced by GPTQ's (`gptq_weights`), and the
activations whose INT8 form moves KL most per byte are put back to float within `qdq_float_ratio`
(`unquantize`). Measured on SmolLM2-135M in docs/quality.md ("int8-qdq, measured per layer").
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import numpy as np

from export.hessians import LayerHessians
from export.onnx_weights import GraphWeights, weight_matmuls

log = logging.getLogger("edgechat")


class ActivationAbsMax(LayerHessians):
    """Max |x| per channel of each weight MatMul's input on `feeds`, by input name: the model one block at a time."""

    method = "by block (torch)"

    def _add(self, acc: dict[str, np.ndarray], x: str, a: np.ndarray) -> None:
        m = np.abs(a).max(axis=0)
        acc[x] = m if x not in acc else np.maximum(acc[x], m)

    def _done(self, acc: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return acc

    def all(self) -> dict[str, np.ndarray]:
        """Every input's per-channel max |x|, in one pass over the blocks (graph order is block order)."""
        out: dict[str, np.ndarray] = {}
        for node, x in self.input_of.items():
            if x not in out:
                out[x] = self(node).astype(np.float32)
        return out


def smooth(gw: GraphWeights, feeds: list[dict], alpha: float, workdir: Path,
           amax: dict[str, np.ndarray] | None = None, search=None) -> dict[str, np.ndarray]:
    """SmoothQuant: scale weight-MatMul input channels by s and fold 1/s into what produced them.

    Two exact folds: into the RMSNorm scale when the activation is Mul(x, 1-D constant)
    (q/k/v, gate/up), and into up_proj's output columns when it is Mul(act(gate), up_proj(x))
    (down_proj). Only where the activation feeds nothing but weight MatMuls (and Shape).
    The activation statistics (max |x| per channel over the calibration tokens) are `amax` where given
    (`activation_amax`: the model block by block), else from an ONNX Runtime session over the graph as saved
    in `workdir`; the scaled weights are computed on save. `search` (export/int8_search.py `Search`): each
    activation's s chosen by its measured output error instead of the one `alpha`. Returns each smoothed
    activation's s (its MatMuls now read x / s).
    """
    model = gw.model
    inits = gw.names()
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    wm = {id(n) for n in weight_matmuls(model)}

    def const_vector(name: str) -> str | None:
        """The 1-D initializer behind `name`, looking through Identity (the exporter dedupes equal weights)."""
        while name not in inits and name in producers and producers[name].op_type == "Identity":
            name = producers[name].input[0]
        return name if name in inits and len(gw.shape(name)) == 1 else None

    groups = {}
    for n in weight_matmuls(model):
        act = n.input[0]
        p = producers.get(act)
        if p is None or p.op_type != "Mul" or act in groups:
            continue
        if n.input[1].endswith(".lm_head_T"):
            continue  # tied LM head: scaling it would break the tie the INT8 embedding relies on
        users = consumers.get(act, [])
        # Shape consumers read only the shape, so the fold stays exact for them
        if not all(id(c) in wm or c.op_type == "Shape" for c in users):
            continue
        vec = [(k, const_vector(i)) for k, i in enumerate(p.input) if const_vector(i) is not None]
        # Mul(act_fn(gate), up_proj(x)) -> down_proj: fold 1/s into up_proj's output columns instead
        ups = [producers[i] for i in p.input if i in producers and id(producers[i]) in wm
               and len(consumers.get(i, [])) == 1]
        if vec:
            groups[act] = (("norm", p, *vec[0]), [c for c in users if id(c) in wm])
        elif ups:
            groups[act] = (("matmul", ups[0]), [c for c in users if id(c) in wm])
    if not groups:
        return {}
    if amax is None:
        amax = _graph_amax(gw, list(groups), feeds, workdir)
    scales = {}
    for act, (fold, mms) in groups.items():
        if search is not None:
            s = scales[act] = search.smoothing(act, [gw.array(m.input[1]) for m in mms])
        else:
            wmax = np.max([np.abs(gw.array(m.input[1])).max(axis=1) for m in mms], axis=0)  # one weight at a time
            s = np.power(np.maximum(amax[act], 1e-5), alpha) / np.power(np.maximum(wmax, 1e-5), 1 - alpha)
            s = scales[act] = np.clip(s, 1e-2, 1e2).astype(np.float32)
        if fold[0] == "norm":
            _, mul, slot, vec = fold
            private = (mul.name or act) + ".smoothed_weight"  # never modify a vector another node shares
            gw.set(private, (gw.array(vec) / s).astype(np.float32))
            mul.input[slot] = private
        else:
            gw.transform(fold[1].input[1], lambda u, sc=s: (u / sc[None, :]).astype(np.float32))
        for m in mms:
            gw.transform(m.input[1], lambda w, sc=s: (w * sc[:, None]).astype(np.float32))
    gw.drop_unused()  # the norm weights replaced by their smoothed copies
    return scales


def _graph_amax(gw: GraphWeights, names: list[str], feeds: list[dict], workdir: Path) -> dict[str, np.ndarray]:
    """Max |x| per channel of the activations `names` from a session over the whole graph saved with its weights,
    plus the activations as outputs (a graph-only copy beside it): the fallback of `activation_amax`."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    if gw.edited or gw.path.parent.resolve() != workdir.resolve():  # never write beside another stage's files
        gw.save(workdir / "stats.onnx")
    aug = type(gw.model)()
    aug.CopyFrom(gw.model)
    for act in names:
        aug.graph.output.append(helper.make_tensor_value_info(act, 1, None))
    aug_path = gw.path.with_name("stats-aug.onnx")  # beside the weights it names
    onnx.save_model(aug, str(aug_path))
    del aug
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    amax: dict = {a: None for a in names}
    try:
        sess = ort.InferenceSession(str(aug_path), so, providers=["CPUExecutionProvider"])
        for feed in feeds:
            outs = sess.run(names, feed)
            for a, o in zip(names, outs):
                m = np.abs(o).reshape(-1, o.shape[-1]).max(axis=0)
                amax[a] = m if amax[a] is None else np.maximum(amax[a], m)
            del outs
        del sess
    finally:
        aug_path.unlink()
    return amax


def activation_stats(hf_dir: Path, graph: Path, feeds: list[dict]) -> tuple[dict, dict] | None:
    """(max |x| per channel, sample rows) of every weight MatMul's input (export/int8_search.py
    `ActivationSample`), or None where the model's blocks cannot run alone."""
    from export.int8_search import ActivationSample

    try:
        with ActivationSample(hf_dir, graph, feeds) as stats:
            return stats.all()
    except (ValueError, TypeError, RuntimeError) as e:  # names that do not map, blocks that cannot run alone
        log.warning("int8-qdq activation ranges block by block are not possible here (%s): ONNX Runtime calibrates "
                    "on the whole graph with one SmoothQuant alpha", e)
        return None


def int8_qdq(gw: GraphWeights, dst: Path, hf_dir: Path, opts, feeds: list[dict], skip: set[str], ablation: Path,
             hessian=None, sensitivity_feeds=None) -> dict:
    """The int8-qdq graph of the untied fp32 graph `gw` into `dst` (and the no-SmoothQuant ablation into the
    folder `ablation`), calibrated on `feeds`; the weight MatMuls named in `skip` stay float. `opts`: the
    quantize stage's options (export/quantize.py QuantizeOptions). `hessian` (MatMul name -> the fp32 inputs'
    X^T X, export/gptq_statistics.py): the INT8 weights are GPTQ-rounded on the smoothed inputs' statistics
    instead of ONNX Runtime's round to nearest. `sensitivity_feeds` (a callable: texts no calibration used) with
    `opts.qdq_float_ratio` > 0: the activations whose INT8 form hurts most per byte are left float within that
    budget (export/int8_search.py `float_groups`)."""
    from onnxruntime.quantization import CalibrationDataReader

    from export.int8_search import ALPHAS, Search

    work = dst.parent
    plain = work / "prepared.onnx"
    gw.save(plain)  # untied, unsmoothed: the ablation's source and the statistics' graph
    stats = activation_stats(hf_dir, plain, feeds) if _takes_ranges() else None
    amax = stats[0] if stats else None
    search = None if stats is None else Search(stats[0], stats[1], alpha=opts.smoothquant_alpha, range_method=opts.qdq_range,
                                               alphas=ALPHAS if opts.qdq_alpha_search else ())
    scales = smooth(gw, feeds, opts.smoothquant_alpha, work, amax, search) if opts.smoothquant_alpha > 0 else {}
    pre = work / "smoothed.onnx"
    gw.save(pre)
    nodes = [n.name for n in weight_matmuls(gw.model)
             if not (opts.keep_lm_head_float and n.input[1].endswith(".lm_head_T")) and n.name not in skip]
    readers: dict[str, list[str]] = {}  # quantized input -> the weights of the MatMuls that read it
    for n in weight_matmuls(gw.model):
        if n.name in set(nodes):
            readers.setdefault(n.input[0], []).append(n.input[1])
    inputs = sorted(readers)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    ranges = None if search is None else {x: search.range(x, [gw.array(w) for w in readers[x]], scales.get(x))
                                          for x in inputs}
    _qdq(pre, dst, Reader(), nodes, ranges)
    if hessian is not None:
        gptq_weights(dst, gw, nodes, scales, hessian)
    budget: dict = {}
    if search is not None and sensitivity_feeds is not None and opts.qdq_float_ratio > 0:
        from export.int8_search import budget_record, float_groups

        input_of = {n.name: n.input[0] for n in weight_matmuls(gw.model)}
        groups = {x: [n for n in nodes if input_of[n] == x] for x in inputs}
        chosen, sens = float_groups(pre, work, groups, ranges, dequantized_weights(dst, nodes), sensitivity_feeds(),
                                    opts.qdq_float_ratio, opts.qdq_float_kl)
        kept = [n for x in chosen for n in groups[x]]
        unquantize(dst, gw, kept)
        nodes = [n for n in nodes if n not in set(kept)]
        budget = budget_record(opts.qdq_float_ratio, opts.qdq_float_kl, chosen, sens)
    float_nodes = [n.name for n in weight_matmuls(gw.model) if n.name not in set(nodes)]
    metrics = {"smoothquant_groups": len(scales), "calibration_samples": len(feeds), "quantized_matmuls": len(nodes),
               "lm_head_float": opts.keep_lm_head_float, "float_matmuls": float_nodes,
               "activation_ranges": "by block (torch)" if amax is not None else "whole graph (onnxruntime)",
               "int8_rounding": "gptq" if hessian is not None else "minmax",
               "qdq_range": opts.qdq_range if search is not None else "max"}
    metrics |= budget
    if search is not None:
        chosen = search.chosen
        alphas = [c["alpha"] for c in chosen.values() if "alpha" in c]
        metrics |= {"smoothquant_alphas": {str(a): alphas.count(a) for a in sorted(set(alphas), key=lambda a: -1 if a is None else a)},
                    "activation_clips": {str(c): sum(1 for v in chosen.values() if v.get("clip") == c)
                                         for c in sorted({v["clip"] for v in chosen.values() if "clip" in v})},
                    "activation_choices": chosen}
    if opts.smoothquant_ablation and opts.smoothquant_alpha > 0:
        ablation.mkdir(exist_ok=True)
        _qdq(plain, ablation / "model.onnx", Reader(), nodes,
             None if amax is None else {x: float(np.max(amax[x])) for x in inputs})
    return metrics


def _weight_dq(g: GraphWeights, nodes: list[str]) -> dict[str, object]:
    """MatMul name -> the DequantizeLinear that feeds it its INT8 weight, in ONNX Runtime's Q/DQ graph."""
    producers = {o: n for n in g.model.graph.node for o in n.output}
    out = {}
    for node in g.model.graph.node:
        if node.name in nodes:
            dq = producers.get(node.input[1])
            if dq is None or dq.op_type != "DequantizeLinear":
                raise ValueError(f"int8-qdq: ONNX Runtime wrote no DequantizeLinear weight for {node.name}")
            out[node.name] = dq
    return out


def dequantized_weights(dst: Path, nodes: list[str]) -> dict[str, np.ndarray]:
    """MatMul name -> its INT8 weight as the Q/DQ graph at `dst` computes it (levels x per-channel scales)."""
    g = GraphWeights(dst)
    return {n: (g.array(dq.input[0]).astype(np.float32) * g.array(dq.input[1]).astype(np.float32)[None, :])
            for n, dq in _weight_dq(g, nodes).items()}


def unquantize(dst: Path, smoothed: GraphWeights, names: list[str]) -> None:
    """Leave the MatMuls `names` of the Q/DQ graph at `dst` float: their smoothed fp32 weights back, their input
    read before its Q/DQ, and the Q/DQ nodes nothing reads any more removed."""
    if not names:
        return
    g = GraphWeights(dst)
    producers = {o: n for n in g.model.graph.node for o in n.output}
    weight_of = {n.name: n.input[1] for n in weight_matmuls(smoothed.model)}
    dqs = _weight_dq(g, names)
    for node in g.model.graph.node:
        if node.name not in dqs:
            continue
        g.set(weight_of[node.name], smoothed.array(weight_of[node.name]).astype(np.float32))
        node.input[1] = weight_of[node.name]
        dq = producers.get(node.input[0])
        if dq is not None and dq.op_type == "DequantizeLinear":
            q = producers.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[0] = q.input[0]
    graph = g.model.graph
    while True:  # Q/DQ pairs (and weight DQs) whose outputs nothing reads
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    g.drop_unused()
    g.save(dst)


def gptq_weights(dst: Path, smoothed: GraphWeights, nodes: list[str], scales: dict[str, np.ndarray], hessian) -> None:
    """Replace the INT8 weights ONNX Runtime rounded to nearest in the Q/DQ graph at `dst` by GPTQ's (symmetric,
    per output channel, the same scales' layout), each rounded on its smoothed input's statistics: the fp32
    inputs' X^T X divided by s s^T (the MatMul reads x / s)."""
    from export.trt_formats import int8_channel

    g = GraphWeights(dst)
    producers = {o: n for n in g.model.graph.node for o in n.output}
    weight_of = {n.name: (n.input[0], n.input[1]) for n in weight_matmuls(smoothed.model)}
    for node in g.model.graph.node:
        if node.name not in nodes:
            continue
        dq = producers.get(node.input[1])
        if dq is None or dq.op_type != "DequantizeLinear":
            raise ValueError(f"int8-qdq: ONNX Runtime wrote no DequantizeLinear weight for {node.name}")
        x, w = weight_of[node.name]
        h = hessian(node.name)
        if x in scales:
            s = scales[x].astype(np.float64)
            h = h / np.outer(s, s)
        q, sc = int8_channel(smoothed.array(w).astype(np.float32), h)
        if q.shape != tuple(g.shape(dq.input[0])):
            raise ValueError(f"int8-qdq: GPTQ's levels of {node.name} are {q.shape}, the graph's {g.shape(dq.input[0])}")
        g.set(dq.input[0], q)
        g.set(dq.input[1], sc.astype(g.array(dq.input[1]).dtype))
    g.save(dst)


def _takes_ranges() -> bool:
    """Whether this ONNX Runtime's `quantize_static` reads given ranges (its calibration cache, 1.32+)."""
    from onnxruntime.quantization import quantize_static

    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


def _qdq(pre: Path, dst: Path, reader, nodes: list[str], ranges: dict[str, float] | None = None) -> None:
    """Q/DQ on `nodes`' inputs; `ranges` (input -> max |x|) given: used as they are, the model is never run."""
    import tempfile

    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    with tempfile.TemporaryDirectory(prefix="edgechat-ranges-", dir=dst.parent) as tmp:
        cache = None
        if ranges is not None:
            from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

            cache = Path(tmp) / "ranges.json"
            save_tensors_data(TensorsData(CalibrationMethod.MinMax, {
                x: TensorData(lowest=np.float32(-r), highest=np.float32(r)) for x, r in ranges.items()}), cache)
        quantize_static(
            str(pre), str(dst), None if cache else reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes, per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,  # any size: weights beside the graph
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
                           "OpTypesToExcludeOutputQuantization": ["MatMul"]},  # TensorRT: Q/DQ on MatMul inputs only
            **({"calibration_cache_path": str(cache)} if cache else {}),
        )
