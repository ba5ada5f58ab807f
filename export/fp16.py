"""fp16 stage: the fp32 plain graph -> an fp16 plain graph with fp32 islands.

TensorRT 11 has no precision flags: a network is strongly typed, so an FP16 engine needs a graph whose
tensors are FP16 (NVIDIA's migration guide). TensorRT 10 with the FP16 flag picks kernels freely and pins
nothing to fp32. This graph says it: weights, activations and the KV cache in fp16, and in fp32 what
overflows or loses too much in fp16 (what TensorRT-LLM and TensorRT Edge-LLM keep in fp32):

- every RMSNorm (cast, x**2, ReduceMean, +eps, Sqrt, 1/x, the scale by its weight): x**2 overflows fp16
  once |x| > 256, and the residual stream of real models reaches that;
- Softmax and the score path into it (mask add; the fp32 mask minimum is -inf in fp16) and its NaN guard;
- the rotary embedding's positions, frequencies, sin and cos (position * frequency loses digits in fp16
  past a few thousand tokens);
- the logits output (the LM head MatMul runs in fp16, its output is cast to fp32).

Graph inputs keep their types (ids, mask and positions are integers); the past/present K/V become fp16
(halves the cache; edge/backends/onnxruntime.py binds the dtype the graph declares). Written with `onnx` op by op,
as the quantize stage edits graphs, with deterministic names: a cast from precision a to b of tensor T
is node `<T's producer>/CastToFp16` (or `/CastToFp32`). NVIDIA ModelOpt AutoCast was not used: its
`nvidia-modelopt[onnx]` extra installs onnxruntime-gpu (beside our onnxruntime), cupy-cuda12x and another
onnx (pip's dry run, 2026-12-06).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.errors import EdgeChatError
from edge.precisions import FP16, FP32
from export.onnx_weights import tensor_types

FP16_MAX = float(np.finfo(np.float16).max)  # 65504
# ops that move or select data without computing on it: they keep the precision of their float inputs
PASS_THROUGH = frozenset({"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Slice", "Concat", "Gather", "Expand",
                          "Identity", "Flatten", "Split", "Tile", "IsNaN", "IsInf", "Equal", "Less", "Greater",
                          "LessOrEqual", "GreaterOrEqual", "Where", "Shape", "Size"})
TYPE_BLIND = frozenset({"Shape", "Size"})  # read only the shape of a float input: never cast it
# ops that must compute in fp32: convert() raises if one is left in fp16 (a norm the scopes did not name)
MUST_BE_FP32 = frozenset({"Pow", "ReduceMean", "Sqrt", "Softmax", "Sin", "Cos"})
SCORE_PATH = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Tanh"})  # between the score MatMul and Softmax


class Fp16ConversionError(EdgeChatError):
    """The fp32 graph could not be turned into an fp16 graph with its fp32 islands."""


@dataclass(frozen=True)
class Fp16Options:
    # node-name patterns (regular expressions) of the scopes computed in fp32: optimum names nodes after the
    # HF modules, so every RMSNorm (input_layernorm, post_attention_layernorm, the final norm, Qwen3's q_norm and
    # k_norm; Gemma 3's pre/post feed-forward norms) and the rotary embeddings (positions, frequencies, sin, cos;
    # Gemma 3's sliding-window layers have their own, rotary_emb_local)
    fp32_scopes: tuple[str, ...] = (r"/[A-Za-z0-9_]*norm/", r"/rotary_emb(_local)?/")
    fp32_softmax: bool = True  # Softmax, the mask add before it and the NaN guard after it in fp32
    fp32_outputs: tuple[str, ...] = ("logits",)  # float graph outputs kept fp32 (a cast after the fp16 LM head)
    fp16_kv: bool = True  # past/present K/V in fp16 (False: fp32 inputs, cast at the graph's edge)
    # refuse a graph that would leave a norm, softmax or rotary op in fp16 (False: only to measure what the
    # islands buy, as tests/test_fp16.py does)
    check_islands: bool = True


def run(fp32_dir: Path, dst: Path, opts: Fp16Options = Fp16Options()) -> dict:
    """Write `dst/model.onnx`, the fp16 graph of `fp32_dir/model.onnx`; returns what it converted."""
    from export.onnx_weights import GraphWeights, graph_bytes

    gw = GraphWeights(fp32_dir / "model.onnx")
    metrics = convert(gw, opts)
    gw.save(dst / "model.onnx")
    metrics["size_bytes"] = graph_bytes(dst / "model.onnx")
    metrics["fp32_size_bytes"] = graph_bytes(fp32_dir / "model.onnx")
    metrics["size_ratio"] = metrics["size_bytes"] / metrics["fp32_size_bytes"]
    return metrics


def _fp16(a: np.ndarray) -> np.ndarray:
    """`a` in fp16, values past its range at its largest finite one. Cast, then clip the fp16 copy in place (the
    same values as clipping first): no second fp32 copy of the largest tensor, the LM head, in the streaming build."""
    with np.errstate(over="ignore"):
        out = np.asarray(a).astype(np.float16)
    return np.clip(out, -FP16_MAX, FP16_MAX, out=out)


def fp32_nodes(model, types: dict[str, int], opts: Fp16Options) -> set[str]:
    """Names of the nodes that compute in fp32 (the islands)."""
    from onnx import TensorProto

    g = model.graph
    pats = [re.compile(p) for p in opts.fp32_scopes]
    keep = {n.name for n in g.node if any(p.search(n.name) for p in pats)}
    if not opts.fp32_softmax:
        return keep
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    is_float = lambda t: types.get(t) == TensorProto.FLOAT  # noqa: E731
    for sm in (n for n in g.node if n.op_type == "Softmax"):
        keep.add(sm.name)
        todo = [sm.input[0]]  # back to the score MatMul: the mask add (and a softcap) in fp32 too
        while todo:
            p = producer.get(todo.pop())
            if p is None or p.op_type not in SCORE_PATH or p.name in keep:
                continue
            keep.add(p.name)
            todo += [i for i in p.input if is_float(i)]
        todo = [sm.output[0]]  # forward to the MatMul with V: the NaN guard of fully masked rows
        while todo:
            for c in consumers.get(todo.pop(), []):
                if c.op_type in ("IsNaN", "Where") and c.name not in keep:
                    keep.add(c.name)
                    todo += list(c.output)
    return keep


def convert(gw, opts: Fp16Options = Fp16Options()) -> dict:
    """Rewrite `gw` (an export.onnx_weights.GraphWeights of the fp32 plain graph) in place; see the module
    docstring. Weights are converted at save time, one tensor at a time."""
    from onnx import TensorProto, helper, numpy_helper

    F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
    model = gw.model
    g = model.graph
    types = tensor_types(model)
    island = fp32_nodes(model, types, opts)
    inits = gw.names()
    producer = {o: n for n in g.node for o in n.output}
    is_float = lambda t: types.get(t) == F32  # noqa: E731

    prec: dict[str, int] = {}  # float tensor -> its type in the new graph
    for i in g.input:
        if is_float(i.name):
            prec[i.name] = F16 if opts.fp16_kv else F32  # the plain graph's only float inputs: the past K/V
    constants = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
    flexible = inits | set(constants)  # typed by their consumers, below
    readers: dict[str, list[tuple]] = {}  # flexible tensor -> (node, input index, type it needs)
    nodes: list = []
    casts: dict[tuple[str, int], str] = {}  # (tensor, type) -> the cast's output

    def cast_before(consumer, t: str, to: int) -> str:
        if (t, to) not in casts:
            src = producer[t].name or t if t in producer else t
            node = helper.make_node("Cast", [t], [f"{t}/{_short(to)}"], to=to, name=f"{src}/CastTo{_short(to).title()}")
            nodes.insert(nodes.index(consumer) if consumer in nodes else len(nodes), node)
            casts[t, to] = node.output[0]
        return casts[t, to]

    for n in g.node:
        if n.op_type == "Constant":
            nodes.append(n)  # typed below, once every consumer has said what it needs
            continue
        if n.name in island:
            want = F32
        elif n.op_type in PASS_THROUGH:  # the type its data arrives in (fp16 when only constants feed it)
            seen = {prec[i] for i in n.input if i in prec and i not in flexible}
            want = seen.pop() if len(seen) == 1 else F16
        else:
            want = F16
        if n.op_type == "Cast":
            to = next(a for a in n.attribute if a.name == "to")
            if to.i == F32:
                to.i = want
        elif n.op_type == "ConstantOfShape" and want == F16:
            for a in n.attribute:
                if a.name == "value" and a.t.data_type == F32:
                    a.t.CopyFrom(numpy_helper.from_array(_fp16(numpy_helper.to_array(a.t))))
        elif n.op_type not in TYPE_BLIND:
            for k, i in enumerate(n.input):
                if not i or not is_float(i):
                    continue
                if i in flexible:
                    readers.setdefault(i, []).append((n, k, want))
                elif prec[i] != want:
                    n.input[k] = cast_before(None, i, want)
        nodes.append(n)
        for o in n.output:
            if is_float(o):
                prec[o] = want

    # initializers and constants: fp16 when some consumer computes in fp16 (a fp32 consumer of the same
    # initializer then reads a cast of it, of a constant a fp32 copy); fp32 when only islands read them
    fp16_inits = clipped = 0
    for t, uses in sorted(readers.items()):
        wants = {w for _, _, w in uses}
        if F16 not in wants:
            continue
        if t in inits:
            gw.set(t, lambda t=t: _fp16(gw.stored(t)), dims=gw.shape(t), dtype=np.float16)
            fp16_inits += 1
            for n, k, w in uses:
                if w == F32:
                    n.input[k] = cast_before(n, t, F32)
        else:
            node = constants[t]
            value = numpy_helper.to_array(node.attribute[0].t)
            clipped += int(np.sum(np.abs(value) > FP16_MAX))
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(_fp16(value)))
            if F32 in wants:
                copy = helper.make_node("Constant", [], [f"{t}/fp32"], value=numpy_helper.from_array(value),
                                        name=f"{node.name}/Fp32")
                nodes.insert(nodes.index(node) + 1, copy)
                for n, k, w in uses:
                    if w == F32:
                        n.input[k] = copy.output[0]
        prec[t] = F16
    del g.node[:]
    g.node.extend(nodes)  # copies: look the producers up again
    producer = {o: n for n in g.node for o in n.output}

    # the graph's edge: K/V inputs and outputs in the cache's type, kept-fp32 outputs cast back
    for i in g.input:
        if i.name in prec:
            i.type.tensor_type.elem_type = prec[i.name]
    keep32 = set(opts.fp32_outputs) | ({o.name for o in g.output} if not opts.fp16_kv else set())
    for o in g.output:
        if not is_float(o.name):
            continue
        if o.name in keep32 and prec[o.name] == F16:
            p = producer[o.name]
            inner = f"{o.name}/fp16"
            p.output[list(p.output).index(o.name)] = inner
            for c in g.node:  # the graph's own readers keep the fp16 tensor
                for k, i in enumerate(c.input):
                    if i == o.name:
                        c.input[k] = inner
            g.node.append(helper.make_node("Cast", [inner], [o.name], to=F32, name=f"{p.name}/CastToFp32"))
            prec[o.name] = F32
        o.type.tensor_type.elem_type = prec[o.name]
    del g.value_info[:]
    left = [n for n in g.node if n.op_type in MUST_BE_FP32 and prec.get(n.output[0]) != F32]
    if left and opts.check_islands:
        raise Fp16ConversionError(
            f"{len(left)} {', '.join(sorted({n.op_type for n in left}))} node(s) would compute in fp16, e.g. "
            f"'{left[0].name}': add its scope to Fp16Options.fp32_scopes (export/fp16.py) so it stays in fp32")
    _check_types(model)
    return {"fp32_nodes": sum(1 for n in g.node if n.name in island), "fp16_initializers": fp16_inits,
            "casts": sum(1 for n in g.node if n.name.endswith(("/CastToFp16", "/CastToFp32"))),
            "constants_clipped_to_fp16_range": clipped, "kv_dtype": "float16" if opts.fp16_kv else "float32"}


def _short(t: int) -> str:
    """The type's short name in node and tensor names ("fp16", "fp32")."""
    from onnx import TensorProto

    return FP16 if t == TensorProto.FLOAT16 else FP32


def _check_types(model) -> None:
    """Every node's inputs agree on their types, or say which do not."""
    from export.onnx_weights import type_mismatches

    bad = type_mismatches(model)
    if bad:
        raise Fp16ConversionError(f"the fp16 graph does not type-check ({len(bad)} nodes), e.g. {bad[0]}: a bug in "
                                  "export/fp16.py's casts, please report it with the model")
