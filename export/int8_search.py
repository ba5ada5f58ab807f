"""int8-qdq's choices by measurement, per activation: SmoothQuant's alpha and the activation range.

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

from export.int8_qdq import ActivationAbsMax

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # candidates per activation, beside "not smoothed"
CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)  # range candidates as a share of max |x| ("mse")
RANGE_METHODS = ("max", "mse")


class ActivationSample(ActivationAbsMax):
    """Per weight-MatMul input: max |x| per channel over every calibration row, and `rows_per_text` rows of each
    text (evenly spaced, the first token included) for measuring output errors."""

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


def output_error(x: np.ndarray, weights: list[np.ndarray], refs: list[np.ndarray], s: np.ndarray, r: float,
                 wq: list[np.ndarray] | None = None) -> float:
    """sum over the MatMuls of |Q(x / s) Q(s W) - x W|^2 (refs: the x W; wq: the Q(s W) where already made)."""
    xq = fake_int8_activation(x / s, r)
    wq = wq or [fake_int8_weight(w * s[:, None]) for w in weights]
    return float(sum(np.square(xq @ q - ref, dtype=np.float32).sum(dtype=np.float64) for q, ref in zip(wq, refs)))


@dataclass
class Search:
    """The per-activation choices (`alphas` empty: the one `alpha` for every smoothed activation)."""

    amax: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]
    alpha: float = 0.5
    alphas: tuple[float, ...] = ALPHAS
    range_method: str = "max"
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
            errors[alpha] = output_error(x, weights, refs, s, float(np.max(a / s)))
        best = min(errors, key=errors.get)
        energy = float(sum(np.square(r, dtype=np.float32).sum(dtype=np.float64) for r in refs))
        self.chosen[act] = {"alpha": best, "error": errors[best] / max(energy, 1e-30),
                            "error_at_default": errors.get(self.alpha, float("nan")) / max(energy, 1e-30)}
        return scales(best)

    def range(self, act: str, weights: list[np.ndarray], s: np.ndarray | None) -> float:
        """The INT8 range of the activation `act` (divided by `s` where smoothed) read by `weights` (smoothed)."""
        s = np.ones_like(self.amax[act]) if s is None else s
        top = float(np.max(self.amax[act] / s))
        if self.range_method == "max":
            self.chosen.setdefault(act, {})["clip"] = 1.0
            return top
        x = self.rows[act]
        ws = [w / s[:, None] for w in weights]  # back to the unsmoothed weights: the reference is x W
        refs = [x @ w for w in ws]
        wq = [fake_int8_weight(w) for w in weights]
        errors = {c: output_error(x, ws, refs, s, top * c, wq) for c in CLIPS}
        best = min(errors, key=errors.get)
        self.chosen.setdefault(act, {})["clip"] = best
        return top * best
