"""int8-qdq's (and fp8-qdq's) choices by measurement, per activation: SmoothQuant's alpha, the activation range, and
the activations left float within a byte budget (`float_groups`). `fp8`: the same with FP8 E4M3's errors.

One alpha for every layer (SmoothQuant's paper uses 0.5 for most models, 0.8-0.85 for some) is a compromise:
a layer whose inputs have a few huge channels wants more of them moved into its weights than one whose inputs
are even, and too much moved makes the weights' per-channel ranges the problem. So each smoothed activation
gets the alpha whose quantized MatMuls reproduce the float ones best on calibration rows: the squared error
|Q(x / s) Q(s W) - x W|^2 summed over the MatMuls that read it, over a sample of the calibration tokens' rows
(`ActivationSample`, collected in the same block-by-block pass as the ranges). "Not smoothed" (s = 1) is a
candidate too. The same error picks the activation's range (`range_method = "mse"`): its max |x| (ONNX
Runtime's MinMax, TensorRT's max calibration) or that times a clip factor, where clipping the rare outliers
buys finer steps for every other value; "max" keeps the max. The max itself comes from every calibration row,
not the sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from export.hessians import LayerHessians

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # candidates per activation, beside "not smoothed"
CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)  # range candidates as a share of max |x| ("mse")
FP8_CLIPS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)  # ...for FP8, whose steps are relative: it can clip deeper
RANGE_METHODS = ("max", "mse")
FP8_OPSET = 19  # FP8 E4M3 Q/DQ is opset 19's
FP8_MAX = 448.0  # the largest finite E4M3FN value


class ActivationSample(LayerHessians):
    """Per weight-MatMul input, the model run one block at a time (export/int8_qdq.py `ActivationAbsMax`): max |x|
    per channel over every calibration row, and `rows_per_text` rows of each text (evenly spaced, the first token
    included) for measuring output errors."""

    method = "by block (torch)"

    def __init__(self, *args, rows_per_text: int = 16, **kw) -> None:
        self.rows_per_text = rows_per_text
        super().__init__(*args, **kw)

    def _add(self, acc: dict, x: str, a: np.ndarray) -> None:
        m = np.abs(a).max(axis=0)
        pick = a[np.unique(np.linspace(0, len(a) - 1, min(self.rows_per_text, len(a))).astype(int))]
        if x not in acc:
            acc[x] = (m, [pick])
        else:
            acc[x] = (np.maximum(acc[x][0], m), acc[x][1] + [pick])

    def _done(self, acc: dict) -> dict:
        return {x: (m, np.concatenate(rows).astype(np.float32)) for x, (m, rows) in acc.items()}

    def all(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(per-channel max |x|, sample rows) of every input, in one pass over the blocks."""
        amax, rows = {}, {}
        for node, x in self.input_of.items():
            if x not in amax:
                amax[x], rows[x] = self(node)
                amax[x] = amax[x].astype(np.float32)
        return amax, rows


def fake_int8_activation(x: np.ndarray, r: float) -> np.ndarray:
    """x through symmetric per-tensor INT8 Q/DQ of range r (scale r / 127, as ONNX Runtime writes it)."""
    step = np.float32(max(r, 1e-12) / 127.0)
    return np.clip(np.round(x / step), -127, 127) * step


def fake_int8_weight(w: np.ndarray) -> np.ndarray:
    """w [K, N] through symmetric INT8 per output channel (round to nearest; the search's stand-in for GPTQ)."""
    s = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0
    return (np.clip(np.round(w / s), -127, 127) * s).astype(np.float32)


def fake_fp8(x: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    """x through FP8 E4M3 Q/DQ with `scale` (saturating, as QuantizeLinear's default)."""
    import ml_dtypes

    q = np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * scale


def fake_fp8_activation(x: np.ndarray, r: float) -> np.ndarray:
    """x through per-tensor FP8 E4M3 Q/DQ of range r (scale r / 448, as export/trt_formats.py writes it)."""
    return fake_fp8(x, max(r, 1e-12) / FP8_MAX)


def fake_fp8_weight(w: np.ndarray) -> np.ndarray:
    """w [K, N] through FP8 E4M3 per output channel (round to nearest; the search's stand-in for GPTQ)."""
    return fake_fp8(w, np.maximum(np.abs(w).max(axis=0), 1e-8) / FP8_MAX)


def output_error(x: np.ndarray, weights: list[np.ndarray], refs: list[np.ndarray], s: np.ndarray, r: float,
                 wq: list[np.ndarray] | None = None, fp8: bool = False) -> float:
    """sum over the MatMuls of |Q(x / s) Q(s W) - x W|^2 (refs: the x W; wq: the Q(s W) where already made);
    Q: INT8, or FP8 E4M3 with `fp8`."""
    xq = (fake_fp8_activation if fp8 else fake_int8_activation)(x / s, r)
    wq = wq or [(fake_fp8_weight if fp8 else fake_int8_weight)(w * s[:, None]) for w in weights]
    return float(sum(np.square(xq @ q - ref, dtype=np.float32).sum(dtype=np.float64) for q, ref in zip(wq, refs)))


@dataclass
class Search:
    """The per-activation choices (`alphas` empty: the one `alpha` for every smoothed activation)."""

    amax: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]
    alpha: float = 0.5
    alphas: tuple[float, ...] = ALPHAS
    range_method: str = "max"
    fp8: bool = False  # the errors of FP8 E4M3 Q/DQ (fp8-qdq) instead of INT8's
    chosen: dict[str, dict] = field(default_factory=dict)  # activation -> {"alpha", "clip", "error"}: the record

    def smoothing(self, act: str, weights: list[np.ndarray]) -> np.ndarray:
        """s for the activation `act` read by `weights` ([K, N] each, unsmoothed): the alpha (or none) whose
        quantized output error at the max range is least."""
        a = np.maximum(self.amax[act], 1e-5)
        wmax = np.maximum(np.max([np.abs(w).max(axis=1) for w in weights], axis=0), 1e-5)

        def scales(alpha: float | None) -> np.ndarray:
            if alpha is None:
                return np.ones_like(a)
            return np.clip(np.power(a, alpha) / np.power(wmax, 1 - alpha), 1e-2, 1e2).astype(np.float32)

        if not self.alphas:
            s = scales(self.alpha)
            self.chosen[act] = {"alpha": self.alpha}
            return s
        x = self.rows[act]
        refs = [x @ w for w in weights]
        errors = {}
        for alpha in (None, *self.alphas):
            s = scales(alpha)
            errors[alpha] = output_error(x, weights, refs, s, float(np.max(a / s)), fp8=self.fp8)
        best = min(errors, key=errors.get)
        energy = float(sum(np.square(r, dtype=np.float32).sum(dtype=np.float64) for r in refs))
        self.chosen[act] = {"alpha": best, "error": errors[best] / max(energy, 1e-30),
                            "error_at_default": errors.get(self.alpha, float("nan")) / max(energy, 1e-30)}
        return scales(best)

    def range(self, act: str, weights: list[np.ndarray], s: np.ndarray | None) -> float:
        """The INT8 (FP8) range of the activation `act` (divided by `s` where smoothed) read by `weights` (smoothed)."""
        s = np.ones_like(self.amax[act]) if s is None else s
        top = float(np.max(self.amax[act] / s))
        if self.range_method == "max":
            self.chosen.setdefault(act, {})["clip"] = 1.0
            return top
        x = self.rows[act]
        ws = [w / s[:, None] for w in weights]  # back to the unsmoothed weights: the reference is x W
        refs = [x @ w for w in ws]
        wq = [(fake_fp8_weight if self.fp8 else fake_int8_weight)(w) for w in weights]
        errors = {c: output_error(x, ws, refs, s, top * c, wq, self.fp8) for c in (FP8_CLIPS if self.fp8 else CLIPS)}
        best = min(errors, key=errors.get)
        self.chosen.setdefault(act, {})["clip"] = best
        return top * best


# ----------------------------------------------------------------------------- which activations stay float


class QdqProbe:
    """The (int8-qdq: smoothed) fp32 graph with each quantized activation behind Where(flag, Q/DQ(x), x) (a bool graph input per
    activation) and the quantized MatMuls' weights as graph inputs: one session measures what INT8 (`fp8`: FP8
    E4M3) on any one activation group (its Q/DQ and its MatMuls' quantized weights) does to the logits, nothing
    rebuilt per group."""

    def __init__(self, smoothed: Path, work: Path, groups: dict[str, list[str]], ranges: dict[str, float],
                 feeds: list[dict], fp8: bool = False) -> None:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper

        from export.onnx_weights import GraphWeights, set_opset, weight_matmuls
        from export.sensitivity import _log_softmax32

        gw = GraphWeights(smoothed)
        if fp8:
            set_opset(gw, FP8_OPSET)  # FP8 Q/DQ are opset 19's
        model = gw.model
        by_name = {n.name: n for n in weight_matmuls(model)}
        self.groups = groups
        self.weights = {n: np.ascontiguousarray(gw.array(by_name[n].input[1]), np.float32)
                        for ns in groups.values() for n in ns}
        self.weight_input = {n: by_name[n].input[1] for n in self.weights}
        names = set(self.weight_input.values())
        keep = [i for i in model.graph.initializer if i.name not in names]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        for n, w in self.weights.items():
            model.graph.input.append(helper.make_tensor_value_info(self.weight_input[n], TensorProto.FLOAT, list(w.shape)))
        self.flag = {}
        top, ztype = (FP8_MAX, TensorProto.FLOAT8E4M3FN) if fp8 else (127.0, TensorProto.INT8)
        nodes = list(model.graph.node)
        for k, (x, ns) in enumerate(groups.items()):
            flag, scale, zero = f"qdq_probe/{k}/on", f"qdq_probe/{k}/scale", f"qdq_probe/{k}/zero"
            self.flag[x] = flag
            model.graph.input.append(helper.make_tensor_value_info(flag, TensorProto.BOOL, []))
            model.graph.initializer.extend([helper.make_tensor(scale, TensorProto.FLOAT, [], [max(ranges[x], 1e-12) / top]),
                                            helper.make_tensor(zero, ztype, [], [0])])
            extra = [helper.make_node("QuantizeLinear", [x, scale, zero], [f"qdq_probe/{k}/q"]),
                     helper.make_node("DequantizeLinear", [f"qdq_probe/{k}/q", scale, zero], [f"qdq_probe/{k}/dq"]),
                     helper.make_node("Where", [flag, f"qdq_probe/{k}/dq", x], [f"qdq_probe/{k}/x"])]
            for n in ns:
                by_name[n].input[0] = f"qdq_probe/{k}/x"
            at = min(nodes.index(by_name[n]) for n in ns)
            nodes[at:at] = extra
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        path = work / "qdq-probe.onnx"
        if gw.path.parent.resolve() == work.resolve():
            onnx.save_model(model, str(path))  # beside the weights it names
        else:  # never write beside another stage's files (the fp32 graph of fp8-qdq): a copy with its weights
            gw.save(path)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_quant_qdq", "1")  # the Q/DQ arithmetic as written
        try:
            self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        finally:
            path.unlink()
            if gw.path == path:
                path.with_name(path.name + ".data").unlink(missing_ok=True)
        self.feeds = feeds
        self.tokens = sum(f["input_ids"].shape[1] for f in feeds)
        self.ref = [_log_softmax32(lo[0]) for lo in self.logits(None, {})]

    def logits(self, on: str | None, swap: dict[str, np.ndarray]) -> list[np.ndarray]:
        flags = {f: np.array(x == on) for x, f in self.flag.items()}
        weights = {self.weight_input[n]: swap.get(n, w) for n, w in self.weights.items()}
        return [self.session.run(["logits"], f | flags | weights)[0] for f in self.feeds]

    def kl(self, x: str, dequantized: dict[str, np.ndarray]) -> float:
        """Mean KL(float || this) per token with only activation `x` and its MatMuls' weights quantized."""
        from export.sensitivity import _kl

        lo = self.logits(x, {n: dequantized[n] for n in self.groups[x]})
        return sum(_kl(r, o[0]) for r, o in zip(self.ref, lo)) / self.tokens


def float_groups(smoothed: Path, work: Path, groups: dict[str, list[str]], ranges: dict[str, float],
                 dequantized: dict[str, np.ndarray], feeds: list[dict], ratio: float, enough: float = 0.0,
                 fp8: bool = False) -> tuple[list[str], dict[str, float]]:
    """The activation groups to leave float: the ones whose INT8 (`fp8`: FP8) form moves KL to the float graph most
    per extra byte (fp16 instead of 8-bit weights in TensorRT: K x N bytes per MatMul), while the extra bytes stay
    within `ratio` of the 8-bit weights' bytes (export/sensitivity.py `allocate`, the int4 budget's rule), and only
    until the rest's measured KLs sum to at most `enough` (a model whose 8-bit form is already that close keeps no
    fp16 bytes it does not need). Returns the chosen activations and every group's measured KL."""
    from tqdm import tqdm

    from export.sensitivity import allocate

    probe = QdqProbe(smoothed, work, groups, ranges, feeds, fp8)
    sens = {x: probe.kl(x, dequantized) for x in tqdm(groups, desc=f"{'fp8' if fp8 else 'int8'}-qdq sensitivity "
                                                      "(KL per activation)", unit="activation")}
    del probe
    cost = {x: sum(int(dequantized[n].size) for n in ns) for x, ns in groups.items()}
    return allocate(sens, cost, int(ratio * sum(cost.values())), enough), sens


def budget_record(ratio: float, enough: float, chosen: list[str], sens: dict[str, float]) -> dict:
    """The quantize stage's record of `float_groups`' choice (int8-qdq's and fp8-qdq's metrics); `qdq_estimated_kl`:
    the quantized activations' measured KLs summed (SmolLM2: within ~15% of the engine's KL on held-out chats)."""
    kept = set(chosen)
    return {"qdq_float_ratio": ratio, "qdq_float_kl": enough,
            "qdq_estimated_kl": sum(v for x, v in sens.items() if x not in kept), "qdq_float_activations": chosen,
            "qdq_sensitivity": dict(sorted(sens.items(), key=lambda kv: -kv[1]))}
