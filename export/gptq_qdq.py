"""GPTQ for a MatMul whose input is quantized too (the Q/DQ formats), after GPTAQ (Li et al., 2025).

Plain GPTQ fits the rounded weights to what the *float* input does with them, |X (W - W')|; the engine then
multiplies the quantized input X~ = Q(X). Fitting |X W - X~ W'| instead lets the weights take up what the input's
rounding does on the calibration text (values clipped by the per-tensor range, small ones flushed to zero, the
steps). Its solution is plain GPTQ on a moved target: the least-squares

    W* = (X~^T X~ + l I)^-1 (X~^T X W + l W)      (l: the damping, pulling W* toward W where X~ says little)

rounded by GPTQ on X~^T X~, since |X W - X~ W'|^2 = |X W - X~ W*|^2 + |X~ (W* - W')|^2 up to the damping.
The two K x K matrices come from the plain fp32 graph on GPTQ's texts, with the quantizer the engine's
QuantizeLinear / DequantizeLinear pair applies, in passes of at most ONE_PASS_BYTES (export/gptq.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from export.gptq import ONE_PASS_BYTES


class QuantizedInputStatistics:
    """(X~^T X~, X~^T X) / rows (float64) of each input tensor in `quantize` (by the plain graph's tensor name: its
    fake Q/DQ, e.g. FP8 with the range the engine uses) on `feeds`, in graph order, `max_bytes` of matrices a pass."""

    def __init__(self, plain: Path, work: Path, feeds: list[dict],
                 quantize: dict[str, Callable[[np.ndarray], np.ndarray]], widths: dict[str, int],
                 max_bytes: int = ONE_PASS_BYTES, threads: int | None = None) -> None:
        import onnx

        from export.onnx_weights import GraphWeights

        if not feeds or not sum(int(np.prod(f["input_ids"].shape)) for f in feeds):
            raise ValueError("GPTQ needs calibration text: no tokens were given")
        self.order = list(quantize)
        self.quantize, self.widths, self.feeds = quantize, widths, feeds
        self.max_bytes, self.threads = max_bytes, threads
        self.rows = sum(int(np.prod(f["input_ids"].shape)) for f in feeds)
        self.path = work / "quantized-inputs.onnx"
        gw = GraphWeights(plain)
        known = {o.name for o in gw.model.graph.output}
        for x in self.order:
            if x not in known:
                gw.model.graph.output.append(onnx.helper.make_empty_tensor_value_info(x))
        try:
            gw.save(self.path)
        except BaseException:
            self.close()
            raise
        self.loaded: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.passes = 0

    def __enter__(self) -> "QuantizedInputStatistics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, x: str) -> tuple[np.ndarray, np.ndarray]:
        if x not in self.loaded:
            self._collect(self.order.index(x))
        return self.loaded[x]

    def _collect(self, start: int) -> None:
        import onnxruntime as ort

        names, size = [], 0
        for x in self.order[start:]:
            size += 2 * self.widths[x] ** 2 * 8
            if names and size > self.max_bytes:
                break
            names.append(x)
        self.loaded = {}
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = self.threads
        sess = ort.InferenceSession(str(self.path), so, providers=["CPUExecutionProvider"])
        acc: dict[str, list[np.ndarray]] = {}
        for f in tqdm(self.feeds, desc=f"quantized-input statistics, pass {self.passes + 1}", unit="text", leave=False):
            for x, a in zip(names, sess.run(names, f)):
                a = a.reshape(-1, a.shape[-1]).astype(np.float32, copy=False)
                aq = self.quantize[x](a).astype(np.float32, copy=False)
                both = aq.T @ np.concatenate([aq, a], axis=1)  # [K, 2K]: X~^T X~ | X~^T X in one GEMM
                if x in acc:
                    np.add(acc[x], both, out=acc[x])
                else:
                    acc[x] = both.astype(np.float64)
        del sess
        for x, m in acc.items():
            m /= self.rows
            if not np.isfinite(m).all():
                raise ValueError(f"GPTQ: the quantized input {x} is not finite on the calibration text (NaN or inf): "
                                 "set int8_rounding = 'gptq' without qdq_input_aware, or 'minmax'")
            k = m.shape[0]
            self.loaded[x] = (m[:, :k], m[:, k:])
        self.passes += 1

    def close(self) -> None:
        self.loaded = {}
        for p in (self.path, self.path.with_name(self.path.name + ".data")):
            p.unlink(missing_ok=True)


def input_aware_target(w: np.ndarray, h_q: np.ndarray, cross: np.ndarray, damp: float) -> np.ndarray:
    """W* [K, N] (float32) = (X~^T X~ + l I)^-1 (X~^T X W + l W), l = `damp` x the mean of X~^T X~'s diagonal: the
    weights that best map the quantized input to the float product, pulled toward W where the input is small
    (a row never reached by the calibration keeps its weights)."""
    k = w.shape[0]
    if h_q.shape != (k, k) or cross.shape != (k, k):
        raise ValueError(f"GPTQ: a weight of {w.shape} needs two ({k}, {k}) input statistics, got {h_q.shape} and {cross.shape}")
    w64 = w.astype(np.float64)
    lam = damp * float(np.mean(np.diagonal(h_q))) or 1e-12
    a = h_q + lam * np.eye(k)
    return np.linalg.solve(a, cross @ w64 + lam * w64).astype(np.float32)
