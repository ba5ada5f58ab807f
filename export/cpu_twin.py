"""int4-qdq's CPU twin: the graph ONNX Runtime's CPU provider scores for TensorRT's W4A16 engine.

ONNX Runtime folding each INT4 DequantizeLinear at load holds the weights in fp32 (the 1.5B Qwen: 7.4 GB after load,
11.6 GB for the evaluate stage); its own QDQ fusion keeps the head's INT8 DequantizeLinear unfolded, dequantized at
every call (~100 s a golden answer on the 1.5B). The twin is the same arithmetic in 4-bit memory; the evaluate stage,
`edge-export eval` and the streaming build's reference check score it, the bundle ships the graph TensorRT reads.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge.precisions import INT4_QDQ
from export.onnx_weights import GraphWeights

log = logging.getLogger("edgechat")


def cpu_twin(graph: Path, dst: Path) -> Path:
    """int4-qdq's graph for ONNX Runtime's CPU provider, written to dst/model.onnx: each DequantizeLinear(INT4
    blocks) -> MatMul replaced by MatMulNBits reading the same levels and scales with fp32 compute (accuracy level
    1: the dequantized weights times the float activations, W4A16's arithmetic), the INT8 DequantizeLinear (head,
    embedding) left to fold once at load (edge.precisions' cpu_session_config). Each weight is repacked as it is
    saved."""
    from onnx import helper

    gw = GraphWeights(graph)
    g = gw.model.graph
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    done = 0
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear"]:
        block = next((a.i for a in dq.attribute if a.name == "block_size"), 0)
        users = readers.get(dq.output[0], [])
        if not block or len(users) != 1 or users[0].op_type != "MatMul" or users[0].input[1] != dq.output[0]:
            continue
        mm = users[0]
        k, n = gw.shape(dq.input[0])
        kb = k // block

        def levels(q=dq.input[0], n=n, kb=kb, block=block) -> np.ndarray:
            from export.int4 import pack

            u = (gw.array(q).astype(np.int16) + 8).astype(np.uint8).T.reshape(n, kb, block)  # uint4, zero point 8
            return pack(u, np.full((n, kb), 8, np.uint8), 4)[0]

        def scales(s=dq.input[1]) -> np.ndarray:
            return np.ascontiguousarray(gw.array(s).T).reshape(-1)

        b, sc = mm.name + "/nbits_B", mm.name + "/nbits_scales"
        gw.set(b, levels, dims=(n, kb, block // 2), dtype=np.uint8)
        gw.set(sc, scales, dims=(n * kb,), dtype=np.dtype(helper.tensor_dtype_to_np_dtype(gw.initializer(dq.input[1]).data_type)))
        fused = helper.make_node("MatMulNBits", [mm.input[0], b, sc], list(mm.output), name=mm.name + "/MatMulNBits",
                                 domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=1)
        at = list(g.node).index(mm)
        g.node.remove(mm)
        g.node.insert(at, fused)
        g.node.remove(dq)
        done += 1
    if not any(o.domain == "com.microsoft" for o in gw.model.opset_import):
        gw.model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    gw.drop_unused()
    dst.mkdir(parents=True, exist_ok=True)
    gw.save(dst / "model.onnx")
    log.debug("cpu twin of %s: %d INT4 MatMuls as MatMulNBits", graph, done)
    return dst / "model.onnx"


def scored_graph(graph: Path, precision: str | None, scratch: Path) -> Path:
    """The graph ONNX Runtime's CPU provider scores for an engine of `precision`: int4-qdq's twin, written under
    `scratch` (the caller removes it), else the graph itself."""
    return cpu_twin(Path(graph), Path(scratch)) if precision == INT4_QDQ else Path(graph)
