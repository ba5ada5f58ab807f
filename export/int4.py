"""4-bit block weights in MatMulNBits' layout, with llama.cpp's k-quant rounding.

Round-to-nearest between a block's min and max (ONNX Runtime's default quantizer) spends the 16 levels on
the block's two extreme weights. llama.cpp's k-quants instead search the scale and offset that minimise the
(magnitude-weighted) squared error; ONNX Runtime ships that search as `quant_tensor_k_quant_cpu` (ported
from ggml-quants.c), used here as is. Its offset is rounded to a 4-bit zero point, as MatMulNBits stores it.
"""

from __future__ import annotations

import numpy as np

METHODS = ("minmax", "kquant")


def block_quant(w: np.ndarray, bits: int, block: int, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] fp32 -> (q [N, k_blocks, block] uint8 levels, scales [N, k_blocks] fp32, zero points [N, k_blocks] uint8),
    asymmetric: w ≈ (q - zp) * scale per block of `block` rows of one column."""
    if method not in METHODS:
        raise ValueError(f"unknown 4-bit rounding {method!r}: choose from {', '.join(METHODS)}")
    k, n = w.shape
    kb = -(-k // block)
    wt = np.zeros((n, kb * block), np.float32)
    wt[:, :k] = w.T
    if method == "kquant":
        from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

        q, scale, zp = quant_tensor_k_quant_cpu(wt, bits, block)
    else:
        from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor

        q, scale, zp = quant_tensor(wt, bits, block, "asym", "uint")
    return (q.reshape(n, kb, block).astype(np.uint8), scale.reshape(n, kb).astype(np.float32),
            zp.reshape(n, kb).astype(np.uint8))


def dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, k: int) -> np.ndarray:
    """The [K, N] weights MatMulNBits computes with."""
    n, kb, block = q.shape
    w = (q.astype(np.float32) - zp[:, :, None]) * scale[:, :, None]
    return np.ascontiguousarray(w.reshape(n, kb * block)[:, :k].T)


def fake_quant(w: np.ndarray, bits: int, block: int, method: str) -> np.ndarray:
    return dequantize(*block_quant(w, bits, block, method), k=w.shape[0])


def pack(q: np.ndarray, zp: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' B [N, k_blocks, block * bits / 8] and zero points [N, ceil(k_blocks * bits / 8)]
    (4 bits: two per byte, the even index in the low nibble; a row's odd last zero point padded with 8)."""
    if bits == 8:
        return q, zp
    b = q[:, :, 0::2] | (q[:, :, 1::2] << 4)
    n, kb = zp.shape
    z = np.full((n, kb + kb % 2), 8, np.uint8)
    z[:, :kb] = zp
    return b.astype(np.uint8), (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
