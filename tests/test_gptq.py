"""export/gptq.py on tiny arrays and export/hessians.py on a hand-made graph: GPTQ against a textbook
implementation, its edge cases (padding, dead inputs, bad inputs) and the Hessians' passes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_matmulnbits
from export.gptq import _range, gptq_block_quant
from export.hessians import Hessians
from export.int4 import block_quant, dequantize


def _reference(w: np.ndarray, h: np.ndarray, bits: int, block: int, act_order: bool, damp: float = 0.003,
               search: int = 20) -> np.ndarray:
    """GPTQ as the paper's code writes it (W [out, in], one input column at a time, no lazy batches), static
    groups under act-order; returns the dequantized [K, N]."""
    import torch

    W = torch.tensor(w.T.copy(), dtype=torch.float64)
    H = torch.tensor(h.copy(), dtype=torch.float64)
    k, maxq = W.shape[1], 2**bits - 1
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=torch.float64)
    groups = [_range(W[:, b:b + block].T.float(), bits, search) for b in range(0, k, block)]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    D = torch.zeros_like(W)
    for i in range(k):
        if act_order:
            s, z = groups[int(perm[i]) // block]
        elif i % block == 0:
            s, z = _range(W[:, i:i + block].T.float(), bits, search)
        s, z = s.double(), z.double()
        q = torch.clamp(torch.round(W[:, i] / s) + z, 0, maxq)
        D[:, i] = (q - z) * s
        err = (W[:, i] - D[:, i]) / U[i, i]
        W[:, i:] -= err[:, None] * U[i, i:][None, :]
    out = torch.zeros_like(D)
    out[:, perm] = D
    return out.T.numpy()


def _inputs(rng, k: int, rows: int = 600) -> tuple[np.ndarray, np.ndarray]:
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 3, k)).astype(np.float32)
    x[:, : k // 3] += x[:, k // 3: 2 * (k // 3)]  # correlated channels: something for GPTQ to exploit
    return x, x.astype(np.float64).T @ x / rows


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("k,n,block", [(200, 17, 32), (96, 1, 64), (40, 5, 64), (300, 8, 128)])
def test_gptq_matches_the_textbook_algorithm(k, n, block, act_order):
    """Lazy batches, the transposed orientation and act-order's bookkeeping change nothing: K not a multiple
    of the block, a block larger than K and N = 1 included. Padded rows store the zero point (dequantize to 0)."""
    rng = np.random.default_rng(k * n)
    x, h = _inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = gptq_block_quant(w, h, 4, block, act_order=act_order)
    kb = -(-k // block)
    assert q.shape == (n, kb, block) and s.shape == z.shape == (n, kb) and q.max() <= 15 and z.max() <= 15
    np.testing.assert_allclose(dequantize(q, s, z, k), _reference(w, h, 4, block, act_order), atol=1e-5)
    flat = q.reshape(n, kb * block)
    assert (flat[:, k:] == z[:, -1:]).all()
    assert np.linalg.norm(x @ (dequantize(q, s, z, k) - w)) < np.linalg.norm(x @ (dequantize(*block_quant(w, 4, block, "minmax"), k=k) - w))


def test_padded_rows_are_zero_in_matmulnbits():
    k, n, block = 40, 6, 64
    rng = np.random.default_rng(3)
    x, h = _inputs(rng, k)
    w = (rng.standard_normal((k, n)) + 2.0).astype(np.float32)  # all positive: zero sits at the range's edge
    q, s, z = gptq_block_quant(w, h, 4, block)
    y = run_matmulnbits(x[:4], q, s, z, k, block)
    np.testing.assert_allclose(y, x[:4] @ dequantize(q, s, z, k), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("act_order", [False, True])
def test_inputs_never_seen_keep_their_weights(act_order):
    """A row whose input was 0 on all calibration tokens is rounded to nearest, not deleted; with no input
    seen at all the result is plain min-max rounding (ONNX Runtime's levels)."""
    rng = np.random.default_rng(5)
    k, n, block = 64, 12, 32
    x, h = _inputs(rng, k)
    h[[3, 40], :] = 0
    h[:, [3, 40]] = 0
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = gptq_block_quant(w, h, 4, block, act_order=act_order, search=0)
    d = dequantize(q, s, z, k)
    for r in (3, 40):
        assert (np.abs(d[r] - w[r]) <= s[:, r // block] / 2 + 1e-6).all()
    q, s, z = gptq_block_quant(w, np.zeros((k, k)), 4, block, act_order=act_order, search=0)
    np.testing.assert_allclose(dequantize(q, s, z, k), dequantize(*block_quant(w, 4, block, "minmax"), k=k), atol=1e-5)


def test_flat_and_zero_blocks():
    k, n = 64, 4
    _, h = _inputs(np.random.default_rng(7), k)
    w = np.zeros((k, n), np.float32)
    w[:, 1] = 0.25  # flat positive column
    w[:, 2] = -3.0  # flat negative column
    w[:32, 3] = 1e-30  # tiny
    q, s, z = gptq_block_quant(w, h, 4, 32)
    d = dequantize(q, s, z, k)
    assert np.isfinite(s).all() and (s > 0).all()
    np.testing.assert_allclose(d[:, :3], w[:, :3], atol=1e-6)
    assert np.abs(d[:, 3]).max() <= 1e-29


@pytest.mark.parametrize("act_order", [False, True])
def test_a_block_of_subnormal_weights_does_not_spread_nan(act_order):
    """Largest |w| of a block 1e-44: its scale underflowed to 0 and 0/0 = NaN ran down the rest of the column."""
    k, n = 64, 3
    rng = np.random.default_rng(13)
    _, h = _inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:32, 1] = 0
    w[5, 1] = -1e-44
    q, s, z = gptq_block_quant(w, h, 4, 32, act_order=act_order)
    d = dequantize(q, s, z, k)
    assert np.isfinite(s).all() and (s > 0).all() and np.isfinite(d).all()
    assert np.abs(d[:32, 1]).max() < 1e-27 and np.abs(d[32:, 1] - w[32:, 1]).max() < 0.5


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_other_bit_widths(bits):
    k, n = 64, 8
    rng = np.random.default_rng(bits)
    _, h = _inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = gptq_block_quant(w, h, bits, 32)
    assert q.max() <= 2**bits - 1 and z.max() <= 2**bits - 1
    np.testing.assert_allclose(dequantize(q, s, z, k), _reference(w, h, bits, 32, True), atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_blocks_are_what_matmulnbits_reads_without_zero_points(bits):
    """Symmetric GPTQ (int8-dynamic's layout, and the 8-bit MatMuls of an int4 engine) stores no zero points: each
    block's is MatMulNBits' implicit 2^(bits-1); its output still moves less than symmetric round-to-nearest."""
    k, n, block = 96, 7, 32
    rng = np.random.default_rng(bits + 40)
    x, h = _inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[5, 2] = 9.0  # an outlier: its block's range is set by it
    q, s, z = gptq_block_quant(w, h, bits, block, symmetric=True)
    assert (z == 2 ** (bits - 1)).all() and q.max() <= 2**bits - 1
    deq = dequantize(q, s, z, k)
    np.testing.assert_allclose(run_matmulnbits(x[:4], q, s, None, k, block, bits), x[:4] @ deq, rtol=1e-4, atol=1e-3)
    half = 2 ** (bits - 1) - 1
    amax = np.abs(w.reshape(k // block, block, n)).max(axis=1, keepdims=True)
    rtn = (np.clip(np.round(w.reshape(k // block, block, n) / (amax / half)), -half - 1, half) * (amax / half)).reshape(k, n)
    assert np.abs(deq[5, 2] - 9.0) <= 9.0 / half  # the outlier stays in range (the search may shrink it a little)
    assert np.linalg.norm(x @ (deq - w)) < 0.8 * np.linalg.norm(x @ (rtn - w))


def test_bad_inputs_are_refused_with_a_message():
    k, n = 32, 4
    rng = np.random.default_rng(9)
    _, h = _inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    for bad, what in ((np.nan, "weight"), (np.inf, "weight")):
        w2 = w.copy()
        w2[5, 1] = bad
        with pytest.raises(ValueError, match="NaN or inf"):  # not NaN scales written into the engine
            gptq_block_quant(w2, h, 4, 32)
    h2 = h.copy()
    h2[2, :] = np.inf
    with pytest.raises(ValueError, match="X\\^T X has NaN or inf"):
        gptq_block_quant(w, h2, 4, 32)
    h3 = h.copy()
    h3[0, 0] = -1.0  # no X^T X
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_block_quant(w, h3, 4, 32)
    with pytest.raises(ValueError, match="bits must be"):
        gptq_block_quant(w, h, 9, 32)
    with pytest.raises(ValueError, match="Hessian is"):
        gptq_block_quant(w, h[:8, :8], 4, 32)


def test_barely_indefinite_statistics_get_more_damping():
    """A slightly indefinite matrix (rounding, a sum of fp32 parts) gets more damping instead of failing."""
    k, n = 48, 4
    rng = np.random.default_rng(11)
    v = rng.standard_normal(k)
    h = np.outer(v, v) - 0.01 * np.eye(k) * (v @ v) / k  # one small negative eigenvalue per axis: damping 0.003 is not enough
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = gptq_block_quant(w, h, 4, 32)
    assert np.isfinite(dequantize(q, s, z, k)).all()


# ---------------------------------------------------------------------------------------------- Hessians
K = 16


def _graph(path, rng):
    """x (a graph input) -> mm0 -> Relu -> h -> mm1, mm2 (one input, two MatMuls) -> Add -> s (already a
    graph output) -> mm3 -> logits."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    ws = {f"W{i}": rng.standard_normal((K, K)).astype(np.float32) for i in range(4)}
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["a"], name="mm0"), helper.make_node("Relu", ["a"], ["h"]),
             helper.make_node("MatMul", ["h", "W1"], ["y1"], name="mm1"),
             helper.make_node("MatMul", ["h", "W2"], ["y2"], name="mm2"), helper.make_node("Add", ["y1", "y2"], ["s"]),
             helper.make_node("MatMul", ["s", "W3"], ["logits"], name="mm3")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TP.INT64, ["b", "t"]),
                                       helper.make_tensor_value_info("x", TP.FLOAT, ["b", "t", K])],
                          [helper.make_tensor_value_info("logits", TP.FLOAT, None),
                           helper.make_tensor_value_info("s", TP.FLOAT, None)],
                          [numpy_helper.from_array(v, n) for n, v in ws.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return ws


def _feeds(rng, lengths=(5, 9, 3)):
    return [{"input_ids": np.zeros((1, t), np.int64), "x": rng.standard_normal((1, t, K)).astype(np.float32)}
            for t in lengths]


def test_hessians_are_xtx_of_each_matmul_input_in_any_number_of_passes(tmp_path):
    rng = np.random.default_rng(0)
    ws = _graph(tmp_path / "plain.onnx", rng)
    feeds = _feeds(rng)
    x = np.concatenate([f["x"][0] for f in feeds]).astype(np.float64)
    hid = np.maximum(x @ ws["W0"], 0)
    s = hid @ ws["W1"] + hid @ ws["W2"]
    want = {"mm0": x, "mm1": hid, "mm2": hid, "mm3": s}
    work = tmp_path / "work"
    work.mkdir()
    for max_bytes, passes in ((2 << 30, 2), (K * K * 8, 3)):
        with Hessians(tmp_path / "plain.onnx", work, feeds, max_bytes=max_bytes) as hs:
            for name in ("mm3", "mm0", "mm1", "mm2"):  # out of graph order: mm3's pass starts at its input
                ref = want[name].T @ want[name] / len(want[name])
                np.testing.assert_allclose(hs(name), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())  # fp32 per text
            assert hs.passes == passes
            assert hs(name) is hs("mm1")  # the shared input: one matrix
        assert not list(work.iterdir())


def test_hessians_leave_nothing_behind_when_they_fail(tmp_path, monkeypatch):
    import export.hessians

    rng = np.random.default_rng(1)
    _graph(tmp_path / "plain.onnx", rng)
    work = tmp_path / "work"
    work.mkdir()

    def boom(*a, **k):  # after the graph copy is written
        raise OSError("disk full")

    monkeypatch.setattr(export.hessians, "weight_matmuls", boom)
    with pytest.raises(OSError, match="disk full"):
        Hessians(tmp_path / "plain.onnx", work, _feeds(rng))
    assert not list(work.iterdir())


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_hessians_name_the_matmul_whose_input_is_not_finite(tmp_path):
    rng = np.random.default_rng(2)
    _graph(tmp_path / "plain.onnx", rng)
    feeds = _feeds(rng)
    feeds[1]["x"][0, 2, 3] = np.inf
    with Hessians(tmp_path / "plain.onnx", tmp_path, feeds) as hs:
        with pytest.raises(ValueError, match="input to mm0 .* not finite"):
            hs("mm0")
    with pytest.raises(ValueError, match="no tokens"):
        Hessians(tmp_path / "plain.onnx", tmp_path, [])


def _fp8(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


@pytest.mark.parametrize("k,n", [(200, 17), (96, 1), (300, 8)])
def test_gptq_on_the_fp8_grid_is_the_textbook_algorithm_and_beats_nearest(k, n):
    """fp8-qdq's weights (export/trt_formats.py): GPTQ with E4M3 levels per output channel, the scale fixed
    (max |w| / 448, as the graph stores it), matches the paper's one-column-at-a-time form on that grid, and
    moves the MatMul's output on the calibration inputs less than rounding each weight to nearest."""
    import ml_dtypes
    import torch

    from export.gptq import gptq_fp8

    rng = np.random.default_rng(k + n)
    x, h = _inputs(rng, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    s = (np.abs(w).max(axis=0) / 448).astype(np.float32)
    q = gptq_fp8(w, h, s, damp=0.03)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (k, n)
    got = q.astype(np.float64) * s
    W, H = torch.tensor(w.T.copy(), dtype=torch.float64), torch.tensor(h.copy())
    H += 0.03 * torch.diag(H).mean() * torch.eye(k, dtype=torch.float64)
    perm = torch.argsort(torch.diag(H), descending=True)
    W, H = W[:, perm], H[perm][:, perm]
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    D = torch.zeros_like(W)
    for i in range(k):
        D[:, i] = torch.from_numpy(_fp8(W[:, i].numpy() / s) * s)
        W[:, i:] -= ((W[:, i] - D[:, i]) / U[i, i])[:, None] * U[i, i:][None, :]
    ref = torch.zeros_like(D)
    ref[:, perm] = D
    assert np.mean(np.isclose(got, ref.T.numpy(), rtol=1e-6, atol=1e-9)) > 0.99  # float32 vs 64: a rare level apart
    nearest = _fp8(w / s) * s
    assert np.linalg.norm(x @ (got - w)) < 0.95 * np.linalg.norm(x @ (nearest - w))
