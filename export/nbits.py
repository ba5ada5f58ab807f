"""Weight MatMuls -> ONNX Runtime's MatMulNBits (8 or 4 bits, per-block scales), one weight at a time.

Used by the quantize stage (int8-dynamic's "nbits" kernel, int4-weight) on a graph read from disk, and by the
streaming build (export/stream_build.py) on a graph built in memory from a checkpoint, `lazy`: then each
MatMul's quantized tensors are computed only when the graph is saved, straight from the checkpoint's tensor,
and dropped once written, so memory holds one weight (fp32 and quantized) at a time whatever the model's size.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from export.onnx_weights import ALIGN, INLINE_MAX, GraphWeights, weight_matmuls


def nbits_bytes(k: int, n: int, bits: int, block: int, symmetric: bool) -> int:
    """Bytes of one MatMulNBits weight: packed levels, fp32 scales, packed zero points (asymmetric)."""
    kb = -(-k // block)
    return n * kb * block * bits // 8 + n * kb * 4 + (0 if symmetric else n * -(-kb * bits // 8))


def nbits_footprint(k: int, n: int, bits: int, block: int, symmetric: bool) -> int:
    """Bytes one MatMulNBits weight takes in a saved graph: each of its tensors starts on a page of the data
    file (export/onnx_weights.py ALIGN), a small one stays inside the graph. What splitting a weight into
    column runs costs beyond its levels (a few KB per run: noise for a whole weight, a tenth of a k_proj's)."""
    kb = -(-k // block)
    sizes = [n * kb * block * bits // 8, n * kb * 4] + ([] if symmetric else [n * -(-kb * bits // 8)])
    return sum(b if b <= INLINE_MAX else -(-b // ALIGN) * ALIGN for b in sizes)


def nbits_shapes(k: int, n: int, bits: int, block: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of MatMulNBits' B, scales and zero points for a [K, N] weight (ONNX Runtime's layout)."""
    kb = -(-k // block)
    return (n, kb, block * bits // 8), (n, kb), (n, -(-kb * bits // 8))


def split_columns(gw: GraphWeights, target: str, runs: list[tuple[int, int]]) -> list[str]:
    """Replace the weight MatMul `target` by one MatMul per column run [a, b) of its weight, joined on the last
    axis by a Concat into its output (MatMulNBits has one bit width per node: a packed q/k/v whose k and v are
    kept at 8 bits and q at 4 becomes two). Returns the new MatMuls' names (`target`/colsA-B); their weights are
    the slices, read when asked for."""
    from onnx import helper

    graph = gw.model.graph
    node = next(n for n in graph.node if n.name == target)
    w = node.input[1]
    k, n = gw.shape(w)
    if runs[0][0] != 0 or runs[-1][1] != n or any(a[1] != b[0] for a, b in zip(runs, runs[1:])):
        raise ValueError(f"column runs {runs} do not tile {target}'s {n} columns")
    dtype = helper.tensor_dtype_to_np_dtype(gw.initializer(w).data_type)
    made, names = [], []
    for a, b in runs:
        tag = f"/cols{a}-{b}"
        gw.set(w + tag, lambda a=a, b=b: np.ascontiguousarray(gw.array(w)[:, a:b]), dims=(k, b - a), dtype=dtype)
        made.append(helper.make_node("MatMul", [node.input[0], w + tag], [node.output[0] + tag], name=target + tag))
        names.append(target + tag)
    made.append(helper.make_node("Concat", [m.output[0] for m in made], list(node.output), name=target + "/Concat",
                                 axis=-1))
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for i, m in enumerate(made):
        graph.node.insert(at + i, m)
    return names


class _Parts:
    """One weight's quantized parts (B, scales, zero points), computed when the first is read and dropped
    once each has been read: the save writes them one after the other."""

    def __init__(self, fn: Callable[[], tuple[np.ndarray, ...]], count: int) -> None:
        self.fn, self.count, self.value, self.left = fn, count, None, 0

    def part(self, i: int) -> np.ndarray:
        if self.value is None:
            self.value, self.left = self.fn(), self.count
        out = self.value[i]
        self.left -= 1
        if self.left <= 0:
            self.value = None
        return out


def quantize_matmuls(gw: GraphWeights, bits: int, accuracy_level: int = 4, symmetric: bool = True,
                     special: dict[str, tuple[int, int]] | None = None, rounding: str = "minmax", block_size: int = 32,
                     hessian: Callable[[str], np.ndarray] | None = None, lazy: bool = False,
                     gptq_damp4: float | None = None, gptq_damp8: float | None = None) -> None:
    """MatMulNBits over every weight MatMul, blocks of `block_size`; the `special` ones (name -> (bits, block size))
    quantized symmetric (so a tied embedding can gather its rows from the LM head's table). `hessian`
    (this graph's MatMul name -> its input's X^T X) is what "gptq" rounding needs.

    One weight at a time, read from disk, rounded by GPTQ (export/gptq.py, any bits, symmetric or not), by
    k-quant search (4-bit asymmetric) or by ONNX Runtime's own block quantizer (min-max, the one
    `MatMulNBitsQuantizer` calls), its MatMul replaced in place: memory holds one fp32 tensor at a time.
    `lazy`: the quantized tensors are computed when `gw` is saved (or read), not now. `gptq_damp4` / `gptq_damp8`: GPTQ's damping
    for the 4-bit / 8-bit weights (export/gptq.py's default when None)."""
    from onnx import helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    special = special or {}
    model = gw.model
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    quantizers: dict[tuple[int, int, bool], DefaultWeightOnlyQuantizer] = {}
    for node in weight_matmuls(model):
        b, block = special.get(node.name, (bits, block_size))
        sym = True if node.name in special else symmetric
        key = (b, block, sym)
        if key not in quantizers:
            quantizers[key] = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
                block_size=block, is_symmetric=sym, accuracy_level=accuracy_level, bits=b))
        wname = node.input[1]
        k, n = gw.shape(wname)

        def parts(wname=wname, node_name=node.name, b=b, block=block, sym=sym, q=quantizers[key]):
            w = gw.array(wname).astype(np.float32, copy=False)
            return _quantize(w, b, block, sym, rounding, hessian, node_name, q, gptq_damp4 if b == 4 else gptq_damp8)

        names = [wname + f"_Q{b}", wname + "_scales"] + ([] if sym else [wname + "_zero_points"])
        if lazy:
            cell = _Parts(parts, len(names))
            for i, (name, shape, dtype) in enumerate(zip(names, nbits_shapes(k, n, b, block),
                                                         (np.uint8, np.float32, np.uint8))):
                gw.set(name, lambda c=cell, i=i: c.part(i), dims=shape, dtype=dtype)
        else:
            for name, value in zip(names, parts()):
                gw.set(name, value)
        inputs = [node.input[0], *names]
        attrs = dict(K=k, N=n, bits=b, block_size=block) | ({"accuracy_level": accuracy_level} if accuracy_level else {})
        q = helper.make_node("MatMulNBits", inputs, list(node.output), name=node.name + f"_Q{b}",
                             domain="com.microsoft", **attrs)
        node.CopyFrom(q)  # in place: the graph keeps its order
    gw.drop_unused()


def _quantize(w: np.ndarray, b: int, block: int, sym: bool, rounding: str, hessian, node_name: str,
              quantizer, damp: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, scales, zero points) of one [K, N] weight in MatMulNBits' layout."""
    if rounding == "gptq" or rounding == "kquant" and not sym and b == 4:
        from export.int4 import block_quant, pack

        if rounding == "gptq":
            from export.gptq import gptq_block_quant

            if hessian is None:
                raise ValueError("gptq rounding needs the inputs' statistics (hessian=)")
            q, scales, zp = gptq_block_quant(w, hessian(node_name), b, block, symmetric=sym,
                                             **({} if damp is None else {"damp": damp}))
        else:
            q, scales, zp = block_quant(w, b, block, "kquant")
        packed, zero_points = pack(q, zp, b)
        return packed, scales, zero_points
    return quantizer.qbits_block_quant(w)
