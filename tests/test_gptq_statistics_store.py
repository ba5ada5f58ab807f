"""GPTQ's statistics are collected once per build and shared by its engines (export/gptq_statistics.py)."""

import dataclasses

import numpy as np


def _quantize(bundle, opts, dst):
    from export import quantize

    work = bundle.root.with_name(bundle.root.name + ".work")
    dst.mkdir(parents=True)
    return quantize.run(work / "export" / "fused", work / "load", dst, opts)


def test_a_build_collects_gptq_statistics_once_and_a_new_calibration_again(tiny_bundle, tmp_path):
    """int8-dynamic collects the statistics and keeps them in the build's work folder; int4-weight loads them
    (no pass of its own) and rounds exactly as if it had collected them itself; a changed calibration setting
    is a new key: collected again, the old folder dropped."""
    from export.quantize import QuantizeOptions

    build = tmp_path / "out.work"
    o8 = QuantizeOptions(mode="int8-dynamic", gptq_samples=6, gptq_tokens=64)
    o4 = QuantizeOptions(mode="int4-weight", gptq_samples=6, gptq_tokens=64)
    m8 = _quantize(tiny_bundle, o8, build / "quantize-int8-dynamic")
    assert m8["gptq_passes"] == 1 and m8["gptq_statistics_computed"] > 0 and m8["gptq_statistics_loaded"] == 0
    [store] = build.glob("gptq-statistics-*")
    assert len(list(store.glob("*.npy"))) == m8["gptq_statistics_computed"]
    m4 = _quantize(tiny_bundle, o4, build / "quantize-int4-weight")
    assert m4["gptq_passes"] == 0 and m4["gptq_statistics_computed"] == 0 and m4["gptq_statistics_loaded"] > 0
    assert m4["gptq_statistics"] == m8["gptq_statistics"] and m4["gptq_tokens"] == m8["gptq_tokens"]

    alone = _quantize(tiny_bundle, o4, tmp_path / "alone.work" / "quantize-int4-weight")  # its own statistics
    assert alone["gptq_passes"] == 1
    for f in ("model.onnx", "model.onnx.data"):
        assert (build / "quantize-int4-weight" / f).read_bytes() == (tmp_path / "alone.work" / "quantize-int4-weight" / f).read_bytes()

    again = _quantize(tiny_bundle, dataclasses.replace(o4, gptq_samples=4), build / "quantize-int4-weight-2")
    assert again["gptq_passes"] == 1 and again["gptq_statistics_loaded"] == 0
    assert [p.name for p in build.glob("gptq-statistics-*")] != [store.name] and len(list(build.glob("gptq-statistics-*"))) == 1


def test_stored_statistics_are_the_collected_matrices(tiny_bundle, tmp_path):
    """What a later engine reads back is bit for bit what the first one collected, asked by any MatMul name."""
    from export.quantize import _gptq_statistics as gptq_statistics
    from export.load import model_dims
    from export.quantize import QuantizeOptions

    work = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work")
    opts = QuantizeOptions(mode="int4-weight", gptq_samples=4, gptq_tokens=32)
    dims = model_dims(work / "load")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain, by_plain = gptq_statistics(work / "export" / "fused", work / "load", tmp_path / "a", opts, dims, shared=False)
    first, by_first = gptq_statistics(work / "export" / "fused", work / "load", tmp_path / "a", opts, dims)
    later, by_later = gptq_statistics(work / "export" / "fused", work / "load", tmp_path / "b", opts, dims)
    try:
        for n in plain.input_of:
            want = by_plain(n).copy()
            np.testing.assert_array_equal(by_first(n), want)
        for n in plain.input_of:
            np.testing.assert_array_equal(by_later(n), by_plain(n))
        assert later.passes == 0 and later.loaded_from_disk > 0 and first.passes == 1
    finally:
        for h in (plain, first, later):
            h.close()
