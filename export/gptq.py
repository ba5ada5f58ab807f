"""GPTQ rounding for 4-bit blocks: each weight is rounded knowing what the calibration inputs do with it.

Round-to-nearest rounds every weight alone. GPTQ (Frantar et al., 2022) rounds one input row of W [K, N] at a
time and spreads that row's rounding error over the rows not yet rounded, weighted by the inverse of the
inputs' second moment H = X^T X, so the MatMul's *output* on calibration text moves least. Blocks are
MatMulNBits' blocks (K rows of one column share a scale and a zero point); each block's range is taken
when GPTQ reaches it, from the weights as the earlier rows' errors left them. The same row sweep rounds on the
FP8 E4M3 grid (`gptq_fp8`, fp8-qdq).

H comes from export/hessians.py (the plain fp32 graph or the model block by block, on calibration chats and
training prose, never the held-out texts).
"""

from __future__ import annotations

import contextlib

import numpy as np

def _range(w, bits: int, search: int = 0, symmetric: bool = False):
    """Asymmetric levels of w [rows, N] per column, zero inside the range (as ONNX Runtime's min-max); with
    `search` > 0 the range is also shrunk in `search` steps down to 0.8x and the one with the least squared
    error kept (a clipped extreme weight costs less than coarse steps for all the others). `symmetric`: the
    zero point is MatMulNBits' implicit one (2^(bits-1)) and the range +-max|w|."""
    import torch

    maxq = 2**bits - 1
    if symmetric:  # levels 0..maxq around 2^(bits-1): (q - zp) covers -2^(bits-1)..2^(bits-1)-1
        amax = w.abs().max(dim=0).values
        hi0 = torch.where(amax == 0, torch.full_like(amax, 1e-8), amax) * (maxq / (maxq - 1))
        lo0 = -hi0
    else:
        lo0 = torch.clamp(w.min(dim=0).values, max=0)
        hi0 = torch.clamp(w.max(dim=0).values, min=0)
        hi0 = torch.where(hi0 == lo0, lo0 + 1e-8, hi0)
    best = scale = zp = None
    for i in range(search + 1):
        p = 1 - 0.2 * i / max(search, 1)
        lo, hi = lo0 * p, hi0 * p
        # a range of subnormals (largest |w| ~1e-44) underflows to a scale of 0, and 0/0 = NaN would spread
        # through every later row of the column: such weights round to 0 instead
        s = torch.clamp((hi - lo) / maxq, min=1e-30)
        z = torch.full_like(s, 2 ** (bits - 1)) if symmetric else torch.clamp(torch.round(-lo / s), 0, maxq)
        if not search:
            return s, z
        err = ((torch.clamp(torch.round(w / s) + z, 0, maxq) - z) * s - w).pow(2).sum(dim=0)
        if best is None:
            best, scale, zp = err, s, z
        else:
            better = err < best
            best = torch.where(better, err, best)
            scale, zp = torch.where(better, s, scale), torch.where(better, z, zp)
    return scale, zp


def _upper_inverse_cholesky(H, damp: float):
    """Upper Cholesky factor of H^-1 (float32). H (float64, damped) is X^T X plus damping, positive definite
    in exact arithmetic; where rounding (or a matrix that is no X^T X) makes the factorisation fail, the
    damping is raised tenfold, twice, before giving up with a message that says what failed."""
    import torch

    mean = float(torch.diagonal(H).mean())
    extra = 0.0
    for step in range(3):
        try:
            L = torch.linalg.cholesky(H if not extra else H + extra * mean * torch.eye(len(H), dtype=H.dtype))
            Hi = torch.cholesky_inverse(L)
            del L
            return torch.linalg.cholesky(Hi, upper=True).to(torch.float32)
        except torch.linalg.LinAlgError:
            extra = damp * (10 ** (step + 1) - 1)
    raise ValueError(f"GPTQ: the inputs' X^T X is not positive definite even with damping {damp * 100:g} x its mean "
                     "diagonal (is it X^T X of real inputs?); use int4_rounding = 'minmax'")


@contextlib.contextmanager
def _one_thread():
    """torch on one thread for the rounding of one MatMul: its ops are a row, a block's range search or a K x K
    factorisation, where thread hand-offs cost more than they give, and far more on a shared machine (a 576 x 1536
    MatMul: 6.8 s on 2 threads, 0.52 s on 1, at load 10 on 2 cores; the Cholesky alone 1.4 s, the range search 1.7 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ordered(w: np.ndarray, h: np.ndarray, damp: float, act_order: bool):
    """GPTQ's inputs in the order its rows are rounded: (W [K, N] float32, the upper Cholesky factor of the damped
    H^-1, that order). `act_order`: rows with the largest inputs first (their error then spreads over the rest)."""
    import torch

    k = w.shape[0]
    W = torch.from_numpy(np.ascontiguousarray(w, np.float32)).clone()
    H = torch.from_numpy(np.array(h, np.float64))
    # rows whose input was 0 on every calibration token: H's row and column are 0, so with a unit diagonal they
    # are decoupled from the rest (no error reaches them, theirs reaches nobody) and are rounded to nearest.
    # (Reference GPTQ zeroes them instead, deleting weights that only the calibration text never used.)
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    torch.diagonal(H).add_(damp * torch.diagonal(H).mean())  # in place: no K x K identity beside H
    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else torch.arange(k)
    if act_order:
        W, H = W[perm], H[perm[:, None], perm]  # one gather: H and its permuted copy, not a third
    return W, _upper_inverse_cholesky(H, damp), perm


def _propagate(W, Hinv, lazy: int, round_row) -> None:
    """GPTQ's sweep over the rows of W [K, N] (in the order they are rounded; Hinv: the upper Cholesky factor of
    H^-1 in that order): each row rounded by `round_row(r, row, rest)` (which returns the row as rounded), its
    error spread over the rows after it, `lazy` rows per batch (the later rows updated once per batch)."""
    import torch

    k = W.shape[0]
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        W1 = W[i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hi = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = W1[i]
            err = (row - round_row(i1 + i, row, W1[i:])) / Hi[i, i]
            W1[i:] -= Hi[i, i:, None] * err[None, :]
            E1[i] = err
        W[i2:] -= Hinv[i1:i2, i2:].T @ E1


def gptq_fp8(w: np.ndarray, h: np.ndarray, scale: np.ndarray, damp: float = 0.03,
             act_order: bool = True) -> np.ndarray:
    """w [K, N] fp32 on FP8 E4M3 levels per output channel (`scale` [N], the graph's: w ~ level x scale), GPTQ-
    rounded on the inputs' X^T X `h` [K, K]: levels [K, N] as ml_dtypes.float8_e4m3fn. E4M3's steps are relative
    (3 mantissa bits), so each weight's rounding error is up to 1/16 of it, and GPTQ spreads it as for INT8."""
    import ml_dtypes
    import torch

    k, n = w.shape
    if h.shape != (k, k) or scale.shape != (n,):
        raise ValueError(f"GPTQ: a weight of {w.shape} needs X^T X of ({k}, {k}) and {n} scales, got {h.shape} and {scale.shape}")
    if not (np.isfinite(w).all() and np.isfinite(h).all()):
        raise ValueError("GPTQ: the weight or the inputs' X^T X has NaN or inf entries")
    with _one_thread():
        W, Hinv, perm = _ordered(w, h, damp, act_order)
        s = torch.from_numpy(np.ascontiguousarray(scale, np.float32))
        Q = torch.zeros(k, n, dtype=torch.float8_e4m3fn)

        def round_row(r: int, row, rest):
            q = torch.clamp(row / s, -448.0, 448.0).to(torch.float8_e4m3fn)  # round to nearest even, as QuantizeLinear
            Q[int(perm[r])] = q
            return q.to(torch.float32) * s

        _propagate(W, Hinv, 128, round_row)
        return Q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def gptq_block_quant(w: np.ndarray, h: np.ndarray, bits: int, block: int, damp: float = 0.003,
                     lazy: int = 128, act_order: bool = True, search: int = 20,
                     symmetric: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] fp32, h [K, K] -> (q [N, k_blocks, block] uint8, scales [N, k_blocks] fp32, zero points
    [N, k_blocks] uint8): `_gptq_block_quant` on one torch thread (`_one_thread`)."""
    with _one_thread():
        return _gptq_block_quant(w, h, bits, block, damp, lazy, act_order, search, symmetric)


def _gptq_block_quant(w: np.ndarray, h: np.ndarray, bits: int, block: int, damp: float = 0.003,
                      lazy: int = 128, act_order: bool = True, search: int = 20,
                      symmetric: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] fp32, h [K, K] -> (q [N, k_blocks, block] uint8, scales [N, k_blocks] fp32, zero points
    [N, k_blocks] uint8), the layout of export.int4.block_quant: w ≈ (q - zp) * scale per block.

    `act_order`: rows with the largest inputs are rounded first (their error then spreads over the rest),
    each block's range fixed up front from the original weights; `search`: steps of the range search.
    Both on by default: SmolLM2-135M, all MatMuls 4-bit in blocks of 64, KL to fp32 on held-out prose:
    plain GPTQ 0.224, + act_order 0.141, + search 0.131 (min-max 0.328; docs/quality.md). `damp` (of the
    mean diagonal, added to H): 0.003 beat 0.01 and 0.05 with 96 and 192 calibration texts (tuned on
    training prose no calibration set reaches), lost to 0.01 with 32. `symmetric`: every zero point is
    2^(bits-1), the one MatMulNBits assumes when a graph gives none (the caller then leaves them out)."""
    import torch

    if w.ndim != 2:
        raise ValueError(f"GPTQ: the weight must be [K, N], got shape {w.shape}")
    k, n = w.shape
    if h.shape != (k, k):
        raise ValueError(f"GPTQ: the Hessian is {h.shape} for a weight of {k} input rows")
    if not 1 <= bits <= 8 or block < 1:
        raise ValueError(f"GPTQ: bits must be 1..8 (uint8 levels) and block >= 1, got {bits} and {block}")
    if not np.isfinite(w).all():
        raise ValueError(f"GPTQ: the weight [{k}, {n}] has NaN or inf entries")
    if not np.isfinite(h).all():
        raise ValueError("GPTQ: the inputs' X^T X has NaN or inf entries (the fp32 graph overflowed on the calibration text)")
    maxq = 2**bits - 1
    kb = -(-k // block)
    lazy = block * max(1, lazy // block)  # a block never straddles two lazy batches
    if act_order:  # blocks' ranges fixed up front from the original weights (their rows are not contiguous in GPTQ's order)
        w32 = torch.from_numpy(np.ascontiguousarray(w, np.float32))
        fixed = [_range(w32[b:b + block], bits, search, symmetric) for b in range(0, k, block)]
    W, Hinv, perm = _ordered(w, h, damp, act_order)
    Q = torch.zeros(k, n, dtype=torch.uint8)
    scales = torch.zeros(kb, n)
    zps = torch.zeros(kb, n)
    state: dict = {}

    def round_row(r: int, row, rest):
        """Row r's levels into Q; returns what they dequantize to. `rest`: this lazy batch's rows from r on."""
        if act_order:
            state["s"] = fixed[int(perm[r]) // block]
        elif r % block == 0:  # this block's range, from the rows as the earlier errors left them
            state["s"] = _range(rest[:block], bits, search, symmetric)
        scale, zp = state["s"]
        if act_order or r % block == 0:
            scales[int(perm[r]) // block], zps[int(perm[r]) // block] = scale, zp
        q = torch.clamp(torch.round(row / scale) + zp, 0, maxq)
        Q[int(perm[r])] = q.to(torch.uint8)
        return (q - zp) * scale

    _propagate(W, Hinv, lazy, round_row)
    q = torch.full((n, kb * block), 0, dtype=torch.uint8)
    q[:, :k] = Q.T
    zp_t = zps.T.to(torch.uint8)
    if kb * block > k:  # padded rows: the zero point's level, so they dequantize to exactly 0
        q[:, k:] = zp_t[:, -1:].expand(n, kb * block - k)
    return (q.reshape(n, kb, block).numpy(), scales.T.contiguous().numpy().astype(np.float32), zp_t.contiguous().numpy())
