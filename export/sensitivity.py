"""Which weights 4 bits hurt, measured: KL to fp32 when only one weight MatMul is 4-bit, and a byte
budget spent on the worst ones (8 bits instead), as llama.cpp's k-quants give attn_v and ffn_down more
bits, but chosen by measurement on this model rather than by tensor name.

One ONNX Runtime session over the plain fp32 graph with its weight MatMuls reading B from graph inputs:
each measurement feeds one weight (or a fused group: q/k/v, gate/up) in its 4-bit form, the others as
they are, so nothing is rebuilt per tensor and any architecture the exporter writes works.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Container

import numpy as np

from edge.precisions import INT4_QDQ
from export.onnx_weights import GraphWeights, graph_bytes, untie_lm_head, weight_matmuls

# plain-graph MatMul name -> the fused graph's name for the MatMul it is packed into (export/fused_graph.py)
FUSED = [(re.compile(r"/self_attn/(qkv|[qkv])_proj/"), "/attn/qkv_proj/"),  # Phi-3's plain graph: qkv_proj already
         (re.compile(r"/self_attn/o_proj/"), "/attn/o_proj/"), (re.compile(r"/mlp/(gate_up|gate|up)_proj/"), "/mlp/gate_up_proj/")]


# the projections the fused graph packs, in the order it concatenates their columns (export/fused_graph.py `_packed`)
PACKED_PARTS = ("q", "k", "v", "gate", "up")
_PART = re.compile(r"/(?:self_attn|mlp)/(q|k|v|gate|up)_proj/")


def target_name(plain: str, fused: bool) -> str:
    if fused:
        for pat, rep in FUSED:
            plain = pat.sub(rep, plain)
    return plain


def packed_columns(plain_widths: dict[str, int], fused_widths: dict[str, int]) -> dict[str, tuple[str, int, int]]:
    """Plain MatMul -> (the fused MatMul it is packed into, its first column there, one past its last), for each
    projection the fused graph packs from separate ones (q/k/v, gate/up), so the int4 budget can promote k and v
    (small, the most sensitive) without q. A fused MatMul whose parts' widths do not add up to its own is left out
    (measured and promoted whole). `*_widths`: each weight MatMul's output columns."""
    groups: dict[str, list[str]] = {}
    for node in plain_widths:
        t, m = target_name(node, True), _PART.search(node)
        if m and t != node and t in fused_widths:
            groups.setdefault(t, []).append(node)
    out: dict[str, tuple[str, int, int]] = {}
    for t, nodes in groups.items():
        nodes.sort(key=lambda node: PACKED_PARTS.index(_PART.search(node).group(1)))
        if len(nodes) < 2 or sum(plain_widths[n] for n in nodes) != fused_widths[t]:
            continue
        start = 0
        for node in nodes:
            out[node] = (t, start, start + plain_widths[node])
            start += plain_widths[node]
    return out


def _log_softmax32(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _kl(ref_logp: np.ndarray, logits: np.ndarray) -> float:
    return float((np.exp(ref_logp) * (ref_logp - _log_softmax32(logits))).sum(dtype=np.float64))


class Probe:
    """The plain fp32 graph with every weight MatMul's B as a graph input, and the reference logits."""

    def __init__(self, plain: Path, work: Path, feeds: list[dict], threads: int | None = None) -> None:
        import onnx
        import onnxruntime as ort

        gw = GraphWeights(plain)
        untie_lm_head(gw)
        gw.save(work / "probe.onnx")
        gw = GraphWeights(work / "probe.onnx")
        model = gw.model
        self.nodes = {n.name: n.input[1] for n in weight_matmuls(model)}
        self.weights = {w: np.ascontiguousarray(gw.array(w), np.float32) for w in self.nodes.values()}
        keep = [i for i in model.graph.initializer if i.name not in self.weights]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        for w, a in self.weights.items():
            model.graph.input.append(onnx.helper.make_tensor_value_info(w, onnx.TensorProto.FLOAT, list(a.shape)))
        onnx.save_model(model, str(work / "probe-inputs.onnx"))
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(work / "probe-inputs.onnx"), so, providers=["CPUExecutionProvider"])
        self.feeds = feeds
        self.tokens = sum(f["input_ids"].shape[1] for f in feeds)
        self.ref = [_log_softmax32(lo[0]) for lo in self.logits({})]

    def logits(self, swap: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [self.session.run(["logits"], f | self.weights | swap)[0] for f in self.feeds]

    def kl(self, swap: dict[str, np.ndarray]) -> float:
        """Mean KL(fp32 || this) per token with the weights in `swap` replaced."""
        return sum(_kl(r, lo[0]) for r, lo in zip(self.ref, self.logits(swap))) / self.tokens


def measure(probe: Probe, quant: Callable[[str, np.ndarray], np.ndarray], fused: bool,
            skip: Callable[[str], bool] = lambda name: False, progress: bool = True,
            parts: Container[str] = ()) -> dict[str, float]:
    """Target MatMul name -> KL to fp32 when only it is quantized by `quant(plain MatMul name, weight)`
    (fused groups together; a plain MatMul in `parts` alone, under its own name: a packed part the budget
    promotes by itself, `packed_columns`)."""
    from tqdm import tqdm

    groups: dict[str, list[tuple[str, str]]] = {}
    for node, w in probe.nodes.items():
        t = node if node in parts else target_name(node, fused)
        if not skip(t):
            groups.setdefault(t, []).append((node, w))
    out = {}
    for t, ws in tqdm(groups.items(), desc="sensitivity (KL per 4-bit MatMul)", unit="matmul", disable=not progress):
        out[t] = probe.kl({w: quant(node, probe.weights[w]) for node, w in ws})
    return out


def allocate(sensitivity: dict[str, float], extra_bytes: dict[str, int], budget: int, enough: float = 0.0) -> list[str]:
    """The MatMuls to keep at 8 bits (int8-qdq, fp8-qdq: the activations to keep float): most KL removed per extra
    byte first, while the extra bytes fit `budget`, and only until what is left unkept sums to at most `enough`
    (the one-at-a-time KLs add up to about the engine's KL: docs/quality.md "fp8-qdq's float budget")."""
    order = sorted(sensitivity, key=lambda t: sensitivity[t] / max(extra_bytes[t], 1), reverse=True)
    chosen, spent, left = [], 0, sum(sensitivity.values())
    for t in order:
        if enough > 0 and left <= enough:
            break
        if spent + extra_bytes[t] <= budget:
            chosen.append(t)
            spent += extra_bytes[t]
            left -= sensitivity[t]
    return chosen


def cache_path(dst: Path, graph: Path, opts, units: list[str], feeds: list[dict]) -> Path:
    """Where an int4 engine's per-MatMul sensitivity is kept: measured once per exported graph, engine, rounding, block
    and text, so a new byte budget re-uses it (the plan recommends budgets by what fits, and the measurement is most
    of a budgeted build). In OUT.work's root, which outlives the stage; the rounding code is part of the key.
    `opts`: export.quantize.QuantizeOptions."""
    gptq = opts.int4_rounding == "gptq"
    sources = ("gptq.py",) + (("trt_formats.py",) if opts.mode == INT4_QDQ else ())
    code = hashlib.sha256(b"".join(Path(__file__).with_name(f).read_bytes() for f in sources)).hexdigest()[:16] if gptq else None
    rounding = [opts.int4_rounding] + ([opts.gptq_samples, opts.gptq_tokens, opts.gptq_chat_share, opts.calibration, code]
                                       + ([list(opts.gptq_domains)] if tuple(opts.gptq_domains) != ("chat", "news") else [])
                                       + [opts.int4_gptq_damp]
                                       if gptq else [])
    key = hashlib.sha256(json.dumps([opts.mode, str(graph.resolve()), graph.stat().st_mtime_ns, graph_bytes(graph), rounding,
                                     opts.int4_block_size, sorted(units), [f["input_ids"].tolist() for f in feeds]]
                                    ).encode()).hexdigest()[:16]
    return dst.parent / f"int4-sensitivity-{key}.json"


def read_kept(cache: Path) -> tuple[dict, int] | None:
    """A kept measurement, or None (absent, or not one: measured again rather than trusted or crashed on)."""
    try:
        sens, tokens = json.loads(cache.read_text())
    except (OSError, ValueError, TypeError):
        return None
    ok = isinstance(sens, dict) and all(isinstance(v, (int, float)) for v in sens.values()) and isinstance(tokens, int)
    return (sens, tokens) if ok else None


def write_kept(cache: Path, sens: dict, tokens: int) -> None:
    """Written whole or not at all: a build stopped mid-write must not leave a cache the next one trusts."""
    tmp = cache.with_name(cache.name + ".partial")
    tmp.write_text(json.dumps([sens, tokens]))
    os.replace(tmp, cache)
