"""The embedding table stored as INT8 rows with a scale each (every quantized engine), in the form its
runtime reads: a Gather of INT8 rows then a scale (ONNX Runtime), or DequantizeLinear then Gather (TensorRT,
which takes INT8 only through Q/DQ). When the LM head shares the table, the embedding reads the head's INT8
weight instead of keeping a second copy.

Every edit goes through export.onnx_weights.GraphWeights: the graph in memory, the weights read one tensor at a
time from disk and streamed into one external data file on save, so a model of any size (past protobuf's 2 GB)
quantizes in memory bounded by its largest tensor plus the quantized output.
"""

from __future__ import annotations

import numpy as np

from export.onnx_weights import GraphWeights


def quantize_embedding(gw: GraphWeights, dequantize_first: bool = False) -> int:
    """Replace Gather(fp32 table, ids) by a per-row symmetric INT8 table + scales. Returns bytes saved.

    `dequantize_first` (the int8-qdq graph, for TensorRT): DequantizeLinear(table, per-row scales) -> Gather,
    the Q/DQ form TensorRT's parser takes (it reads INT8 only through Q/DQ: a Gather or Cast of an INT8 tensor
    is refused, onnx-tensorrt docs/operators.md). Otherwise Gather on the INT8 table, then Cast and scale: the
    rows a step needs are dequantized, not the table (ONNX Runtime's CPU engines)."""
    from onnx import TensorProto, helper

    model = gw.model
    inits = gw.names()
    ids = {i.name for i in model.graph.input}
    saved = 0
    for node in list(model.graph.node):
        if node.op_type != "Gather" or node.input[0] not in inits or len(gw.shape(node.input[0])) != 2:
            continue
        if node.input[1] not in ids:  # the token ids' table only, not a lookup such as the rotary cos/sin at positions
            continue
        if any(node.input[0] in n.input for n in model.graph.node if n is not node):
            continue  # still shared with another consumer
        base = node.input[0]
        rows, cols = gw.shape(base)
        table_bytes = rows * cols * 4
        out = node.output[0]
        pre = node.name or "/embed"
        idx = list(model.graph.node).index(node)
        shared_q, shared_s, shared_zp = base + ".lm_head_T_quantized", base + ".lm_head_T_scale", base + ".lm_head_T_zero_point"
        nbits_q, nbits_s = base + ".lm_head_T_Q8", base + ".lm_head_T_scales"
        nbits_users = [n for n in model.graph.node if n.op_type == "MatMulNBits" and len(n.input) > 1 and n.input[1] == nbits_q]
        if nbits_q in inits and nbits_users and len(nbits_users[0].input) == 3:
            # Tied weights, MatMulNBits 8-bit LM head: B is [vocab, blocks, 32] uint8 with an implicit
            # zero point of 128 and per-block scales [vocab, blocks]; gather embedding rows from it.
            gw.set(base + ".nbits_zp", np.array(128.0, np.float32))
            gw.set(base + ".unsq_axes", np.array([-1], np.int64))
            gw.set(base + ".row_shape", np.array([0, 0, -1], np.int64))
            new = [
                helper.make_node("Gather", [nbits_q, node.input[1]], [out + ".q"], name=pre + "/GatherQ8"),
                helper.make_node("Cast", [out + ".q"], [out + ".f"], to=TensorProto.FLOAT, name=pre + "/Cast"),
                helper.make_node("Sub", [out + ".f", base + ".nbits_zp"], [out + ".c"], name=pre + "/ZeroPoint"),
                helper.make_node("Gather", [nbits_s, node.input[1]], [out + ".s1"], name=pre + "/GatherScale"),
                helper.make_node("Unsqueeze", [out + ".s1", base + ".unsq_axes"], [out + ".s"], name=pre + "/UnsqueezeScale"),
                helper.make_node("Mul", [out + ".c", out + ".s"], [out + ".b"], name=pre + "/Dequant"),
                helper.make_node("Reshape", [out + ".b", base + ".row_shape"], [out], name=pre + "/Reshape"),
            ]
            saved += table_bytes
        elif shared_q in inits and shared_s in inits and not gw.array(shared_zp).any() and dequantize_first:
            # Tied weights, TensorRT: gather rows from the LM head's dequantized [hidden, vocab] table (its own
            # DequantizeLinear, per vocabulary column), so the INT8 table is stored once and read through Q/DQ.
            dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == shared_q)
            first = type(dq)()
            first.CopyFrom(dq)
            model.graph.node.remove(dq)  # the head's DequantizeLinear comes later: move it before its new reader
            new = [
                first,
                helper.make_node("Gather", [first.output[0], node.input[1]], [out + ".t"], axis=1, name=pre + "/Gather"),
                helper.make_node("Transpose", [out + ".t"], [out], perm=[1, 2, 0], name=pre + "/Transpose"),
            ]
            saved += table_bytes
        elif shared_q in inits and shared_s in inits and not gw.array(shared_zp).any():
            # Tied weights: gather rows straight from the LM head's symmetric INT8 [hidden, vocab]
            # table (per-vocab scales = per-row embedding scales), so the table is stored once.
            gw.set(base + ".unsq_axes", np.array([-1], np.int64))
            new = [
                helper.make_node("Gather", [shared_q, node.input[1]], [out + ".q"], axis=1, name=pre + "/GatherInt8"),
                helper.make_node("Transpose", [out + ".q"], [out + ".qt"], perm=[1, 2, 0], name=pre + "/Transpose"),
                helper.make_node("Gather", [shared_s, node.input[1]], [out + ".s1"], name=pre + "/GatherScale"),
                helper.make_node("Unsqueeze", [out + ".s1", base + ".unsq_axes"], [out + ".s"], name=pre + "/UnsqueezeScale"),
                helper.make_node("Cast", [out + ".qt"], [out + ".f"], to=TensorProto.FLOAT, name=pre + "/Cast"),
                helper.make_node("Mul", [out + ".f", out + ".s"], [out], name=pre + "/Dequant"),
            ]
            saved += table_bytes
        else:
            w = gw.array(base)
            q, scale = np.empty(w.shape, np.int8), np.empty((w.shape[0], 1), np.float32)
            for i in range(0, w.shape[0], 4096):  # a block of rows at a time: no table-sized temporaries
                blk = w[i:i + 4096].astype(np.float32, copy=False)
                scale[i:i + 4096] = np.maximum(np.abs(blk).max(axis=1, keepdims=True), 1e-8) / 127.0
                q[i:i + 4096] = np.clip(np.round(blk / scale[i:i + 4096]), -127, 127)
            del w
            gw.set(base + ".int8", q)
            if dequantize_first:  # one scale per row, in the table's float type (DequantizeLinear's output type:
                # an fp16 graph's Gather must stay fp16), no smaller than its smallest normal value
                ftype = np.dtype(helper.tensor_dtype_to_np_dtype(gw.initializer(base).data_type))
                gw.set(base + ".scale", np.maximum(scale.reshape(-1), np.finfo(ftype).tiny).astype(ftype))
                new = [
                    helper.make_node("DequantizeLinear", [base + ".int8", base + ".scale"], [out + ".table"], axis=0,
                                     name=pre + "/DequantizeLinear"),
                    helper.make_node("Gather", [out + ".table", node.input[1]], [out], name=pre + "/Gather"),
                ]
            else:
                gw.set(base + ".scale", scale.astype(np.float32))
                new = [
                    helper.make_node("Gather", [base + ".int8", node.input[1]], [out + ".q"], name=pre + "/GatherInt8"),
                    helper.make_node("Gather", [base + ".scale", node.input[1]], [out + ".s"], name=pre + "/GatherScale"),
                    helper.make_node("Cast", [out + ".q"], [out + ".f"], to=TensorProto.FLOAT, name=pre + "/Cast"),
                    helper.make_node("Mul", [out + ".f", out + ".s"], [out], name=pre + "/Dequant"),
                ]
            saved += table_bytes - q.nbytes - scale.nbytes
        gw.remove(base)
        model.graph.node.remove(node)
        for k, n in enumerate(new):
            model.graph.node.insert(idx + k, n)
    return saved
