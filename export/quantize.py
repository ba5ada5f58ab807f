"""Quantize stage: fp32 ONNX decoder -> int8-dynamic | int8-qdq | int4-weight (here), int4-qdq | fp8-qdq
(TensorRT's formats on the fp16 graph: export/trt_formats.py).

- int8-dynamic (ONNX Runtime CPU/CUDA): INT8 weights, dynamic activations.
- int8-qdq (TensorRT, W8A8): SmoothQuant folded into the RMSNorm weights, then
  symmetric Q/DQ (zero point 0; weights per output channel, activations per
  tensor) placed only on the weight MatMuls, calibrated on chat prefill steps.
  Masks, softmax and RoPE are never quantized (a whole-graph quantize_static
  gives infinite scales on the attention-mask nodes). export/int8_qdq.py: its
  ranges come from the model one block at a time; each activation's alpha and
  range, GPTQ-rounded weights and the float budget by measurement
  (export/int8_search.py).
- GPTQ rounding (int8-dynamic, int4-weight) reads statistics collected once per
  build and shared by its engines (export/gptq_statistics.py).
- int4-weight: MatMulNBits 4-bit, blocks of int4_block_size (32 by default), asymmetric (per-block zero points), the LM head at
  8 bits, and mixed precision by measured sensitivity (export/sensitivity.py): the weight MatMuls
  whose 4-bit form moves KL to fp32 most, per extra byte, are kept at 8 bits within a byte budget
  (`int4_budget_mb`, else `int4_extra_ratio` of the all-4-bit size), as llama.cpp's k-quants spend
  more bits on attn_v / ffn_down, but chosen by measurement. The fused graph's packed q/k/v and
  gate/up MatMuls are measured and promoted per projection (k and v are small and the most
  sensitive): a packed MatMul promoted in part is split by columns (`promote`). docs/quality.md has
  the figures.
In every mode the tied embedding / LM head is stored as INT8 (a per-row
quantized Gather and an INT8 LM-head MatMul) rather than read as fp32.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edge import precisions
from edge.errors import RecipeError
from edge.precisions import FP8, INT4_QDQ, INT4_WEIGHT, INT8_DYNAMIC, INT8_QDQ
from export.embedding import quantize_embedding
from export.nbits import nbits_footprint, quantize_matmuls as _nbits, split_columns
from export.onnx_weights import GraphWeights, graph_bytes, lm_head_matmul, untie_lm_head, weight_matmuls

log = logging.getLogger("edgechat")
MODES = precisions.QUANTIZED
ROUNDINGS = ("gptq", "minmax", "kquant")  # int4-weight
INT8_ROUNDINGS = ("gptq", "minmax")  # int8-dynamic (symmetric: no k-quant search)
ABLATION = "no-smoothquant"  # sub-folder of the int8-qdq stage: same graph without SmoothQuant (report only)


def is_number(v) -> bool:
    """A recipe's number: an int or a float, not a string and not TOML's true (which Python counts as 1)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_qdq_budget(ratio, enough) -> None:
    """int8-qdq's and fp8-qdq's float budget (qdq_float_ratio, qdq_float_kl), refused in one line by the recipe and by
    the stage's own options alike."""
    if not (is_number(ratio) and 0 <= ratio < 1):
        raise RecipeError(f"qdq_float_ratio must be a number in [0, 1) (the share of int8-qdq's and fp8-qdq's 8-bit "
                          f"weight bytes that may stay fp16; 0 turns that pass off), got {ratio!r}")
    if not (is_number(enough) and math.isfinite(enough) and enough >= 0):
        raise RecipeError(f"qdq_float_kl must be a number >= 0 (the KL to fp32 at which int8-qdq's and fp8-qdq's float "
                          f"budget stops spending; 0 spends all of qdq_float_ratio), got {enough!r}")


def check_int4_budget(budget_mb, extra_ratio) -> None:
    """The int4 byte budget's two settings, refused in one line before anything is built (a recipe's nan or a string
    would otherwise reach the quantize stage, after the load and export stages)."""
    if budget_mb is not None and not (is_number(budget_mb) and math.isfinite(budget_mb) and budget_mb > 0):
        raise RecipeError(f"int4_budget_mb (--int4-budget-mb) must be a positive number of MB, got {budget_mb!r}")
    if not (is_number(extra_ratio) and math.isfinite(extra_ratio) and extra_ratio >= 0):
        raise RecipeError(f"int4_extra_ratio (--int4-extra-ratio) must be a number >= 0 (the share of the all-4-bit "
                          f"engine's bytes spent on 8-bit projections), got {extra_ratio!r}")


@dataclass(frozen=True)
class QuantizeOptions:
    mode: str
    calibration: str | None = None  # user JSONL; default chitchat-dataset calibration split
    samples: int = 64
    smoothquant_alpha: float = 0.5  # 0 disables SmoothQuant
    # int8-qdq: each smoothed activation's alpha chosen by measurement (export/int8_search.py: the least output
    # error of its quantized MatMuls on calibration rows, "not smoothed" a candidate); False: smoothquant_alpha
    qdq_alpha_search: bool = True
    # int8-qdq and fp8-qdq: each activation's range: "max" (max |x| over the calibration tokens, TensorRT's max
    # calibration) or "mse" (max |x| times the clip factor whose quantized output error is least)
    qdq_range: str = "mse"
    # nbits = MatMulNBits 8-bit, block 32 (per-block scales): measured on SmolLM2-135M, 2-core EPYC:
    # +0.5% perplexity, 97% top-1 agreement, 74 tok/s. matmulinteger (per-tensor dynamic uint8
    # activations) was +29% perplexity, 56% agreement, 73 tok/s: activation outliers ruin it.
    int8_kernel: str = "nbits"
    # MatMulNBits compute: 4 = INT8 activations per block (fastest on VNNI), 1 = fp32 activations
    accuracy_level: int = 4
    # ...and these MatMuls get 8-bit blocks of 16 instead of 32 (finer weight and activation scales). Default:
    # the down_proj of the first and last block, the most sensitive ones (llama.cpp's k-quants spend more bits on
    # ffn_down too). SmolLM2-135M, 64 held-out chats, 2-core EPYC: all block 32 +2.08% perplexity (KL 0.0062);
    # these two at block 16 +1.42% (KL 0.0061) at the same speed (~160 tok/s). They used to keep fp32
    # activations (accuracy level 1: +0.63%, KL 0.0062) but that kernel is ~25% of a decode step and its
    # results change with the batch size (batched answers then differ from single-user ones).
    # "{last}" = the last block's index.
    block16_nodes: tuple[str, ...] = ("layers.0/mlp/down_proj/", "layers.{last}/mlp/down_proj/")
    max_calibration_tokens: int = 256
    # int8-qdq: leave the LM head unquantized (TensorRT runs it in FP16). Measured on SmolLM2-135M
    # (alpha 0.8, 12 held-out chats): +2.6% perplexity kept float vs +6.6% quantized.
    keep_lm_head_float: bool = True
    # int8-qdq: also write the same graph without SmoothQuant, so the report can show what it buys (SmolLM2: KL 0.17
    # against 0.0087, docs/quality.md). Off by default: a second int8-qdq graph and its scoring in every build
    smoothquant_ablation: bool = False
    # int8-qdq and fp8-qdq: weight MatMuls left in float (TensorRT runs them in FP16), by name pattern as block16_nodes.
    # Default: the same two down_proj. SmolLM2-135M, alpha 0.8, 64 held-out chats: +3.82% -> +1.90% perplexity,
    # KL 0.123 -> 0.097, top-1 81.0% -> 83.3%, for 2 of 211 weight MatMuls (~3.5 MB at FP16) unquantized.
    qdq_float_nodes: tuple[str, ...] = ("layers.0/mlp/down_proj/", "layers.{last}/mlp/down_proj/")
    # int8-qdq and fp8-qdq: beyond those, the activations whose 8-bit form (its Q/DQ and its MatMuls' 8-bit weights) moves KL to
    # fp32 most per byte, measured one at a time (export/int8_search.py), stay float while their fp16 weights add at
    # most this share of the 8-bit weights' bytes to the TensorRT engine (as the int4 budget, export/sensitivity.py).
    # SmolLM2-135M int8-qdq (32 calibration chats, held-out prose, docs/quality.md): 0.1 kept 12 down_proj float,
    # +6.4% perplexity, KL 0.071; 0.2 kept 24 (every pick a down_proj input), +1.4%, KL 0.022, 315 MB against 257 MB;
    # fp8-qdq at 0.2 kept 31 (mostly q/k/v inputs), KL 0.0330 -> 0.0128 on prose with GPTQ (docs/quality.md)
    qdq_float_ratio: float = 0.2
    # ...and no more float than it takes to bring the quantized activations' measured KLs (summed) to this: a model
    # whose 8-bit form is already that close stays 8-bit. SmolLM2-135M needs its whole budget (the sums at 0.2: 0.0115
    # int8-qdq, 0.0151 fp8-qdq, against held-out chats' 0.0102 and 0.0150; docs/quality.md "fp8-qdq's float budget")
    qdq_float_kl: float = 0.004
    int4_symmetric: bool = False  # int4-weight: False = per-block zero points (asymmetric), see the module docstring
    int4_lm_head_bits: int = 8  # int4-weight: the LM head (and the tied embedding that shares it) at 8 bits
    # ...in symmetric blocks of this many weights (of 32, 16 where the hidden width is no multiple of it: the tied
    # embedding gathers unpadded rows from the head's table). SmolLM2-135M at Q4_K_M's size, held-out KL chats /
    # prose: blocks of 64 0.0559 / 0.0602 (33 MatMuls promoted) against 32's 0.0570 / 0.0639 (30), docs/quality.md
    int4_lm_head_block: int = precisions.INT4_HEAD_BLOCK
    # int4-weight: 4-bit blocks of this many weights. Larger blocks store fewer fp32 scales and zero points
    # (bytes per weight 0.641 at 32, 0.570 at 64, 0.535 at 128): what `edge-export plan` picks to fit a device
    int4_block_size: int = 32
    # int4-weight rounding: "gptq" (each weight rounded knowing the calibration inputs, export/gptq.py; SmolLM2-135M,
    # all 4-bit blocks of 64, held-out prose: KL 0.131 against min-max's 0.328, docs/quality.md), "minmax" (ONNX
    # Runtime's round-to-nearest) or "kquant" (llama.cpp's scale search, export/int4.py)
    int4_rounding: str = "gptq"
    # texts (half calibration chats, half training prose) GPTQ's input statistics come from: all 4-bit, KL on
    # training prose no calibration reaches: 32 texts 0.172, 96 0.156, 192 0.163 (at damp 0.01)
    gptq_samples: int = 96
    # tokens per text: 512, the length the evaluation scores prose in (at 256 the later positions' inputs are never
    # seen). SmolLM2-135M int4 at Q4_K_M's size, KL chats / prose on `edge-export eval`'s sets: 0.0532 / 0.0568
    # against 256's 0.0558 / 0.0588 (docs/quality.md)
    gptq_tokens: int = 512
    # ...of which this share are calibration chats, the rest training prose. 0.25 traded chats for prose on the
    # 12-chat / 2048-token eval set (0.0631 / 0.0557 against 0.0559 / 0.0602) and lost on both on the next texts
    gptq_chat_share: float = 0.5
    # the domains GPTQ's texts come from (export/calibration_texts.py: chat, news, literature, code, docs); chat takes
    # gptq_chat_share of them, the others split the rest evenly
    gptq_domains: tuple[str, ...] = ("chat", "news")
    # GPTQ's damping (of the mean diagonal of X^T X) for the 4-bit weights of both int4 engines (int4-weight and
    # int4-qdq): more damping trusts the calibration text less. 0.03 since 2026-12-07: on SmolLM2's int4-qdq at 96
    # texts it beat 0.003 on chats, news prose and text unlike the calibration's (docs/quality.md, "One projection
    # at a time"); BuildOptions' default is the same
    int4_gptq_damp: float = 0.03
    # ...and for int8-dynamic's 8-bit weights (and fp8-qdq's: 0.03 and 0.003 measured alike, docs/quality.md "fp8-qdq
    # with int8-qdq's measured choices"). 0.03 since 2026-12-07: at GPTQ's 0.003, 0.3% of SmolLM2's layer-0
    # down_proj levels flipped between two exports whose statistics agree to 1e-6, and the engine's chat perplexity
    # moved from +0.7% to +1.9% (that layer's massive activations); at 0.03 both exports land at KL 0.0042-0.0044
    # (docs/quality.md "GPTQ's damping for 8-bit weights")
    int8_gptq_damp: float = 0.03
    # int8-dynamic (MatMulNBits kernel), int8-qdq and fp8-qdq (GPTQ on the E4M3 grid): "gptq" (symmetric GPTQ, every 8-bit MatMul and the head;
    # SmolLM2-135M int8-dynamic, held-out KL to fp32 chats 0.0044 / prose 0.0036 against min-max's 0.0063 / 0.0047,
    # docs/quality.md; int8-qdq: on the smoothed inputs' statistics) or "minmax" (ONNX Runtime's round to nearest)
    int8_rounding: str = "gptq"
    int4_budget_mb: float | None = None  # int4-weight: the engine's size in MB (1e6) at most; None: int4_extra_ratio
    int4_extra_ratio: float = 0.0  # ...else this share of the all-4-bit size spent on 8-bit MatMuls
    # int4-weight: block size of the MatMuls the budget keeps at 8 bits; 0: the largest of 128, 64, 32 that
    # divides the MatMul's input width (no padding; fewer scales, so the budget keeps more MatMuls at 8 bits)
    int4_promoted_block: int = 0
    sensitivity_samples: int = 4  # texts (half calibration chats, half training prose) the sensitivity is measured on
    sensitivity_tokens: int = 128  # tokens per text

    def __post_init__(self) -> None:
        from export.planner import INT4_BLOCKS, check_int4_layout

        if self.int4_rounding not in ROUNDINGS:
            raise RecipeError(f"int4_rounding must be one of {', '.join(ROUNDINGS)}, got {self.int4_rounding!r}")
        if self.int8_rounding not in INT8_ROUNDINGS:
            raise RecipeError(f"int8_rounding must be 'gptq' or 'minmax', got {self.int8_rounding!r}")
        check_qdq_budget(self.qdq_float_ratio, self.qdq_float_kl)
        if self.qdq_range not in ("max", "mse"):
            raise RecipeError(f"qdq_range must be 'max' or 'mse', got {self.qdq_range!r}")
        if self.mode == INT4_WEIGHT and self.int4_rounding == "gptq" and self.int4_symmetric:
            raise RecipeError("int4_rounding 'gptq' writes asymmetric blocks (a zero point each): set int4_rounding = "
                              "'minmax' for symmetric int4")
        if self.mode == INT4_QDQ and self.int4_rounding == "kquant":
            raise RecipeError("int4-qdq's blocks are symmetric (TensorRT takes no zero points) and kquant's have an "
                              "offset: choose int4_rounding 'gptq' or 'minmax' (--int4-rounding)")
        if self.int4_lm_head_block not in INT4_BLOCKS:
            raise RecipeError(f"int4_lm_head_block must be one of {', '.join(map(str, INT4_BLOCKS))}, "
                              f"got {self.int4_lm_head_block!r}")
        if not 0 <= self.gptq_chat_share <= 1:
            raise RecipeError(f"gptq_chat_share must be in [0, 1], got {self.gptq_chat_share}")
        from export.calibration_texts import check_domains

        check_domains(tuple(self.gptq_domains))
        for name in ("int4_gptq_damp", "int8_gptq_damp"):
            if not is_number(getattr(self, name)) or not 0 < getattr(self, name) <= 1:
                raise RecipeError(f"{name} must be in (0, 1] (a share of X^T X's mean diagonal), got {getattr(self, name)}")
        if self.gptq_samples < 1 or self.gptq_tokens < 8:
            raise RecipeError(f"gptq_samples must be >= 1 and gptq_tokens >= 8, got {self.gptq_samples} and {self.gptq_tokens}")
        check_int4_budget(self.int4_budget_mb, self.int4_extra_ratio)
        check_int4_layout(self.int4_block_size, self.int4_lm_head_bits)
        if self.mode not in MODES:
            raise RecipeError(f"unknown quantization mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.int8_kernel not in ("matmulinteger", "nbits"):
            raise RecipeError(f"int8_kernel must be 'matmulinteger' or 'nbits', got {self.int8_kernel!r}")


# ----------------------------------------------------------------------------- modes


def matching_matmuls(model, patterns: tuple[str, ...], num_layers: int) -> list[str]:
    """Weight MatMuls whose name contains a pattern ("{last}" = the last block's index)."""
    pats = [p.replace("{last}", str(num_layers - 1)) for p in patterns]
    return [n.name for n in weight_matmuls(model) if any(p in n.name for p in pats)]


def _int8_dynamic(gw: GraphWeights, src: Path, dst: Path, opts: QuantizeOptions, num_layers: int,
                  hessian: Callable[[str], np.ndarray] | None = None) -> list[str]:
    if opts.int8_kernel == "nbits":
        special = {name: (8, 16) for name in matching_matmuls(gw.model, tuple(opts.block16_nodes), num_layers)}
        _nbits(gw, bits=8, accuracy_level=opts.accuracy_level, special=special, rounding=opts.int8_rounding,
               hessian=hessian, gptq_damp8=opts.int8_gptq_damp)
        return sorted(special)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    gw.save(src)  # the untied graph, for ONNX Runtime's quantizer to read from its path
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"], use_external_data_format=True,
                     extra_options={"MatMulConstBOnly": True})
    return []


def calibration_feeds(hf_dir: Path, opts: QuantizeOptions, num_layers: int, kv_heads: int, head_dim: int) -> list[dict]:
    """Prefill inputs for calibration chats, formatted with the model's chat template."""
    from export.data import load_chats
    from export.load import chat_tokenizer

    tok = chat_tokenizer(hf_dir)
    feeds = []
    for chat in load_chats(opts.calibration, "calibration", opts.samples):
        ids = tok.encode_chat(chat, add_generation_prompt=False)[: opts.max_calibration_tokens]
        n = len(ids)
        feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None]}
        for i in range(num_layers):
            for kv in ("key", "value"):
                feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, kv_heads, 0, head_dim), np.float32)
        feeds.append(feed)
    return feeds


def sensitivity_feeds(hf_dir: Path, opts: QuantizeOptions, dims, skip: int = 0, chats: int | None = None) -> list[dict]:
    """Plain-graph prefill inputs: `chats` calibration chats (default half) and training prose for the rest
    (never the held-out texts), after the first `skip` of each (the ones GPTQ fitted its rounding to, so the
    sensitivity is not measured on them; a calibration file too short for that is used from its start)."""
    from export.load import chat_tokenizer
    from export.prose import prose_texts

    n_chats = max(1, opts.sensitivity_samples // 2 if chats is None else min(chats, opts.sensitivity_samples))
    copts = QuantizeOptions(mode=opts.mode, calibration=opts.calibration, samples=skip + n_chats,
                            max_calibration_tokens=opts.sensitivity_tokens)
    feeds = calibration_feeds(hf_dir, copts, dims.num_layers, dims.num_kv_heads, dims.head_dim)
    feeds = feeds[skip:] if len(feeds) > skip else feeds[:n_chats]
    tok = chat_tokenizer(hf_dir)
    prose = prose_texts("train")
    prose = prose[skip:] if len(prose) > skip + opts.sensitivity_samples else prose
    for text in prose[: opts.sensitivity_samples - len(feeds)]:
        ids = tok.encode(text)[: opts.sensitivity_tokens]
        n = len(ids)
        feeds.append(feeds[0] | {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                                 "position_ids": np.arange(n, dtype=np.int64)[None]})
    return feeds


def gptq_chats(opts: QuantizeOptions) -> int:
    """How many of GPTQ's calibration texts are chats (with ("chat", "news"), the rest is training prose)."""
    from export.calibration_texts import shares

    return max(shares(tuple(opts.gptq_domains), opts.gptq_samples, opts.gptq_chat_share).get("chat", 0), 1)


def gptq_feeds(hf_dir: Path, opts: QuantizeOptions, dims) -> list[dict]:
    """GPTQ's calibration texts as plain-graph prefill inputs: `gptq_samples` texts of `gptq_tokens` from
    `gptq_domains` (export/calibration_texts.py). ("chat", "news") gives the texts it always gave: the first
    calibration chats and the first training-prose documents."""
    from export.calibration_texts import domain_texts, shares
    from export.load import chat_tokenizer

    counts = shares(tuple(opts.gptq_domains), opts.gptq_samples, opts.gptq_chat_share)
    base = QuantizeOptions(mode=opts.mode, calibration=opts.calibration, samples=max(counts.get("chat", 0), 1),
                           max_calibration_tokens=opts.gptq_tokens)
    chats = calibration_feeds(hf_dir, base, dims.num_layers, dims.num_kv_heads, dims.head_dim)
    feeds = chats[: counts.get("chat", 0)]
    tok = chat_tokenizer(hf_dir)
    for domain, n in counts.items():
        if domain == "chat" or not n:
            continue
        texts = domain_texts(domain, "train")
        if len(texts) < n:
            raise RecipeError(f"GPTQ: the {domain} domain has {len(texts)} training documents, {n} asked for: lower "
                              "gptq_samples or add domains")
        for text in texts[:n]:
            ids = tok.encode(text)[: opts.gptq_tokens]
            feeds.append(chats[0] | {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                                     "position_ids": np.arange(len(ids), dtype=np.int64)[None]})
    return feeds


def promoted_block(k: int, opts: QuantizeOptions) -> int:
    """The 8-bit block size of a MatMul with `k` input rows that the int4 budget promotes."""
    if opts.int4_promoted_block:
        return opts.int4_promoted_block
    return next((b for b in (128, 64) if k % b == 0), 32)


def lm_head_block(k: int, opts: QuantizeOptions) -> int:
    """The int4 engine's 8-bit LM head block size for a hidden width `k`: one that divides it (no padded rows)."""
    return next((b for b in (opts.int4_lm_head_block, 32, 16) if k % b == 0), 32)


def _weight_of(gw: GraphWeights, node_name: str) -> str:
    return next(n.input[1] for n in weight_matmuls(gw.model) if n.name == node_name)


def _plain_graph(fp32_dir: Path) -> tuple[Path, bool]:
    """The plain fp32 graph (weights per projection) beside the one being quantized, and whether that one is fused."""
    from export import onnx_export

    fused = fp32_dir.name == onnx_export.FUSED_DIR
    return (fp32_dir.parent if fused else fp32_dir) / "model.onnx", fused


def _gptq_statistics(fp32_dir: Path, hf_dir: Path, dst: Path, opts: QuantizeOptions, dims, shared: bool = True):
    """GPTQ's input statistics over the plain graph on GPTQ's texts (export/gptq_statistics.py: `shared`, kept in
    the build's work folder for its other engines), asked for by the quantized graph's MatMul names."""
    from export.gptq_statistics import gptq_statistics

    plain, fused = _plain_graph(fp32_dir)
    return gptq_statistics(plain, fused, hf_dir, dst, gptq_feeds(hf_dir, opts, dims), shared)


def _int4_mixed(gw: GraphWeights, fp32_dir: Path, hf_dir: Path, dst: Path, opts: QuantizeOptions, dims,
                special: dict[str, tuple[int, int]], hessian) -> dict:
    """Measure each weight MatMul's 4-bit sensitivity, then pick the ones kept at 8 bits within the budget."""
    from export import sensitivity
    from export.int4 import dequantize, fake_quant

    plain, fused = _plain_graph(fp32_dir)
    nodes = {n.name: gw.shape(n.input[1]) for n in weight_matmuls(gw.model)}
    # the budget's units: each MatMul of this graph, or each projection packed into one (q, k, v; gate, up)
    parts = {}
    if fused:
        pg = GraphWeights(plain)
        parts = sensitivity.packed_columns({n.name: pg.shape(n.input[1])[1] for n in weight_matmuls(pg.model)},
                                           {t: kn[1] for t, kn in nodes.items() if t not in special})
        del pg
    packed = {t for t, _, _ in parts.values()}
    units = {t: (t, 0, kn[1]) for t, kn in nodes.items() if t not in special and t not in packed} | parts
    sym = opts.int4_symmetric

    def extra(t: str, a: int, b: int) -> int:
        """Bytes `t`'s columns [a, b) add at 8 bits: alone, so a packed MatMul is split into up to three (an upper
        bound when several of its parts are chosen; the file is checked against the budget below)."""
        k, n = nodes[t]
        four = [(lo, hi) for lo, hi in ((0, a), (b, n)) if hi > lo]
        return (nbits_footprint(k, b - a, 8, promoted_block(k, opts), True) - nbits_footprint(k, n, 4, opts.int4_block_size, sym)
                + sum(nbits_footprint(k, hi - lo, 4, opts.int4_block_size, sym) for lo, hi in four))

    cost = {u: extra(*where) for u, where in units.items()}
    # the engine at all-4-bit (special MatMuls at their bits), written and measured: what a promotion adds
    # to it is its tensors' page-rounded bytes (an upper bound for parts of one packed MatMul), what the graph's
    # own records weigh is not worth predicting (the file is checked against the budget after writing)
    trial = dst / "all-4-bit"
    trial.mkdir(exist_ok=True)
    g = GraphWeights(fp32_dir / "model.onnx")
    untie_lm_head(g)
    # the rounding does not change a byte of the layout: round to nearest here, the chosen rounding below
    _nbits(g, bits=4, symmetric=sym, special=special, rounding="minmax", block_size=opts.int4_block_size)
    quantize_embedding(g)
    g.save(trial / "model.onnx")
    del g
    base = graph_bytes(trial / "model.onnx")
    shutil.rmtree(trial)
    budget = int(opts.int4_budget_mb * 1e6) if opts.int4_budget_mb is not None else int(base * (1 + opts.int4_extra_ratio))
    if budget < base:
        raise RecipeError(f"int4_budget_mb {budget / 1e6:.1f} is less than the all-4-bit engine ({base / 1e6:.1f} MB): "
                          "raise it, or leave it unset")
    gptq = opts.int4_rounding == "gptq"
    fitted = max(gptq_chats(opts), opts.gptq_samples - gptq_chats(opts)) if gptq else 0  # GPTQ's texts of each kind
    feeds = sensitivity_feeds(hf_dir, opts, dims, skip=fitted)
    cache = sensitivity.cache_path(dst, plain, opts, list(cost), feeds)
    kept = sensitivity.read_kept(cache)
    if kept:
        sens, tokens = kept
    else:
        probe = sensitivity.Probe(plain, dst, feeds)
        try:
            if opts.int4_rounding == "gptq":
                from export.gptq import gptq_block_quant

                def quant(node: str, w: np.ndarray) -> np.ndarray:
                    return dequantize(*gptq_block_quant(w, hessian(node), 4, opts.int4_block_size, damp=opts.int4_gptq_damp),
                                      k=w.shape[0])
            else:
                def quant(node: str, w: np.ndarray) -> np.ndarray:
                    return fake_quant(w, 4, opts.int4_block_size, opts.int4_rounding)
            sens = sensitivity.measure(probe, quant, fused, skip=lambda t: t not in cost, parts=parts)
            tokens = probe.tokens
        finally:
            del probe
            for f in ("probe.onnx", "probe.onnx.data", "probe-inputs.onnx"):
                (dst / f).unlink(missing_ok=True)
        sensitivity.write_kept(cache, sens, tokens)
    missing = [t for t in cost if t not in sens]
    if missing:
        raise RecipeError(f"sensitivity: no plain-graph MatMul maps to {missing[0]} (export/sensitivity.py FUSED)")
    chosen = sensitivity.allocate(sens, cost, budget - base)
    return {"int4_budget_bytes": budget, "int4_all4_bytes": base,
            "int4_planned_bytes": base + sum(cost[t] for t in chosen), "int4_8bit_matmuls": chosen,
            "int4_packed_parts": {u: list(where) for u, where in parts.items()},
            "int4_sensitivity": dict(sorted(sens.items(), key=lambda kv: -kv[1])),
            "sensitivity_tokens": tokens}


def _write_int4(gw: GraphWeights, special: dict[str, tuple[int, int]], metrics: dict, opts: QuantizeOptions,
                hessian) -> None:
    """int4-weight's MatMulNBits: 4 bits, the head (`special`) and the budget's chosen units at 8."""
    promoted, renamed = promote(gw, metrics.get("int4_8bit_matmuls", []), metrics.get("int4_packed_parts", {}), opts)
    _nbits(gw, bits=4, accuracy_level=opts.accuracy_level, symmetric=opts.int4_symmetric, special=special | promoted,
           rounding=opts.int4_rounding,
           block_size=opts.int4_block_size, hessian=hessian and (lambda name: hessian(renamed.get(name, name))),
           gptq_damp4=opts.int4_gptq_damp)


def promote(gw: GraphWeights, chosen: list[str], parts: dict[str, list], opts: QuantizeOptions
            ) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Lay out the int4 budget's 8-bit units in `gw`: a chosen MatMul whole; a packed MatMul some of whose
    projections (`parts`: plain name -> [MatMul, first column, end]) are chosen and some not, split into MatMuls
    over runs of columns of one width (export/nbits.py `split_columns`). Returns the 8-bit MatMuls (name -> (8,
    block size), `quantize_matmuls`' `special`) and each split MatMul's packed MatMul (GPTQ's statistics know
    the input by that name)."""
    def eight(k: int) -> tuple[int, int]:
        return 8, promoted_block(k, opts)

    special = {u: eight(gw.shape(_weight_of(gw, u))[0]) for u in chosen if u not in parts}
    runs: dict[str, list[tuple[int, int, bool]]] = {}
    for u, (t, a, b) in parts.items():
        runs.setdefault(t, []).append((a, b, u in chosen))
    renamed: dict[str, str] = {}
    for t, cols in runs.items():
        k = gw.shape(_weight_of(gw, t))[0]
        if all(c[2] for c in cols):
            special[t] = eight(k)
        if len({c[2] for c in cols}) == 1:
            continue  # all parts at one width: the MatMul stays whole
        merged: list[list] = []
        for a, b, promoted in sorted(cols):
            if merged and merged[-1][2] == promoted:
                merged[-1][1] = b
            else:
                merged.append([a, b, promoted])
        for name, (_, _, promoted) in zip(split_columns(gw, t, [(a, b) for a, b, _ in merged]), merged):
            renamed[name] = t
            if promoted:
                special[name] = eight(k)
    return special, renamed


def run(fp32_dir: Path, hf_dir: Path, dst: Path, opts: QuantizeOptions) -> dict:
    from export.load import model_dims

    hess = None
    if (opts.mode in (INT4_WEIGHT, INT4_QDQ) and opts.int4_rounding == "gptq"
            or opts.mode == INT8_DYNAMIC and opts.int8_kernel == "nbits" and opts.int8_rounding == "gptq"
            or opts.mode in (INT8_QDQ, FP8) and opts.int8_rounding == "gptq"):
        hess, hessian = _gptq_statistics(fp32_dir, hf_dir, dst, opts, model_dims(hf_dir))  # shared by the build's engines
    try:
        metrics = _run(fp32_dir, hf_dir, dst, opts, hessian if hess else None)
    finally:
        if hess:
            hess.close()
    if hess:
        metrics |= {"gptq_tokens": hess.rows, "gptq_passes": hess.passes, "gptq_statistics": hess.method,
                    "gptq_statistics_loaded": getattr(hess, "loaded_from_disk", 0),
                    "gptq_statistics_computed": getattr(hess, "computed", None)}
    return metrics


def _run(fp32_dir: Path, hf_dir: Path, dst: Path, opts: QuantizeOptions, hessian) -> dict:
    from export.load import model_dims

    dims = model_dims(hf_dir)
    if opts.mode in (INT4_QDQ, FP8):  # TensorRT's Q/DQ formats on the fp16 graph: export/trt_formats.py
        from export import trt_formats

        fitted = max(gptq_chats(opts), opts.gptq_samples - gptq_chats(opts))  # GPTQ's texts: not measured on
        keep = set(matching_matmuls(GraphWeights(fp32_dir / "model.onnx").model, tuple(opts.qdq_float_nodes),
                                    dims.num_layers)) if opts.mode == FP8 else set()
        metrics = {"mode": opts.mode} | trt_formats.run(
            fp32_dir, dst, opts, hessian,
            lambda: calibration_feeds(hf_dir, opts, dims.num_layers, dims.num_kv_heads, dims.head_dim),
            lambda: sensitivity_feeds(hf_dir, opts, dims, skip=fitted), keep)
        return metrics | {"size_bytes": graph_bytes(dst / "model.onnx"),
                          "fp32_size_bytes": graph_bytes(fp32_dir / "model.onnx"),
                          "size_ratio": graph_bytes(dst / "model.onnx") / graph_bytes(fp32_dir / "model.onnx")}
    gw = GraphWeights(fp32_dir / "model.onnx")
    untie_lm_head(gw)
    out = dst / "model.onnx"
    metrics: dict = {"mode": opts.mode}
    special: dict[str, tuple[int, int]] = {}
    if opts.mode == INT8_DYNAMIC:
        metrics["block16_nodes"] = _int8_dynamic(gw, dst / "prepared.onnx", out, opts, dims.num_layers, hessian)
        metrics["int8_rounding"] = opts.int8_rounding if opts.int8_kernel == "nbits" else None
    elif opts.mode == INT4_WEIGHT:
        head = getattr(lm_head_matmul(gw.model), "name", None)
        special = {head: (opts.int4_lm_head_bits, lm_head_block(gw.shape(_weight_of(gw, head))[0], opts))} \
            if head and opts.int4_lm_head_bits != 4 else {}
        if opts.int4_budget_mb is not None or opts.int4_extra_ratio > 0:
            metrics |= _int4_mixed(gw, fp32_dir, hf_dir, dst, opts, dims, special, hessian)
        _write_int4(gw, special, metrics, opts, hessian)
        metrics["lm_head_bits"] = opts.int4_lm_head_bits if head else None
        metrics["int4_rounding"] = opts.int4_rounding
        metrics["int4_block_size"] = opts.int4_block_size
    else:
        from export.int8_qdq import int8_qdq

        feeds = calibration_feeds(hf_dir, opts, dims.num_layers, dims.num_kv_heads, dims.head_dim)
        skip = set(matching_matmuls(gw.model, tuple(opts.qdq_float_nodes), dims.num_layers))
        fitted = max(gptq_chats(opts), opts.gptq_samples - gptq_chats(opts)) if hessian else 0
        metrics |= int8_qdq(gw, out, hf_dir, opts, feeds, skip, dst / ABLATION, hessian,
                            lambda: sensitivity_feeds(hf_dir, opts, dims, skip=fitted))
    # the embedding table: INT8 (shared with the LM head's INT8 weight where they are tied). Graphs ONNX
    # Runtime's quantizers wrote are read back from disk; ours is still in memory, saved once here.
    ort_wrote = opts.mode == INT8_QDQ or opts.int8_kernel != "nbits" and opts.mode == INT8_DYNAMIC
    for path in (out, dst / ABLATION / "model.onnx"):
        if not ort_wrote and path != out or ort_wrote and not path.exists():
            continue
        g = GraphWeights(path) if ort_wrote else gw
        saved = quantize_embedding(g, dequantize_first=opts.mode == INT8_QDQ)  # TensorRT's form in the Q/DQ graph
        g.save(path)
        if path == out:
            metrics["embedding_bytes_saved"] = saved
    chosen = list(metrics.get("int4_8bit_matmuls", []))
    while "int4_budget_bytes" in metrics and graph_bytes(out) > metrics["int4_budget_bytes"]:
        # the plan misses the graph's own growth (node and initializer records): the least KL per byte goes
        # back to 4 bits until the file fits
        if not chosen:
            raise RecipeError(f"the all-4-bit engine is {graph_bytes(out) / 1e6:.2f} MB, more than the int4 budget of "
                              f"{metrics['int4_budget_bytes'] / 1e6:.2f} MB: raise int4_budget_mb (or int4_extra_ratio), "
                              "or leave both unset")
        chosen.pop()
        metrics["int4_8bit_matmuls"] = list(chosen)
        g = GraphWeights(fp32_dir / "model.onnx")
        untie_lm_head(g)
        _write_int4(g, special, metrics, opts, hessian)
        quantize_embedding(g)
        g.save(out)
    for f in dst.iterdir():
        if f.name.startswith(("prepared.onnx", "smoothed.onnx", "stats.onnx", "stats-aug.onnx")):
            f.unlink()
    metrics["size_bytes"] = graph_bytes(out)
    metrics["fp32_size_bytes"] = graph_bytes(fp32_dir / "model.onnx")
    metrics["size_ratio"] = metrics["size_bytes"] / metrics["fp32_size_bytes"]
    return metrics
