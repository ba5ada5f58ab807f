#!/usr/bin/env python
"""Where a prefill's time goes on CPU: ONNX Runtime's weight-MatMul kernels alone, by rows per call (M).

One MatMul of a model's shape (default SmolLM2-135M's MLP: K 576 x N 1536) as each engine runs it: MatMulNBits
8-bit and 4-bit (blocks of 32, accuracy level 4: INT8 activations, what int8-dynamic and int4-weight use; with
--float-activations also level 1, what `--int4-activations fp32` writes; with --integer also MatMulInteger on
activations quantized per row) and fp32 MatMul (MLAS SGEMM), interleaved per round (A B C A B C), median and spread over rounds, at M = 1 (a decode
step), 16, 64 and 344 (8 short chat prompts prefilled together). Prints a table and writes JSON. Issue 46: the
8-user TTFT is the prefill kernel, not the serving path.

  .venv/bin/python scripts/bench_matmul_kernels.py --threads 2 --rounds 7 --json bench-results/matmul-kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np


def session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def nbits(k: int, n: int, bits: int, threads: int, block: int = 32, accuracy: int = 4):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    blob = rng.integers(0, 255, size=(n, k // block, block * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * (k // block), dtype=np.float32) * 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=accuracy)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                          [numpy_helper.from_array(blob, "B"), numpy_helper.from_array(scales, "S")])
    return session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)]), threads)


def rows_int8(k: int, n: int, threads: int):
    """MatMulInteger (u8 x s8: MLAS's VNNI / dot-product GEMM) on activations quantized per row: one scale per
    token (its max |x| / 127) and the zero point 128 for every row (ONNX Runtime's MatMulInteger takes one zero
    point for A), the weight INT8 per output channel; the int32 result scaled back by row and by column."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    scalars = {"inv": np.float32(1 / 127), "eps": np.float32(1e-30), "f128": np.float32(128), "z128": np.uint8(128)}
    consts = [numpy_helper.from_array(rng.integers(-127, 128, size=(k, n), dtype=np.int8), "B"),
              numpy_helper.from_array(rng.random((1, n), dtype=np.float32) * 0.01, "BS"),
              numpy_helper.from_array(np.array([-1], np.int64), "last")]
    consts += [numpy_helper.from_array(np.array(v), name) for name, v in scalars.items()]
    op = helper.make_node
    nodes = [op("Abs", ["A"], ["abs"]), op("ReduceMax", ["abs", "last"], ["mx"], keepdims=1),
             op("Max", ["mx", "eps"], ["mx1"]), op("Mul", ["mx1", "inv"], ["s"]),  # the row's scale
             op("Div", ["A", "s"], ["d"]), op("Round", ["d"], ["r"]), op("Add", ["r", "f128"], ["u"]),
             op("Cast", ["u"], ["aq"], to=TensorProto.UINT8),  # |x| / s <= 127: no clip needed
             op("MatMulInteger", ["aq", "B", "z128"], ["yi"]), op("Cast", ["yi"], ["yf"], to=TensorProto.FLOAT),
             op("Mul", ["yf", "s"], ["y1"]), op("Mul", ["y1", "BS"], ["Y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], consts)
    return session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), threads)


def fp32(k: int, n: int, threads: int):
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).random((k, n), dtype=np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], [numpy_helper.from_array(w, "W")])
    return session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--rows", default="1,16,64,344")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--float-activations", action="store_true",
                    help="also MatMulNBits at accuracy level 1 (fp32 activations) beside level 4 (INT8 activations)")
    ap.add_argument("--integer", action="store_true",
                    help="also MatMulInteger (u8 x s8) on activations quantized per row, weights per channel")
    ap.add_argument("--json", type=Path, default=Path("bench-results/matmul-kernels.json"))
    a = ap.parse_args()
    kernels = {"MatMulNBits 8-bit": nbits(a.k, a.n, 8, a.threads), "MatMulNBits 4-bit": nbits(a.k, a.n, 4, a.threads),
               "MatMul fp32": fp32(a.k, a.n, a.threads)}
    if a.integer:  # what a W8A8 engine would run (scripts/w8a8_probe_graphs.py: what it would cost in quality)
        kernels["MatMulInteger, INT8 per row"] = rows_int8(a.k, a.n, a.threads)
    if a.float_activations:  # accuracy level 1: what --int4-activations fp32 writes (docs/quality.md)
        kernels |= {"MatMulNBits 8-bit fp32 act": nbits(a.k, a.n, 8, a.threads, accuracy=1),
                    "MatMulNBits 4-bit fp32 act": nbits(a.k, a.n, 4, a.threads, accuracy=1)}
    rows = [int(m) for m in a.rows.split(",")]
    out = {"k": a.k, "n": a.n, "threads": a.threads, "rounds": a.rounds, "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "load_before": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "results": {}}
    print(f"K {a.k} x N {a.n}, {a.threads} threads, {a.rounds} rounds interleaved; ms per call median (min-max), "
          "GOP/s at the median")
    print(f"{'rows':>5} " + " ".join(f"{k:>30}" for k in kernels))
    for m in rows:
        x = np.random.default_rng(1).random((m, a.k), dtype=np.float32)
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for s in kernels.values():
            s.run(None, {"A": x})  # warm-up
        for _ in range(a.rounds):
            for k, s in kernels.items():
                reps = max(3, 200 // m)
                t = time.perf_counter()
                for _ in range(reps):
                    s.run(None, {"A": x})
                times[k].append((time.perf_counter() - t) / reps)
        cells = []
        for k, v in times.items():
            med = statistics.median(v)
            cells.append(f"{1000 * med:.3f} ({1000 * min(v):.3f}-{1000 * max(v):.3f}) {2 * m * a.k * a.n / med / 1e9:5.0f}")
            out["results"].setdefault(k, {})[m] = {"ms_median": 1000 * med, "ms_min": 1000 * min(v), "ms_max": 1000 * max(v),
                                                   "gops": 2 * m * a.k * a.n / med / 1e9}
        print(f"{m:>5} " + " ".join(f"{c:>30}" for c in cells))
    out["load_after"] = os.getloadavg()[0]
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
