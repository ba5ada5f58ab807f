"""int8-qdq and fp8-qdq choices made by measurement: SmoothQuant's alpha per activation and the activation ranges
(export/int8_search.py, for INT8 and FP8), GPTQ-rounded INT8 weights in the Q/DQ graph
(export/int8_qdq.py `gptq_weights`), and that TensorRT's importer rules still accept what they write."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper


def _outlier_rows(rng, rows: int = 512, k: int = 64) -> np.ndarray:
    """Activations like an LLM's: most channels small, two channels 50x larger on every token."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, [3, 40]] *= 50
    return x


def test_alpha_search_smooths_outlier_channels_and_beats_one_alpha():
    from export.int8_search import Search, output_error

    rng = np.random.default_rng(0)
    x = _outlier_rows(rng)
    w = [rng.standard_normal((64, 96)).astype(np.float32) * 0.05, rng.standard_normal((64, 32)).astype(np.float32) * 0.05]
    search = Search({"x": np.abs(x).max(axis=0)}, {"x": x}, alpha=0.5)
    s = search.smoothing("x", w)
    refs = [x @ m for m in w]
    err = output_error(x, w, refs, s, float(np.max(np.abs(x).max(axis=0) / s)))
    none = output_error(x, w, refs, np.ones(64, np.float32), float(np.abs(x).max()))
    assert search.chosen["x"]["alpha"] is not None  # outliers: smoothing is chosen
    assert err < 0.5 * none  # and it removes most of the error per-tensor INT8 activations had
    assert search.chosen["x"]["error"] <= search.chosen["x"]["error_at_default"]
    assert s[3] > 5 * np.median(s) and s[40] > 5 * np.median(s)  # the outlier channels are divided most


def test_mse_range_clips_rare_outliers_and_max_keeps_them():
    from export.int8_search import CLIPS, Search, output_error

    rng = np.random.default_rng(2)
    x = rng.standard_normal((512, 64)).astype(np.float32)
    x[5, 9] = 400.0  # one token, one channel: the max would leave every other value a few levels
    w = [rng.standard_normal((64, 48)).astype(np.float32)]
    amax = {"x": np.abs(x).max(axis=0)}
    r_max = Search(amax, {"x": x}, range_method="max").range("x", w, None)
    mse = Search(amax, {"x": x}, range_method="mse")
    r_mse = mse.range("x", w, None)
    assert r_max == pytest.approx(400.0)
    assert r_mse < r_max and mse.chosen["x"]["clip"] in CLIPS
    ones, refs = np.ones(64, np.float32), [x @ w[0]]
    assert output_error(x, w, refs, ones, r_mse) < output_error(x, w, refs, ones, r_max)


def test_fp8_range_is_the_least_output_error():
    """fp8-qdq's "mse" range: the clip of max |x| whose FP8 E4M3 Q/DQ output error is least."""
    from export.int8_search import FP8_CLIPS, Search, fake_fp8

    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 32)).astype(np.float32) * 1e-3
    x[0, 0] = 1e3  # an attention-sink-like token: at its max the small values fall below E4M3's subnormals
    w = [rng.standard_normal((32, 16)).astype(np.float32)]
    search = Search({"x": np.abs(x).max(axis=0)}, {"x": x}, range_method="mse", fp8=True)
    r = search.range("x", w, None)
    c = search.chosen["x"]["clip"]
    assert c in FP8_CLIPS and r == pytest.approx(1e3 * c)

    def err(clip):
        wq = fake_fp8(w[0], np.abs(w[0]).max(axis=0) / 448)
        return float(np.square(fake_fp8(x, 1e3 * clip / 448) @ wq - x @ w[0]).sum())
    assert all(err(c) <= err(o) for o in FP8_CLIPS)


@pytest.fixture(scope="module")
def qdq_graphs(tmp_path_factory) -> dict[str, Path]:
    """A tiny loaded model's plain graph, and int8-qdq from it with ONNX Runtime's rounding (one alpha, max ranges)
    and with this module's choices (alpha search, MSE ranges, GPTQ weights)."""
    from conftest import loaded_plain
    from export import quantize

    d = tmp_path_factory.mktemp("qdqcal")
    out = loaded_plain(d)
    for name, extra in (("nearest", {"qdq_alpha_search": False, "qdq_range": "max", "int8_rounding": "minmax", "qdq_float_ratio": 0}),
                        # 0.05 keeps nothing of a 2-layer model; qdq_float_kl 0: the whole budget, as its KLs are tiny
                        ("measured", {"qdq_float_ratio": 0.3, "qdq_float_kl": 0}),
                        ("close-enough", {"qdq_float_ratio": 0.3})):  # the default qdq_float_kl, 0.004
        (d / name).mkdir()
        out[name + "_metrics"] = quantize.run(d / "plain", d / "hf", d / name, quantize.QuantizeOptions(
            mode="int8-qdq", samples=8, gptq_samples=8, smoothquant_ablation=False, **extra))
        out[name] = d / name
    return out


def _weight_levels(path: Path) -> dict[str, np.ndarray]:
    """MatMul name -> the INT8 levels its DequantizeLinear weight holds."""
    g = onnx.load(str(path / "model.onnx"))
    inits = {i.name: i for i in g.graph.initializer}
    dq = {n.output[0]: n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    return {n.name: numpy_helper.to_array(inits[dq[n.input[1]].input[0]]) for n in g.graph.node
            if n.op_type == "MatMul" and n.input[1] in dq}


def test_int8_qdq_weights_are_gptq_rounded_in_the_same_layout(qdq_graphs):
    near, meas = _weight_levels(qdq_graphs["nearest"]), _weight_levels(qdq_graphs["measured"])
    assert set(meas) < set(near) and len(meas) >= 6  # the float budget took some
    assert all(q.dtype == np.int8 and q.shape == near[n].shape for n, q in meas.items())
    changed = [n for n in meas if not np.array_equal(meas[n], near[n])]
    assert len(changed) == len(meas)  # every weight re-rounded (and smoothed with its own alpha)
    m = qdq_graphs["measured_metrics"]
    assert m["int8_rounding"] == "gptq" and m["qdq_range"] == "mse" and m["gptq_tokens"] > 0
    assert sum(m["smoothquant_alphas"].values()) == m["smoothquant_groups"] > 0
    assert qdq_graphs["nearest_metrics"]["int8_rounding"] == "minmax"


@pytest.mark.parametrize("name", ["nearest", "measured"])
def test_tensorrt_check_accepts_the_int8_qdq_graphs(qdq_graphs, name):
    from export.trt_compat import check

    rep = check(qdq_graphs[name] / "model.onnx")
    assert rep.compatible, rep.problems
    g = onnx.load(str(qdq_graphs[name] / "model.onnx"))
    inits = {i.name: i for i in g.graph.initializer}
    for n in g.graph.node:  # symmetric: every zero point 0 (TensorRT takes no other)
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2:
            assert not numpy_helper.to_array(inits[n.input[2]]).any()


def test_measured_int8_qdq_runs_close_to_fp32(qdq_graphs):
    from test_trt_formats import _kl_top1, _logits

    ids = np.random.default_rng(0).integers(3, 250, (1, 48))
    ref = _logits(qdq_graphs["fp32"], ids)
    kl, top1 = _kl_top1(ref, _logits(qdq_graphs["measured"], ids))
    assert kl < 0.01 and top1 >= 0.9, (kl, top1)


def test_the_activations_that_hurt_most_stay_float_within_the_budget(qdq_graphs):
    """The float budget (qdq_float_ratio) leaves float the measured-worst activations: their MatMuls read the
    activation and an fp32 weight straight, no Q/DQ, and their fp16 bytes fit the budget."""
    m = qdq_graphs["measured_metrics"]
    sens, chosen = m["qdq_sensitivity"], m["qdq_float_activations"]
    assert len(sens) >= 4 and all(v >= 0 for v in sens.values())
    assert chosen, {k: m[k] for k in ("qdq_sensitivity", "qdq_float_activations")}
    g = onnx.load(str(qdq_graphs["measured"] / "model.onnx"))
    inits = {i.name: i for i in g.graph.initializer}
    producers = {o: n for n in g.graph.node for o in n.output}
    readers = [n for n in g.graph.node if n.op_type == "MatMul" and n.input[0] in chosen]
    assert readers and all(n.name in m["float_matmuls"] for n in readers)
    for n in readers:
        assert n.input[1] in inits and inits[n.input[1]].data_type == onnx.TensorProto.FLOAT
    quantized = [n for n in g.graph.node if n.op_type == "MatMul" and n.input[1] in producers
                 and producers[n.input[1]].op_type == "DequantizeLinear"]
    size = {n.input[0]: 0 for n in readers}
    for n in readers:
        size[n.input[0]] += int(np.prod(inits[n.input[1]].dims))
    int8 = sum(int(np.prod(inits[producers[n.input[1]].input[0]].dims)) for n in quantized)
    assert sum(size.values()) <= m["qdq_float_ratio"] * (int8 + sum(size.values()))


def test_a_model_already_close_enough_keeps_nothing_float(qdq_graphs):
    """The float budget stops once the quantized activations' measured KLs sum to qdq_float_kl (default 0.004): this
    tiny model's sum is far below it, so the same budget that keeps some float at qdq_float_kl 0 keeps none, and
    the record says what the rest sums to."""
    m, spent = qdq_graphs["close-enough_metrics"], qdq_graphs["measured_metrics"]
    assert spent["qdq_float_activations"] and spent["qdq_float_kl"] == 0
    assert m["qdq_float_activations"] == [] and m["qdq_float_kl"] == 0.004
    assert m["qdq_estimated_kl"] == pytest.approx(sum(m["qdq_sensitivity"].values())) and m["qdq_estimated_kl"] <= 0.004
    assert len(m["float_matmuls"]) < len(spent["float_matmuls"])
