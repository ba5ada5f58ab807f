"""The fused decoder graph for ONNX Runtime, written op by op from the HF weights.

The plain graph (optimum's trace) spends each decode step on dozens of small
ops per layer and a Concat that copies the whole past KV. This one is the same
network in ONNX Runtime's contrib ops, the way its GenAI model builder writes it:

    Gather -> per layer: SkipSimplifiedLayerNorm, one packed QKV MatMul,
    GroupQueryAttention (KV written in place into a buffer that past and present
    share), o_proj, SkipSimplifiedLayerNorm, one packed gate+up MatMul,
    act(gate) * up, down_proj -> final norm -> the rows at logit_positions -> LM head.

The rotary embedding runs inside GroupQueryAttention where it can. Where the
architecture puts something between the projection and the rotary (Qwen3's and
Gemma 3's per-head q/k RMSNorm), rotates only part of each head (Phi-4-mini) or
switches tables with the length (LongRoPE), the packed QKV is split, the q/k
norms run per head, and ONNX Runtime's RotaryEmbedding op rotates q and k at
positions computed in the graph from seqlens_k (the positions
GroupQueryAttention would use itself); GroupQueryAttention then runs with
do_rotary=0. A layer without rotary (SmolLM3's no_rope_layers) skips it. What
differs per family is read from its `ArchSpec` (export/architectures.py):
packed projections (Phi-3), q/k norms, RMSNorm scaling by (1 + weight), embeddings
scaled by sqrt(hidden), Gemma 3's norms around attention and MLP, and per layer
from the config: sliding window (`layer_types`), rotary base (Gemma 3's local
layers), rotary on or off.

Every weight is read by its HF name from a `WeightSource` (export/weight_source.py): the loaded torch model's
state dict (the export stage) or the checkpoint's files one tensor at a time (`write` without a model, and the
streaming build, export/stream_build.py, which hands the writer a sink that keeps each weight as a promise).

It is only for ONNX Runtime (TensorRT wants the plain graph). Its inputs differ
from the plain graph's (seqlens_k and total_sequence_length instead of a mask
and positions, and logit_positions: which positions' logits to return, so a
prefill runs the LM head on its last position only): `edge.io_contract.FUSED_IO`
is its contract.
The quantize stage treats it like any fp32 graph (its MatMuls become
MatMulNBits, the tied LM head shares the INT8 table with the embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge.errors import ModelSourceError
from edge.io_contract import FUSED_IO
from export.architectures import ARCHITECTURES, arch_spec, dims_from_hf_config
from export.onnx_weights import TensorFile

if TYPE_CHECKING:
    from export.weight_source import Lazy, WeightSource

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SiLU(gate) * up (SwiGLU) and tanh-GELU(gate) * up (Gemma's GeGLU)


def supported(cfg: dict) -> str | None:
    """None if the fused graph can express this model, else why not."""
    spec = arch_spec((cfg.get("architectures") or ["LlamaForCausalLM"])[0])
    if not spec.fusable:
        fusable = ", ".join(a for a, s in ARCHITECTURES.items() if s.fusable)
        return f"{spec.hf_name} has no fused graph yet (supported: {fusable})"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} is not one the fused graph writes ({', '.join(ACTIVATIONS)})"
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        return "dynamic NTK rope scaling changes with the sequence length"
    if cfg.get("use_bidirectional_attention"):
        return "bidirectional attention (an embedding model, not a chat model)"
    return None


@dataclass(frozen=True)
class _Rotary:
    """One rotary table of the graph: cos/sin initializers, how many dims it turns, and (LongRoPE) the
    length past which the second half of the table (the long factors) is read."""
    cos: str
    sin: str
    dim: int
    switch_after: int | None = None  # None: one table


def _cos_sin(inv_freq, scale: float, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq.detach().float())
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


def _rotary_tables(rot, cfg, max_pos: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """cos/sin [max_pos, rotary_dim/2] from one of the model's rotary modules (any rope_type it knows).
    LongRoPE: HF rotates with the short factors while the sequence is at most original_max_position_embeddings
    long and with the long ones past it (for every new position, the cached keys keep theirs); both tables go
    in, one after the other, and the graph reads the second when the total length passes that point."""
    scale = float(getattr(rot, "attention_scaling", 1.0))
    if getattr(rot, "rope_type", "default") != "longrope":
        cos, sin = _cos_sin(rot.inv_freq, scale, max_pos)
        return cos, sin, None
    orig = int(getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)
    short = rot.original_inv_freq
    long, _ = rot.rope_init_fn(cfg, None, seq_len=orig + 1)
    (cs, ss), (cl, sl) = _cos_sin(short, scale, max_pos), _cos_sin(long, scale, max_pos)
    return np.concatenate([cs, cl]), np.concatenate([ss, sl]), orig


def write(src: Path, dst: Path, model=None, opset: int = 18) -> None:
    """HF folder -> dst/model.onnx (+ model.onnx.data): the fused fp32 graph.

    `model`: the fp32 torch model already loaded from `src` (the export stage's parity reference),
    so it is not loaded twice; without it the weights are read from `src`'s files one tensor at a time
    (export/weight_source.py). Each weight goes to the data file as soon as it is made."""
    import onnx

    from export.weight_source import ModuleSource, SafetensorsSource, empty_model

    cfg = json.loads((src / "config.json").read_text())
    check(cfg)
    weights = ModuleSource(model) if model is not None else SafetensorsSource(src)
    skeleton = model if model is not None else empty_model(cfg)
    dst.mkdir(parents=True, exist_ok=True)
    for f in dst.glob("model.onnx*"):
        f.unlink()
    with TensorFile(dst / "model.onnx.data") as data:
        proto = graph(skeleton, weights, cfg, lambda name, value: data.tensor(name, value() if callable(value) else value),
                      opset)
    onnx.save_model(proto, str(dst / "model.onnx"))  # the graph alone: its weights are in model.onnx.data


def check(cfg: dict) -> None:
    """Raise when the fused graph cannot express this model."""
    why = supported(cfg)
    if why:
        raise ModelSourceError(f"cannot write the fused graph: {why}; build with the plain graph only")


def _is_sliding(c, i: int) -> bool:
    types = getattr(c, "layer_types", None)
    return types is None or types[i] == "sliding_attention"


def _layer_window(c, i: int) -> int | None:
    """The layer's sliding window (keys it sees, itself included), None for full attention."""
    window = getattr(c, "sliding_window", None)
    if not window or not getattr(c, "use_sliding_window", True):
        return None
    return int(window) if _is_sliding(c, i) else None


def _layer_rotary(c, i: int) -> bool:
    flags = getattr(c, "no_rope_layers", None)  # SmolLM3: 1 = this layer rotates, 0 = it does not
    return bool(flags[i]) if flags is not None else True


def _packed(weights: "WeightSource", prefix: str, packed: str | None, parts: tuple[str, ...], what: str,
            transpose: bool = True) -> "Lazy | None":
    """The packed projection's weight, [in, out] (`transpose`; or its bias, [out]): the tensor `packed` when the
    family packs it (Phi-3's qkv_proj, gate_up_proj: `ArchSpec.packed_proj`), else its parts concatenated on the
    output axis. Lazy: read from `weights` when the graph's writer asks. None when there is no such tensor."""
    from export.weight_source import Lazy

    names = [f"{prefix}.{packed}.{what}"] if packed else [f"{prefix}.{p}.{what}" for p in parts]
    if not weights.has(names[0]):
        return None
    shapes = [weights.dims_shape(n) for n in names]
    out = sum(s[0] for s in shapes)

    def value() -> np.ndarray:
        w = np.concatenate([weights.get(n) for n in names], 0) if len(names) > 1 else weights.get(names[0])
        return w.T if transpose and w.ndim == 2 else w

    return Lazy((shapes[0][1], out) if transpose and len(shapes[0]) == 2 else (out, *shapes[0][1:]), value)


def _transposed(weights: "WeightSource", name: str) -> "Lazy":
    from export.weight_source import Lazy

    rows, cols = weights.dims_shape(name)
    return Lazy((cols, rows), lambda: weights.get(name).T)


def graph(model, weights: "WeightSource", cfg: dict, tensor, opset: int = 18):
    """The fused graph's ModelProto. `model`: the HF model's module tree (its config, rotary modules and attention
    scaling; its parameters may be on the meta device); `weights`: where each weight is read from, by HF name;
    `tensor(name, value)`: makes each initializer's record (value: an array, or a `Lazy` the sink may keep
    for later), so a sink that writes to disk holds one weight at a time."""
    import torch
    from onnx import TensorProto, helper

    from export.weight_source import Lazy

    c = model.config
    spec = arch_spec(cfg["architectures"][0])
    dims = dims_from_hf_config(cfg)
    N, KV, D, eps = dims.num_heads, dims.num_kv_heads, dims.head_dim, float(c.rms_norm_eps)
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")  # Gemma names it differently
    io = FUSED_IO
    inits, nodes = [], []

    def const(name: str, array) -> str:
        """An initializer from a numpy array or a `Lazy` one."""
        inits.append(tensor(name, array))
        return name

    def norm_weight(name: str, src: str | None = None) -> str:
        """An RMSNorm's weight, scaled by (offset + weight); read from the tensor `src` (default: `name`)."""
        src = src or name
        return const(name, Lazy(weights.dims_shape(src), lambda: weights.get(src) + spec.norm_offset))

    def node(op: str, ins: list[str], outs: list[str], name: str, **attrs):
        contrib = ("SkipSimplifiedLayerNormalization", "GroupQueryAttention", "RotaryEmbedding", "FastGelu")
        nodes.append(helper.make_node(op, ins, outs, name=name, domain="com.microsoft" if op in contrib else "",
                                      **attrs))
        return outs[0]

    def rms(x_in: str, weight: str, tag: str) -> str:
        return node("SimplifiedLayerNormalization", [x_in, weight], [f"{tag}/out"], f"{tag}/RMSNorm", axis=-1,
                    epsilon=eps)

    residual = None  # the running sum the next SkipSimplifiedLayerNorm adds to

    def skip_norm(x_in: str, weight: str, tag: str) -> str:
        """RMSNorm(residual + x_in), keeping the sum as the new residual."""
        nonlocal residual
        if residual is None:  # the first one has no residual yet: plain RMSNorm
            residual = x_in
            return rms(x_in, weight, tag)
        out, res = f"{tag}/out", f"{tag}/residual"
        node("SkipSimplifiedLayerNormalization", [x_in, residual, weight], [out, "", "", res],
             f"{tag}/SkipRMSNorm", epsilon=eps)
        residual = res
        return out

    sd = model.model
    # rotary tables: the model's own module(s); Gemma 3's sliding layers have their own (rotary_emb_local)
    tables: dict[str, _Rotary] = {}
    for key, rot in (("", sd.rotary_emb), ("local_", getattr(sd, "rotary_emb_local", None))):
        if rot is None:
            continue
        cos, sin, switch = _rotary_tables(rot, c, dims.max_context)
        tables[key] = _Rotary(const(f"{key}cos_cache", cos), const(f"{key}sin_cache", sin), 2 * cos.shape[1], switch)
    rotary = tables[""]
    # outside GroupQueryAttention when something sits between projection and rotary, or GQA cannot rotate it
    outside = spec.qk_norm or rotary.dim < D or rotary.switch_after is not None
    positions = {}  # table -> int64 [B, S] positions into it, made once for every layer

    def positions_for(t: _Rotary) -> str:
        """Row i's new tokens sit after seqlens_k[i] + 1 - S cached ones (what GroupQueryAttention assumes);
        with two LongRoPE tables, past the switch length every position reads the second half."""
        if t.cos in positions:
            return positions[t.cos]
        if "pos" not in positions:
            one = const("/positions/one", np.array(1, np.int64))
            seq = node("Shape", [io.input_ids], ["/positions/shape"], "/positions/Shape")
            s = node("Gather", [seq, one], ["/positions/S"], "/positions/GatherS", axis=0)
            lens = node("Cast", [io.seqlens_k], ["/positions/seqlens"], "/positions/Cast", to=TensorProto.INT64)
            start = node("Sub", [node("Add", [lens, one], ["/positions/total_row"], "/positions/AddOne"), s],
                         ["/positions/start"], "/positions/Start")
            start = node("Unsqueeze", [start, const("/positions/axis1", np.array([1], np.int64))],
                         ["/positions/start_col"], "/positions/Unsqueeze")
            steps = node("Range", [const("/positions/zero", np.array(0, np.int64)), s, one], ["/positions/range"],
                         "/positions/Range")
            pos = node("Add", [start, steps], ["/positions/raw"], "/positions/Add")
            positions["pos"] = node("Max", [pos, const("/positions/zero_b", np.array(0, np.int64))],
                                    ["/positions/ids"], "/positions/NotNegative")  # only padding could be < 0
        pos = positions["pos"]
        if t.switch_after is not None:  # LongRoPE: + max_pos when the longest row passed the switch length
            tag = f"/positions/{t.cos}"
            total = node("Cast", [io.total_sequence_length], [f"{tag}/total"], f"{tag}/CastTotal", to=TensorProto.INT64)
            past = node("Greater", [total, const(f"{tag}/switch", np.array(t.switch_after, np.int64))],
                        [f"{tag}/long"], f"{tag}/Greater")
            off = node("Mul", [node("Cast", [past], [f"{tag}/long64"], f"{tag}/CastLong", to=TensorProto.INT64),
                               const(f"{tag}/half", np.array(dims.max_context, np.int64))], [f"{tag}/offset"],
                       f"{tag}/Offset")
            pos = node("Add", [pos, off], [f"{tag}/ids"], f"{tag}/AddOffset")
        positions[t.cos] = pos
        return pos

    def head_norm(x: str, heads: int, src: str, name: str, p: str) -> str:
        """Per-head RMSNorm: [B, S, heads*D] -> [B, S*heads, D] -> norm -> back."""
        tag = f"{p}/attn/{name}"
        x = node("Reshape", [x, const(f"{tag}/shape_in", np.array([0, -1, D], np.int64))], [f"{tag}/heads"],
                 f"{tag}/Reshape_1")
        x = rms(x, norm_weight(f"{tag[1:].replace('/', '.')}.weight", src), tag)
        return node("Reshape", [x, const(f"{tag}/shape_out", np.array([0, -1, heads * D], np.int64))],
                    [f"{tag}/flat"], f"{tag}/Reshape_2")

    def rotate(x: str, heads: int, t: _Rotary, name: str, p: str) -> str:
        return node("RotaryEmbedding", [x, positions_for(t), t.cos, t.sin], [f"{p}/attn/{name}/out"],
                    f"{p}/attn/{name}/RotaryEmbedding", interleaved=0, num_heads=heads, rotary_embedding_dim=t.dim)

    embed = const("model.embed_tokens.weight", Lazy(weights.dims_shape("model.embed_tokens.weight"),
                                                     lambda: weights.get("model.embed_tokens.weight")))
    pending = node("Gather", [embed, io.input_ids], ["/embed/out"], "/model/embed_tokens/Gather")
    if spec.embed_scale:  # Gemma: embeddings times sqrt(hidden), rounded to the weights' dtype as HF does
        scale = torch.tensor(dims.hidden_size ** 0.5, dtype=torch.float32).item()
        pending = node("Mul", [pending, const("/model/embed_tokens/scale", np.array(scale, np.float32))],
                       ["/embed/scaled"], "/model/embed_tokens/Scale")
    for i, layer in enumerate(sd.layers):
        p, hf = f"/model/layers.{i}", f"model.layers.{i}"
        attn = layer.self_attn
        x = skip_norm(pending, norm_weight(f"{hf}.input_layernorm.weight"), f"{p}/input_layernorm")
        qkv_packed, gu_packed = ("qkv_proj", "gate_up_proj") if spec.packed_proj else (None, None)
        w = _packed(weights, f"{hf}.self_attn", qkv_packed, ("q_proj", "k_proj", "v_proj"), "weight")
        qkv = node("MatMul", [x, const(f"model.layers.{i}.attn.qkv_proj.weight", w)], [f"{p}/attn/qkv_proj/out"],
                   f"{p}/attn/qkv_proj/MatMul")
        bias = _packed(weights, f"{hf}.self_attn", qkv_packed, ("q_proj", "k_proj", "v_proj"), "bias")
        if bias is not None:
            qkv = node("Add", [qkv, const(f"model.layers.{i}.attn.qkv_proj.bias", bias)], [f"{p}/attn/qkv_bias/out"],
                       f"{p}/attn/qkv_proj/Add")
        table = tables["local_" if "local_" in tables and _is_sliding(c, i) else ""]
        rotates = _layer_rotary(c, i)
        attrs = dict(num_heads=N, kv_num_heads=KV, do_rotary=int(rotates and not outside), rotary_interleaved=0,
                     scale=float(getattr(attn, "scaling", D ** -0.5)))
        if _layer_window(c, i):
            attrs["local_window_size"] = _layer_window(c, i)
        # no attention softcap: Gemma 3's config has attn_logit_softcapping, but transformers' Gemma 3 attention
        # never passes it on (None in every Gemma 3 checkpoint anyway); the final logits' softcap it applies (below)
        if attrs["do_rotary"]:
            qkv_in = [qkv, "", ""]
            rot_in = [table.cos, table.sin]
        elif not spec.qk_norm and not rotates:
            qkv_in, rot_in = [qkv, "", ""], []
        else:
            q, k, v = (f"{p}/attn/{n}" for n in ("q", "k", "v"))
            node("Split", [qkv, const(f"{p}/attn/split", np.array([N * D, KV * D, KV * D], np.int64))], [q, k, v],
                 f"{p}/attn/qkv_proj/Split", axis=-1)
            if spec.qk_norm:
                q = head_norm(q, N, f"{hf}.self_attn.q_norm.weight", "q_norm", p)
                k = head_norm(k, KV, f"{hf}.self_attn.k_norm.weight", "k_norm", p)
            if rotates:
                q, k = rotate(q, N, table, "q_rotary", p), rotate(k, KV, table, "k_rotary", p)
            qkv_in, rot_in = [q, k, v], []
        a = node("GroupQueryAttention",
                 [*qkv_in, io.past_key.format(i=i), io.past_value.format(i=i), io.seqlens_k, io.total_sequence_length,
                  *rot_in],
                 [f"{p}/attn/out", io.present_key.format(i=i), io.present_value.format(i=i)], f"{p}/attn/GQA", **attrs)
        o = node("MatMul", [a, const(f"model.layers.{i}.attn.o_proj.weight", _transposed(weights, f"{hf}.self_attn.o_proj.weight"))],
                 [f"{p}/attn/o_proj/out"], f"{p}/attn/o_proj/MatMul")
        if spec.sandwich_norm:  # Gemma 3: the block's output is normed before it joins the residual
            o = rms(o, norm_weight(f"{hf}.post_attention_layernorm.weight"), f"{p}/post_attention_layernorm")
            x = skip_norm(o, norm_weight(f"{hf}.pre_feedforward_layernorm.weight"), f"{p}/pre_feedforward_layernorm")
        else:
            x = skip_norm(o, norm_weight(f"{hf}.post_attention_layernorm.weight"), f"{p}/post_attention_layernorm")
        inter = weights.dims_shape(f"{hf}.mlp.down_proj.weight")[1]
        w = _packed(weights, f"{hf}.mlp", gu_packed, ("gate_proj", "up_proj"), "weight")
        gu = node("MatMul", [x, const(f"model.layers.{i}.mlp.gate_up_proj.weight", w)], [f"{p}/mlp/gate_up_proj/out"],
                  f"{p}/mlp/gate_up_proj/MatMul")
        split = const(f"{p}/mlp/split", np.array([inter, inter], np.int64))
        node("Split", [gu, split], [f"{p}/mlp/gate", f"{p}/mlp/up"], f"{p}/mlp/Split", axis=-1)
        if act == "silu":
            node("Sigmoid", [f"{p}/mlp/gate"], [f"{p}/mlp/sig"], f"{p}/mlp/Sigmoid")
            node("Mul", [f"{p}/mlp/gate", f"{p}/mlp/sig"], [f"{p}/mlp/act_gate"], f"{p}/mlp/SiLU")
        else:  # gelu_pytorch_tanh: ONNX Runtime's FastGelu is the tanh approximation
            node("FastGelu", [f"{p}/mlp/gate"], [f"{p}/mlp/act_gate"], f"{p}/mlp/FastGelu")
        node("Mul", [f"{p}/mlp/act_gate", f"{p}/mlp/up"], [f"{p}/mlp/act"], f"{p}/mlp/GateMul")
        pending = node("MatMul", [f"{p}/mlp/act", const(f"model.layers.{i}.mlp.down_proj.weight",
                                                         _transposed(weights, f"{hf}.mlp.down_proj.weight"))],
                       [f"{p}/mlp/down_proj/out"], f"{p}/mlp/down_proj/MatMul")
        if spec.sandwich_norm:
            pending = rms(pending, norm_weight(f"{hf}.post_feedforward_layernorm.weight"),
                          f"{p}/post_feedforward_layernorm")
    x = skip_norm(pending, norm_weight("model.norm.weight"), "/model/norm")
    # only the rows the caller asks for reach the LM head: hidden [B, S, H] -> [B, K, H] at logit_positions
    idx = node("Unsqueeze", [io.logit_positions, const("/logits/axis2", np.array([2], np.int64))],
               ["/logits/index"], "/logits/Unsqueeze")  # [B, K, 1]
    x = node("GatherND", [x, idx], ["/logits/hidden_rows"], "/logits/GatherND", batch_dims=1)
    if dims.tie_word_embeddings:  # Transpose(embedding): the quantize stage unties it into one shared INT8 table
        head = node("Transpose", [embed], ["/lm_head/weight_T"], "/lm_head/Transpose", perm=[1, 0])
    else:
        head = const("lm_head.weight", _transposed(weights, "lm_head.weight"))
    cap = getattr(c, "final_logit_softcapping", None)
    node("MatMul", [x, head], ["/lm_head/out" if cap else io.logits], "/lm_head/MatMul")
    if cap:  # Gemma: logits = cap * tanh(logits / cap)
        capped = node("Tanh", [node("Div", ["/lm_head/out", const("/lm_head/cap", np.array(cap, np.float32))],
                                    ["/lm_head/scaled"], "/lm_head/SoftcapDiv")], ["/lm_head/tanh"], "/lm_head/Tanh")
        node("Mul", [capped, "/lm_head/cap"], [io.logits], "/lm_head/SoftcapMul")

    kv_shape = [io.batch_axis, KV, io.past_axis, D]
    inputs = [helper.make_tensor_value_info(io.input_ids, TensorProto.INT64, [io.batch_axis, io.sequence_axis]),
              helper.make_tensor_value_info(io.seqlens_k, TensorProto.INT32, [io.batch_axis]),
              helper.make_tensor_value_info(io.total_sequence_length, TensorProto.INT32, []),
              helper.make_tensor_value_info(io.logit_positions, TensorProto.INT64, [io.batch_axis, "logit_positions"])]
    outputs = [helper.make_tensor_value_info(io.logits, TensorProto.FLOAT,
                                             [io.batch_axis, "logit_positions", dims.vocab_size])]
    for i in range(dims.num_layers):
        for past, present in ((io.past_key, io.present_key), (io.past_value, io.present_value)):
            inputs.append(helper.make_tensor_value_info(past.format(i=i), TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(present.format(i=i), TensorProto.FLOAT,
                                                         [io.batch_axis, KV, "present_sequence_length", D]))
    g = helper.make_graph(nodes, "edgechat-fused-decoder", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)],
                             producer_name="edgechat", ir_version=8)
