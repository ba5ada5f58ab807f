"""Will TensorRT's ONNX parser take this graph? A static check with `onnx`, run at export time.

An engine build happens later, often on the device (Orin builds on the Orin), so a graph TensorRT
rejects must be caught here, on the workstation, where it can still be fixed. What is checked:

- opset of the default domain within what TensorRT 10's parser reads (9-20, onnx-tensorrt
  docs/operators.md for TensorRT 10.0; later 10.x and 11 read at least that range);
- no ONNX Runtime contrib ops (com.microsoft: MatMulNBits, GroupQueryAttention, ...) and none of
  the standard ops onnx-tensorrt lists as unsupported (MatMulInteger, DynamicQuantizeLinear, ...);
- explicit quantization the way TensorRT wants it (`qdq_problems`): INT8, INT4 or FP8 Q/DQ only (no UINT8),
  zero points all 0, scales finite and positive, activations quantized per tensor, weights per channel only
  along the output axis of the MatMul/Gemm they feed, or in blocks along one axis (INT4 weight-only, even last
  dimension);
- every node's op and input types against export/tensorrt_ops.toml, the per-op type table of
  onnx-tensorrt's docs/operators.md for a TensorRT version (`node_problems`): a Gather or Cast of an
  INT8 tensor, an fp16 op TensorRT has no fp16 kernel for, an op the table does not have.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edge.errors import EdgeChatError

# onnx-tensorrt docs/operators.md: "TensorRT 10.0 supports opset 9 to opset 20"; 21 too, which INT4 weights need
# (INT4 in DequantizeLinear and its block_size are opset 21's): the parser itself bounds no opset (ModelImporter.cpp
# at 10.1-GA only warns below 7), its INT4 Q/DQ import dates from 10.0 EA (docs/Changelog.md), and opset 21 changes
# no op EdgeChat's graphs use beyond adding the 4-bit types (export/trt_formats.py); NVIDIA Model Optimizer writes
# its INT4 ONNX for TensorRT 10 at opset 21. Newer operators.md say 9-22.
MIN_OPSET, MAX_OPSET = 9, 21
# Standard ops onnx-tensorrt marks "N" (not supported) that an exporter or quantizer can emit.
UNSUPPORTED_OPS = frozenset({
    "BitShift", "ConcatFromSequence", "ConvInteger", "Det", "DynamicQuantizeLinear", "MatMulInteger",
    "MaxRoiPool", "Multinomial", "NegativeLogLikelihoodLoss", "QLinearConv", "QLinearMatMul",
    "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength",
    "SoftmaxCrossEntropyLoss", "SplitToSequence", "StringNormalizer", "TfIdfVectorizer", "Unique",
})
STANDARD_DOMAINS = ("", "ai.onnx")
OPS_TABLE = Path(__file__).with_name("tensorrt_ops.toml")
DEFAULT_TENSORRT = "10.3"  # the lowest TensorRT the device profiles name (JetPack 6.2 on every Orin)
# onnx.TensorProto element types by the names operators.md uses
TYPE_NAMES = {1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64", 8: "STRING", 9: "BOOL",
              10: "FP16", 11: "DOUBLE", 12: "UINT32", 13: "UINT64", 16: "BF16", 17: "FP8", 22: "INT4", 21: "UINT4"}
QUANTIZED_TYPES = ("INT8", "INT4", "FP8")


class TensorRTCompatibilityError(EdgeChatError):
    """The ONNX graph uses something TensorRT's parser rejects."""


@dataclass(frozen=True)
class OpTypes:
    """One op's row of export/tensorrt_ops.toml: the input types TensorRT takes, per version."""
    op: str
    types: dict[str, frozenset[str]]  # table version ("10.0") -> the types of `inputs`
    inputs: tuple[int, ...] | None = None  # positions the types are about (None: every input)
    output: bool = False  # the output's type is checked too (Cast's `to`, a Constant's value)

    def allowed(self, version: tuple[int, ...]) -> frozenset[str] | None:
        """The types at the newest table version <= `version` (None: the op is newer than that TensorRT)."""
        known = [v for v in self.types if _version(v) <= version]
        return self.types[max(known, key=_version)] if known else None


@dataclass(frozen=True)
class OpTable:
    source: str
    versions: dict[str, str]  # table version -> where its rows come from
    ops: dict[str, OpTypes]


def _version(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.split(".")[:2])
    except ValueError:
        raise ValueError(f"TensorRT version {v!r} is not like 10.3 or 11") from None


@lru_cache(maxsize=4)
def load_op_table(path: Path = OPS_TABLE) -> OpTable:
    """The op x input-type table (export/tensorrt_ops.toml), checked as it is read."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    ops = {}
    for op, row in raw["ops"].items():
        unknown = set(row) - {"types", "inputs", "output"}
        bad = {t for types in row["types"].values() for t in types} - set(TYPE_NAMES.values())
        if unknown or bad or not set(row["types"]) <= set(raw["versions"]):
            raise ValueError(f"{path} [ops.{op}]: unknown keys {sorted(unknown)}, types {sorted(bad)} or versions "
                             f"{sorted(set(row['types']) - set(raw['versions']))}")
        ops[op] = OpTypes(op, {v: frozenset(t) for v, t in row["types"].items()},
                          tuple(row["inputs"]) if "inputs" in row else None, bool(row.get("output", False)))
    return OpTable(raw["source"], dict(raw["versions"]), ops)


def node_problems(model, tensorrt_version: str = DEFAULT_TENSORRT) -> list[str]:
    """One line per node TensorRT `tensorrt_version`'s ONNX parser would refuse by its op or its input types
    (export/tensorrt_ops.toml): the op, the node, the type, what the table allows and the fix. Types come from
    onnx's shape inference on the graph alone (no weight is read). Contrib-domain ops are check()'s to report."""
    from export.onnx_weights import tensor_types

    table = load_op_table()
    version = _version(tensorrt_version)
    types = tensor_types(model)
    problems = []
    for n in model.graph.node:
        if n.domain not in STANDARD_DOMAINS:
            continue
        where = f"{n.op_type} '{n.name or n.output[0]}'"
        row = table.ops.get(n.op_type)
        allowed = row.allowed(version) if row else None
        if row is None or allowed is None:
            problems.append(f"{where}: {n.op_type} is not in export/tensorrt_ops.toml for TensorRT {tensorrt_version}: "
                            "add its row from onnx-tensorrt's docs/operators.md if TensorRT supports it, or export the "
                            "graph without it")
            continue
        positions = range(len(n.input)) if row.inputs is None else row.inputs
        seen = [(f"input {k} '{n.input[k]}'", types.get(n.input[k])) for k in positions if k < len(n.input) and n.input[k]]
        if row.output:
            seen += [(f"output '{n.output[0]}'", types.get(n.output[0]))]
        bad = [(what, TYPE_NAMES.get(t, str(t))) for what, t in seen if t is not None and TYPE_NAMES.get(t) not in allowed]
        if not bad:
            continue  # (a type shape inference could not tell is left to the parser)
        quantized = next((name for _, name in bad if name in QUANTIZED_TYPES), None)
        fix = (f"{quantized} reaches TensorRT only through Q/DQ: dequantize first (DequantizeLinear -> {n.op_type})"
               if quantized else "cast it to one of those at export, or keep this op in a type it takes")
        problems.append(f"{where}: {', '.join(f'{what} is {name}' for what, name in bad)}; TensorRT {tensorrt_version} "
                        f"takes {n.op_type} on {', '.join(sorted(allowed))} only ({fix})")
    return problems


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


def check(model_or_path, tensorrt_version: str = DEFAULT_TENSORRT) -> CompatReport:
    """Inspect a graph (onnx.ModelProto or path; external weights are not loaded unless needed) for TensorRT
    `tensorrt_version`."""
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
                            "(build engines from the plain fp32, fp16 or a Q/DQ graph, not the ORT-optimized one)")
    bad = sorted(o for o in ops if o in UNSUPPORTED_OPS)
    if bad:
        rep.problems.append(f"ops TensorRT does not support: {', '.join(bad)} (int8-dynamic graphs are for ONNX "
                            "Runtime; TensorRT takes INT8 as QuantizeLinear/DequantizeLinear pairs)")

    rep.problems += node_problems(model, tensorrt_version)
    rep.quantize_nodes, rep.dequantize_nodes, problems = qdq_problems(model, read)
    rep.problems += problems
    return rep


def qdq_problems(model, read: Callable[[Any], np.ndarray] | None = None) -> tuple[int, int, list[str]]:
    """(QuantizeLinear count, DequantizeLinear count, one line per node TensorRT's importer refuses), the rules of
    onnx-tensorrt's QuantDequantLinearHelper (onnxOpImporters.cpp, 10.1-GA) and TensorRT's quantized types:
    constant scales, finite and > 0, in FP32/FP16/BF16; zero points INT8, INT4 or FP8 and all zero (TensorRT is
    symmetric; UINT8 refused); a 1-D scale is per channel (weights only, along the output axis of their MatMul);
    a scale of the input's rank is a block scale: one blocked axis, the last or second to last, tiling it exactly,
    and only for INT4 / FP8 weights; INT4 is weight-only (a DequantizeLinear of a constant, never a
    QuantizeLinear) and needs an even last dimension. `read`: initializer -> array (default numpy_helper)."""
    from onnx import numpy_helper

    read = read or numpy_helper.to_array
    g = model.graph
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

    counts = {"QuantizeLinear": 0, "DequantizeLinear": 0}
    problems: list[str] = []
    for n in g.node:
        if n.op_type not in counts or n.domain not in STANDARD_DOMAINS:
            continue
        counts[n.op_type] += 1
        where = f"{n.op_type} '{n.name or n.output[0]}'"
        scale = const(n.input[1])
        if scale is None:
            problems.append(f"{where}: scale is computed at run time; TensorRT needs constant Q/DQ scales")
            continue
        if scale.dtype not in (np.float32, np.float16) and scale.dtype.name != "bfloat16":
            problems.append(f"{where}: {scale.dtype} scale; TensorRT reads FP32, FP16 or BF16 scales")
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            problems.append(f"{where}: scales must be finite and > 0 (min {np.min(scale)!r}, max {np.max(scale)!r}) "
                            "- calibrate on data that reaches this node, or leave it unquantized")
        zp = const(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        qtype = None  # the quantized type: the zero point's, else the DequantizeLinear input's
        if zp is not None:
            qtype = zp.dtype.name
            if qtype not in ("int8", "int4", "float8_e4m3fn"):
                problems.append(f"{where}: {zp.dtype} zero point; TensorRT takes INT8, INT4 and FP8 E4M3 Q/DQ only "
                                "(quantize with QuantType.QInt8 for weights and activations)")
            elif np.any(zp.astype(np.float32) != 0):
                problems.append(f"{where}: zero point is not 0 (TensorRT's quantization is symmetric): quantize with "
                                "ActivationSymmetric and WeightSymmetric")
        is_weight = n.op_type == "DequantizeLinear" and n.input[0] in inits
        if is_weight and qtype is None:
            qtype = TYPE_NAMES.get(inits[n.input[0]].data_type, "").lower().replace("fp8", "float8_e4m3fn")
        if qtype == "int4" and not is_weight:
            problems.append(f"{where}: INT4 on an activation; TensorRT's INT4 is weight-only (a DequantizeLinear of "
                            "a constant weight)")
        wdims = list(inits[n.input[0]].dims) if is_weight else []
        if qtype == "int4" and is_weight and (not wdims or wdims[-1] % 2):
            problems.append(f"{where}: INT4 weight of shape {wdims}: TensorRT packs INT4 in pairs and refuses an odd "
                            "last dimension")
        if scale.ndim == 0 or scale.size == 1:
            continue
        if not is_weight:
            problems.append(f"{where}: per-channel activation quantization; TensorRT wants activations per tensor")
            continue
        if scale.ndim == len(wdims) and scale.ndim > 1:  # a block scale
            blocked = [a for a, (d, s) in enumerate(zip(wdims, scale.shape)) if d != s]
            if (len(blocked) != 1 or blocked[0] < len(wdims) - 2 or wdims[blocked[0]] % scale.shape[blocked[0]]
                    or any(d != s for a, (d, s) in enumerate(zip(wdims, scale.shape)) if a not in blocked)):
                problems.append(f"{where}: block scale {list(scale.shape)} for a weight {wdims}: TensorRT takes one "
                                "blocked axis (the last or second to last) that the blocks tile exactly")
            elif qtype not in ("int4", "float8_e4m3fn"):
                problems.append(f"{where}: {qtype} block quantization; TensorRT 10 blocks INT4 and FP8 weights only "
                                "(INT8 weights go per channel)")
            continue
        if scale.ndim != 1:
            problems.append(f"{where}: scale of rank {scale.ndim} for an input of rank {len(wdims)}: TensorRT takes a "
                            "scalar, a 1-D per-channel scale or a block scale of the input's rank")
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1) % len(wdims)
        for user in consumers.get(n.output[0], []):
            out_axis = _output_axis(user, n.output[0], len(wdims))
            if out_axis is not None and axis != out_axis:
                problems.append(f"{where}: weight scales along axis {axis}, but {user.op_type} "
                                f"'{user.name}' has its output channels on axis {out_axis}")
    return counts["QuantizeLinear"], counts["DequantizeLinear"], problems


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
