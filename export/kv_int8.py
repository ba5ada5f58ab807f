"""The 8-bit KV cache (`--kv-cache int8`): a fused graph whose K/V buffers hold int8.

ONNX Runtime's GroupQueryAttention (1.32, CPU included) reads and writes an int8 cache itself: it quantizes
each new key/value into the in-place buffer with a scale given as an input and dequantizes while it attends
(attributes k_quant_type / v_quant_type, kv_cache_bit_width=8; inputs k_scale, v_scale). The scales are
static, PER_TENSOR or PER_CHANNEL ([1, kv_heads, 1, head_dim]); a per-token scale would have to be written
by the op for each new token, which it does not do. So this stage calibrates one scale per layer, KV head
and channel on calibration text and writes them into the graph. A per-token cache kept outside the op would
be dequantized to float before every step, which costs more than the step saves (docs/speed.md, "The 8-bit
KV cache", measured both).

- K: a rotary layer turns channel j with channel j + d/2 by an angle that depends on the position, so what
  channel j holds at a position never seen in calibration is bounded by the pair's norm, not by the
  channel's own largest value: the scale of both channels is the largest norm of the pair / 127.
- V: no rotation; the channel's largest |value| / 127, with a margin (V_MARGIN) for text hotter than the
  calibration's.

A value beyond 127 * scale saturates (the op clips). The graph's past/present inputs and outputs become
int8 and its contract (`edge.io_contract.DecoderIO.kv_cache` and the scale names) says so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.bundle import ModelDims
from edge.errors import RecipeError
from edge.io_contract import FUSED_IO, KV_CACHES, KV_INT8, DecoderIO, io_for_variant

V_MARGIN = 1.25  # V's scale covers 1.25x the largest calibration value: headroom chosen, not tuned (docs/speed.md)
QMAX = 127
CALIBRATION_TOKENS = 1024  # per calibration text: long enough that late positions are seen
CALIBRATION_TEXTS = 8  # half training prose, half calibration chats
GQA_K_SCALE, GQA_V_SCALE = 12, 13  # GroupQueryAttention's input slots of k_scale and v_scale


def check_kv_cache(value: str) -> str:
    """The --kv-cache value, or one clear error naming the choices."""
    if value not in KV_CACHES:
        raise RecipeError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {value!r}")
    return value


def int8_io() -> DecoderIO:
    """The fused contract with an int8 cache: the scale initializers' names are part of it."""
    return io_for_variant("fused", KV_INT8)


def calibration_ids(hf_dir: Path, texts: int = CALIBRATION_TEXTS, tokens: int = CALIBRATION_TOKENS,
                    calibration: str | None = None) -> list[list[int]]:
    """Token ids to calibrate on: training-split prose run together to `tokens` each (long positions) and as many
    calibration chats in the model's template (the turns' special tokens); never the held-out splits."""
    from export.data import load_chats
    from export.load import chat_tokenizer
    from export.prose import prose_texts

    tok = chat_tokenizer(hf_dir)
    out: list[list[int]] = []
    prose = prose_texts("train")
    stream: list[int] = []
    for doc in prose:
        stream += tok.encode(doc + "\n\n")
        while len(stream) >= tokens and len(out) < texts // 2:
            out.append(stream[:tokens])
            stream = stream[tokens:]
        if len(out) >= texts // 2:
            break
    for chat in load_chats(calibration, "calibration", texts - len(out)):
        out.append(tok.encode_chat(chat, add_generation_prompt=False)[:tokens])
    return out


def measure_ranges(graph: Path, dims: ModelDims, prompts: list[list[int]], threads: int | None = None) -> dict:
    """Per layer: the K pair-norm bound and the V |max|, each [kv_heads, head_dim], over every calibration
    token, read from the float cache of the graph the int8 one will replace."""
    from edge.backends.onnxruntime import OrtDecoder

    longest = max(len(p) for p in prompts)
    dec = OrtDecoder(graph, _with_context(dims, longest), FUSED_IO, threads=threads)
    half = dims.head_dim // 2
    k_max = np.zeros((dims.num_layers, dims.num_kv_heads, dims.head_dim), np.float32)
    v_max = np.zeros_like(k_max)
    for ids in prompts:
        cache = dec.new_cache(1, len(ids))
        dec.prefill(ids, cache)
        for i in range(dims.num_layers):
            k = cache.arrays[2 * i][0, :, : len(ids)]  # [kv_heads, tokens, head_dim]
            v = cache.arrays[2 * i + 1][0, :, : len(ids)]
            pair = np.sqrt(k[..., :half] ** 2 + k[..., half: 2 * half] ** 2).max(axis=1)
            k_max[i, :, :half] = np.maximum(k_max[i, :, :half], pair)
            k_max[i, :, half: 2 * half] = np.maximum(k_max[i, :, half: 2 * half], pair)
            if dims.head_dim % 2:  # an odd last channel does not rotate
                k_max[i, :, -1] = np.maximum(k_max[i, :, -1], np.abs(k[..., -1]).max(axis=1))
            v_max[i] = np.maximum(v_max[i], np.abs(v).max(axis=1))
    return {"k_max": k_max, "v_max": v_max}


def scales_from_ranges(ranges: dict, v_margin: float = V_MARGIN) -> tuple[np.ndarray, np.ndarray]:
    """[layers, kv_heads, head_dim] scales of K and V (a channel that never moved gets a tiny one, not 0)."""
    k = np.maximum(ranges["k_max"], 1e-6) / QMAX
    v = np.maximum(ranges["v_max"] * v_margin, 1e-6) / QMAX
    return k.astype(np.float32), v.astype(np.float32)


def convert(src: Path, dst: Path, k_scale: np.ndarray, v_scale: np.ndarray, io: DecoderIO | None = None) -> int:
    """Write dst/model.onnx: the fused graph at src with int8 K/V buffers and these per-channel scales.
    Returns the number of attention nodes converted."""
    from onnx import TensorProto, helper

    from export.onnx_weights import GraphWeights

    io = io or int8_io()
    gw = GraphWeights(src / "model.onnx")
    g = gw.model.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    if len(gqa) != k_scale.shape[0]:
        raise RecipeError(f"{src / 'model.onnx'} has {len(gqa)} attention nodes, the scales {k_scale.shape[0]} layers")
    for node in gqa:
        if any(a.name in ("k_quant_type", "kv_cache_bit_width") for a in node.attribute):
            raise RecipeError(f"{src / 'model.onnx'} already has a quantized KV cache")
    past = {io.past_key.format(i=i): i for i in range(len(gqa))}
    for node in gqa:
        i = past.get(node.input[3])
        if i is None:
            raise RecipeError(f"attention node {node.name} does not read a past key named by the fused contract")
        names = io.kv_scale_key.format(i=i), io.kv_scale_value.format(i=i)
        gw.set(names[0], k_scale[i][None, :, None, :])
        gw.set(names[1], v_scale[i][None, :, None, :])
        while len(node.input) < GQA_K_SCALE:
            node.input.append("")
        node.input[GQA_K_SCALE:] = []
        node.input.extend(names)
        node.attribute.extend([helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("kv_cache_bit_width", 8)])
    _save_with_kv_type(gw, g, io, len(gqa), TensorProto.INT8, dst)
    return len(gqa)


def _with_context(dims: ModelDims, tokens: int) -> ModelDims:
    import dataclasses

    return dataclasses.replace(dims, max_context=max(dims.max_context, tokens))


def run(src: Path, hf_dir: Path, dst: Path, calibration: str | None = None, threads: int | None = None,
        texts: int = CALIBRATION_TEXTS) -> dict:
    """The kv-int8 stage: src/model.onnx (a fused graph, float K/V) -> dst/model.onnx (int8 K/V), calibrated
    on `texts` calibration texts of up to CALIBRATION_TOKENS tokens."""
    from export.load import model_dims

    dims = model_dims(hf_dir)
    prompts = calibration_ids(hf_dir, texts, min(CALIBRATION_TOKENS, dims.max_context), calibration)
    ranges = measure_ranges(src / "model.onnx", dims, prompts, threads)
    k, v = scales_from_ranges(ranges)
    layers = convert(src, dst, k, v)
    return {"kv_cache": KV_INT8, "layers": layers, "calibration_texts": len(prompts),
            "calibration_tokens": sum(map(len, prompts)), "v_margin": V_MARGIN,
            "k_scale_max": float(k.max()), "v_scale_max": float(v.max())}


def float_twin(src: Path, dst: Path, io: DecoderIO | None = None) -> None:
    """dst/model.onnx: the int8-KV graph at src with a float32 cache again (same weights, same nodes), the
    reference its quality and speed are measured against (scripts/bench_kv_cache.py)."""
    from onnx import TensorProto

    from export.onnx_weights import GraphWeights

    io = io or int8_io()
    gw = GraphWeights(src / "model.onnx")
    g = gw.model.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    for node in gqa:
        for name in node.input[GQA_K_SCALE:]:
            if name:
                gw.remove(name)
        node.input[GQA_K_SCALE:] = []
        keep = [a for a in node.attribute if a.name not in ("k_quant_type", "v_quant_type", "kv_cache_bit_width")]
        del node.attribute[:]
        node.attribute.extend(keep)
    _save_with_kv_type(gw, g, io, len(gqa), TensorProto.FLOAT, dst)


def _save_with_kv_type(gw, g, io, layers: int, elem_type: int, dst: Path) -> None:
    """The graph's past/present K/V inputs and outputs declared as `elem_type`, then saved into `dst`."""
    kv_names = set(io.past_names(layers)) | set(io.present_names(layers))
    for vi in list(g.input) + list(g.output):
        if vi.name in kv_names:
            vi.type.tensor_type.elem_type = elem_type
    dst.mkdir(parents=True, exist_ok=True)
    gw.save(dst / "model.onnx")
