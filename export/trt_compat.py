"""Will TensorRT's ONNX parser take this graph? A static check with `onnx`, run at export time.

An engine build happens later, often on the device (Orin builds on the Orin), so a graph TensorRT
rejects must be caught here, on the workstation, where it can still be fixed. What is checked:

- opset of the default domain within what TensorRT 10's parser reads (9-20, onnx-tensorrt
  docs/operators.md for TensorRT 10.0; later 10.x and 11 read at least that range);
- no ONNX Runtime contrib ops (com.microsoft: MatMulNBits, GroupQueryAttention, ...) and none of
  the standard ops onnx-tensorrt lists as unsupported (MatMulInteger, DynamicQuantizeLinear, ...);
- explicit quantization the way TensorRT wants it: INT8 Q/DQ only (no UINT8), zero points all 0,
  scales finite and positive, activations quantized per tensor, weights per channel only along the
  output axis of the MatMul/Gemm they feed.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from edge.errors import EdgeChatError

MIN_OPSET, MAX_OPSET = 9, 20  # onnx-tensorrt docs/operators.md: "TensorRT 10.0 supports opset 9 to opset 20"
# Standard ops onnx-tensorrt marks "N" (not supported) that an exporter or quantizer can emit.
UNSUPPORTED_OPS = frozenset({
    "BitShift", "ConcatFromSequence", "ConvInteger", "Det", "DynamicQuantizeLinear", "MatMulInteger",
    "MaxRoiPool", "Multinomial", "NegativeLogLikelihoodLoss", "QLinearConv", "QLinearMatMul",
    "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength",
    "SoftmaxCrossEntropyLoss", "SplitToSequence", "StringNormalizer", "TfIdfVectorizer", "Unique",
})
STANDARD_DOMAINS = ("", "ai.onnx")


class TensorRTCompatibilityError(EdgeChatError):
    """The ONNX graph uses something TensorRT's parser rejects."""


@dataclass
class CompatReport:
    opset: int
    ops: dict[str, int]
    quantize_nodes: int = 0
    dequantize_nodes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return asdict(self) | {"compatible": self.compatible}


def check(model_or_path) -> CompatReport:
    """Inspect a graph (onnx.ModelProto or path; external weights are not loaded unless needed)."""
    from onnx import numpy_helper

    model = model_or_path
    read: Callable[[Any], np.ndarray] = numpy_helper.to_array
    if isinstance(model_or_path, (str, os.PathLike)):  # the graph alone; only the Q/DQ scales are read
        from pathlib import Path

        from export.onnx_weights import GraphWeights

        gw = GraphWeights(Path(model_or_path))
        model, read = gw.model, lambda init: gw.array(init.name)
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in STANDARD_DOMAINS), 0)
    ops = Counter(n.op_type if n.domain in STANDARD_DOMAINS else f"{n.domain}.{n.op_type}" for n in g.node)
    rep = CompatReport(opset=opset, ops=dict(sorted(ops.items())))
    if not MIN_OPSET <= opset <= MAX_OPSET:
        rep.problems.append(f"opset {opset} is outside the {MIN_OPSET}-{MAX_OPSET} that TensorRT 10's ONNX parser "
                            f"reads: re-export with opset {min(max(opset, MIN_OPSET), MAX_OPSET)}")
    contrib = sorted(o for o in ops if "." in o)
    if contrib:
        rep.problems.append(f"ONNX Runtime contrib ops TensorRT cannot parse: {', '.join(contrib)} "
                            "(build engines from the plain fp32 or int8-qdq graph, not the ORT-optimized one)")
    bad = sorted(o for o in ops if o in UNSUPPORTED_OPS)
    if bad:
        rep.problems.append(f"ops TensorRT does not support: {', '.join(bad)} (int8-dynamic graphs are for ONNX "
                            "Runtime; TensorRT takes INT8 as QuantizeLinear/DequantizeLinear pairs)")

    inits = {i.name: i for i in g.initializer}
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def const(name: str):
        if name in inits:
            return read(inits[name])
        if name in consts:
            return numpy_helper.to_array(consts[name].attribute[0].t)
        return None

    for n in g.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or n.domain not in STANDARD_DOMAINS:
            continue
        if n.op_type == "QuantizeLinear":
            rep.quantize_nodes += 1
        else:
            rep.dequantize_nodes += 1
        where = f"{n.op_type} '{n.name or n.output[0]}'"
        scale = const(n.input[1])
        if scale is None:
            rep.problems.append(f"{where}: scale is computed at run time; TensorRT needs constant Q/DQ scales")
            continue
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            rep.problems.append(f"{where}: scales must be finite and > 0 (min {np.min(scale)!r}, max {np.max(scale)!r}) "
                                "- calibrate on data that reaches this node, or leave it unquantized")
        zp = const(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        if zp is not None:
            if zp.dtype != np.int8:
                rep.problems.append(f"{where}: {zp.dtype} zero point; TensorRT takes INT8 Q/DQ only (quantize "
                                    "with QuantType.QInt8 for weights and activations)")
            elif np.any(zp != 0):
                rep.problems.append(f"{where}: zero point is not 0 (TensorRT's INT8 is symmetric): quantize with "
                                    "ActivationSymmetric and WeightSymmetric")
        per_channel = scale.ndim > 0 and scale.size > 1
        is_weight = n.op_type == "DequantizeLinear" and n.input[0] in inits
        if per_channel and not is_weight:
            rep.problems.append(f"{where}: per-channel activation quantization; TensorRT wants activations per tensor")
        if per_channel and is_weight:
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
            wdims = list(inits[n.input[0]].dims)
            axis = axis % len(wdims)
            for user in consumers.get(n.output[0], []):
                out_axis = _output_axis(user, n.output[0], len(wdims))
                if out_axis is not None and axis != out_axis:
                    rep.problems.append(f"{where}: weight scales along axis {axis}, but {user.op_type} "
                                        f"'{user.name}' has its output channels on axis {out_axis}")
    return rep


def _output_axis(node, weight: str, rank: int) -> int | None:
    """The axis of a weight that indexes output channels for the op that consumes it."""
    if rank != 2:
        return None
    if node.op_type == "MatMul" and node.input[1] == weight:
        return 1  # [K, N]
    if node.op_type == "Gemm" and node.input[1] == weight:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return None


def require_compatible(model_or_path, what: str) -> CompatReport:
    rep = check(model_or_path)
    if not rep.compatible:
        raise TensorRTCompatibilityError(f"{what} would not build with TensorRT: " + "; ".join(rep.problems))
    return rep
