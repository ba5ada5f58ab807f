"""export/gptq_qdq.py: GPTQ fitted to a quantized input's product (fp8-qdq's `qdq_input_aware`), on tiny arrays,
a hand-made graph (test_gptq.py's) and the tiny model's fp8-qdq build."""

from __future__ import annotations

import json

import numpy as np
import pytest

from export.gptq_qdq import QuantizedInputStatistics, input_aware_target
from export.int8_search import fake_fp8
from test_gptq import K, _feeds, _graph


def _fp8_inputs(rng, k: int, rows: int = 800) -> tuple[np.ndarray, np.ndarray]:
    """Inputs with a few outlier channels (what sets a per-tensor range) and their FP8 Q/DQ with a clipped range:
    the small channels land on coarse or subnormal steps, the outliers are clipped."""
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 1, k)).astype(np.float32)
    x[:, :3] *= 60
    x[:, k // 2:] += 0.5 * x[:, : k - k // 2]
    return x, fake_fp8(x, 0.8 * np.abs(x).max() / 448)


def test_the_target_is_w_itself_when_the_input_is_not_quantized():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 40)).astype(np.float32)
    w = rng.standard_normal((40, 7)).astype(np.float32)
    h = x.astype(np.float64).T @ x / 300
    np.testing.assert_allclose(input_aware_target(w, h, h, 0.03), w, rtol=1e-4, atol=1e-5)


def test_the_target_is_the_least_squares_fit_and_a_dead_input_keeps_its_weights():
    rng = np.random.default_rng(1)
    x, xq = _fp8_inputs(rng, 64)
    x[:, 5] = xq[:, 5] = 0  # never reached by the calibration
    w = rng.standard_normal((64, 9)).astype(np.float32)
    hq, cross = (xq.T.astype(np.float64) @ np.concatenate([xq, x], 1) / len(x)).reshape(64, 2, 64).transpose(1, 0, 2)
    target = input_aware_target(w, hq, cross, 1e-6)
    err = lambda v: np.linalg.norm(x @ w - xq @ v)  # noqa: E731
    best = np.linalg.lstsq(xq.astype(np.float64), (x @ w).astype(np.float64), rcond=None)[0]
    assert err(target) <= 1.001 * err(best) and err(target) < 0.8 * err(w)
    assert np.allclose(target[5], w[5])
    with pytest.raises(ValueError, match="two .64, 64. input statistics"):
        input_aware_target(w, hq[:10, :10], cross, 0.03)


@pytest.mark.parametrize("k,n", [(96, 8), (200, 17)])
def test_input_aware_fp8_levels_beat_plain_gptq_on_the_quantized_product(k, n):
    """What the engine computes is X~ W': levels GPTQ-rounded toward the input-aware target move it less from the
    float product X W than plain GPTQ's (fitted to X), on the calibration rows."""
    from export.gptq import gptq_fp8

    rng = np.random.default_rng(k)
    x, xq = _fp8_inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    h = x.astype(np.float64).T @ x / len(x)
    hq = xq.astype(np.float64).T @ xq / len(x)
    cross = xq.astype(np.float64).T @ x / len(x)
    target = input_aware_target(w, hq, cross, 0.03)

    def levels(v, hh):
        s = (np.abs(v).max(axis=0) / 448).astype(np.float32)
        return gptq_fp8(v, hh, s, 0.03).astype(np.float32) * s

    plain, aware = levels(w, h), levels(target, hq)
    err = lambda v: np.linalg.norm(x @ w - xq @ v)  # noqa: E731
    assert err(aware) < 0.8 * err(plain), (err(aware), err(plain))


def test_statistics_are_the_quantized_inputs_products_in_any_number_of_passes(tmp_path):
    rng = np.random.default_rng(0)
    ws = _graph(tmp_path / "plain.onnx", rng)
    feeds = _feeds(rng)
    x = np.concatenate([f["x"][0] for f in feeds]).astype(np.float32)
    hid = np.maximum(x @ ws["W0"], 0)
    s = hid @ ws["W1"] + hid @ ws["W2"]
    inputs = {"x": x, "h": hid, "s": s}
    quantize = {t: (lambda a, c=0.5 * np.abs(v).max() / 448: fake_fp8(a, c)) for t, v in inputs.items()}
    work = tmp_path / "work"
    work.mkdir()
    for max_bytes, passes in ((2 << 30, 2), (2 * K * K * 8, 3)):
        with QuantizedInputStatistics(tmp_path / "plain.onnx", work, feeds, quantize, {t: K for t in inputs},
                                      max_bytes=max_bytes) as st:
            for t in ("s", "x", "h"):  # out of graph order: a pass starts at the input asked for
                a = inputs[t].astype(np.float64)
                aq = quantize[t](inputs[t]).astype(np.float64)
                hq, cross = st(t)
                for got, ref in ((hq, aq.T @ aq / len(a)), (cross, aq.T @ a / len(a))):
                    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
                assert not np.allclose(cross, a.T @ a / len(a), rtol=1e-3)  # the quantizer was applied
            assert st.passes == passes
        assert not list(work.iterdir())
    with pytest.raises(ValueError, match="no tokens"):
        QuantizedInputStatistics(tmp_path / "plain.onnx", work, [], quantize, {t: K for t in inputs})


def test_fp8_qdq_input_aware_on_the_tiny_model(tmp_path):
    """The option end to end: recorded, nothing left behind, the weights differ from plain GPTQ's and the graph
    stays as close to fp32 as plain GPTQ's on text it was not fitted on."""
    import onnx
    from onnx import numpy_helper

    from conftest import loaded_plain
    from export import quantize
    from test_trt_formats import _kl_top1, _logits

    out = loaded_plain(tmp_path)
    ids = np.random.default_rng(0).integers(3, 250, (1, 48))
    ref = _logits(out["fp32"], ids)
    got = {}
    for aware in (False, True):
        d = tmp_path / f"fp8-{aware}"
        d.mkdir()
        m = quantize.run(tmp_path / "plain", tmp_path / "hf", d,
                         quantize.QuantizeOptions(mode="fp8-qdq", samples=8, gptq_samples=8, qdq_input_aware=aware))
        assert m["fp8_rounding"] == ("gptq, input-aware" if aware else "gptq")
        assert sorted(p.name for p in d.iterdir()) == ["model.onnx", "model.onnx.data"]
        g = onnx.load(str(d / "model.onnx"))
        got[aware] = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN
                      and i.dims}
        got[aware, "kl"] = _kl_top1(ref, _logits(d, ids))
        json.dumps(m, default=str)
    assert got[False].keys() == got[True].keys() and len(got[True]) >= 5
    assert any(not np.array_equal(got[False][k].view(np.uint8), got[True][k].view(np.uint8)) for k in got[True])
    (kl0, top0), (kl1, top1) = got[False, "kl"], got[True, "kl"]
    assert kl1 < max(2 * kl0, 0.005) and top1 >= 0.9, (got[False, "kl"], got[True, "kl"])
