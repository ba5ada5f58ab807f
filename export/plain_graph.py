"""The plain decoder graph (TensorRT's), written op by op from the weights in standard ONNX ops.

The export stage makes this graph by tracing the fp32 model with optimum, which holds the model in torch and the
traced graph's weights at once (3x the fp32 weights in RAM). The streaming build (export/stream_build.py) writes
it here instead, from a `WeightSource` one tensor at a time, so TensorRT's formats (int4-qdq) build in memory that
does not grow with the model. Same I/O contract as the trace (`edge.io_contract.DecoderIO()`: input_ids,
attention_mask, position_ids, past K/V in [batch, kv_heads, past, head_dim] -> logits at every position,
present K/V = past + new), same node names where a tool reads them (optimum's HF-module scopes:
'/model/layers.3/self_attn/q_proj/MatMul', '/model/layers.3/input_layernorm/...', '/model/rotary_emb/...'), so
GPTQ's statistics, the fp16 islands (export/fp16.py) and the Q/DQ writers (export/trt_formats.py) treat it as the
traced graph. Per layer:

    RMSNorm -> q, k, v MatMuls (+ bias) -> [q/k RMSNorm per head] -> rotary (rotate-half, cos/sin gathered at
    position_ids) -> K/V = Concat(past, new) -> grouped-query scores: q as [B, kv_heads, rep * S, D] against
    each K/V head once (no repeated K/V), + the causal/padding mask, Softmax, x V -> o_proj -> residual ->
    RMSNorm -> SiLU(gate) * up -> down -> residual

then the final RMSNorm and the LM head (Transpose(embedding) when tied: the quantize stage unties it).
What it writes: Llama, Mistral (no sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM2; others are
refused with the reason (`supported`), and built from the traced graph.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from edge.io_contract import DecoderIO
from export.architectures import arch_spec, dims_from_hf_config

if TYPE_CHECKING:
    from export.weight_source import WeightSource

MASKED = float(np.finfo(np.float32).min)  # a masked score (finite: a fully masked padding row gives no NaN); the
# Where that writes it stays in export/fp16.py's fp32 island with Softmax, so the fp16 graph keeps it too


def supported(cfg: dict) -> str | None:
    """None if this writer can express the model, else why not (then build without --streaming)."""
    from export import fused_graph

    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    spec = arch_spec(arch)
    why = fused_graph.supported(cfg)
    if why:
        return why
    if spec.packed_proj or spec.embed_scale or spec.sandwich_norm or spec.norm_offset:
        return f"{arch}'s plain graph is not written op by op yet (packed projections or Gemma's norms)"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act != "silu":
        return f"activation {act!r}: the op-by-op plain graph writes SiLU(gate) * up only"
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "longrope":
        return "LongRoPE's two rotary tables are not in the op-by-op plain graph yet"
    c = SimpleNamespace(**cfg)
    layers = range(int(cfg.get("num_hidden_layers", 0)))
    if any(fused_graph._layer_window(c, i) for i in layers):
        return "sliding-window attention is not in the op-by-op plain graph yet"
    if not all(fused_graph._layer_rotary(c, i) for i in layers) or float(cfg.get("partial_rotary_factor", 1.0)) != 1:
        return "layers without rotary, or partial rotary, are not in the op-by-op plain graph yet"
    return None


def graph(model, weights: "WeightSource", cfg: dict, tensor, opset: int = 18):
    """The plain graph's ModelProto (fp32). `model`: the HF module tree (config and rotary modules; parameters may
    be on the meta device); `weights`: each weight by HF name; `tensor(name, value)`: each initializer's record
    (value an array or a `Lazy`), as `export.fused_graph.graph` takes them."""
    from onnx import TensorProto, helper, numpy_helper

    from export.fused_graph import _transposed
    from export.weight_source import Lazy

    why = supported(cfg)
    if why:
        raise ValueError(why)
    c = model.config
    spec = arch_spec((cfg.get("architectures") or ["LlamaForCausalLM"])[0])
    dims = dims_from_hf_config(cfg)
    N, KV, D, eps = dims.num_heads, dims.num_kv_heads, dims.head_dim, float(c.rms_norm_eps)
    rep = N // KV
    io = DecoderIO()
    inits, nodes = [], []
    made: set[str] = set()  # names of the small constants written so far

    def const(name: str, array) -> str:
        inits.append(tensor(name, array))
        return name

    def node(op: str, ins: list[str], name: str, outs: int = 1, **attrs) -> str:
        """Node `name` (its outputs are `name`_output_0, _1, ... as optimum's trace names them)."""
        out = [f"{name}_output_{k}" for k in range(outs)]
        nodes.append(helper.make_node(op, ins, out, name=name, **attrs))
        return out[0]

    def i64(name: str, values) -> str:
        """An int64 axes/shape/index as a Constant node, as the trace writes them: shape inference (which types the
        graph for export/fp16.py without reading weights) sees its value."""
        if name not in made:
            made.add(name)
            nodes.append(helper.make_node("Constant", [], [name], name=name,
                                          value=numpy_helper.from_array(np.array(values, np.int64))))
        return name

    def f32(name: str, value: float) -> str:
        if name not in made:
            made.add(name)
            const(name, np.array(value, np.float32))
        return name

    def rms(x: str, weight_name: str, scope: str) -> str:
        """HF's RMSNorm: x * 1/sqrt(mean(x^2) + eps) * weight, in the scope export/fp16.py keeps in fp32."""
        sq = node("Pow", [x, f32(f"{scope}/two", 2.0)], f"{scope}/Pow")
        mean = node("ReduceMean", [sq, i64(f"{scope}/axes", [-1])], f"{scope}/ReduceMean", keepdims=1)
        root = node("Sqrt", [node("Add", [mean, f32(f"{scope}/eps", eps)], f"{scope}/Add")], f"{scope}/Sqrt")
        inv = node("Div", [f32(f"{scope}/one", 1.0), root], f"{scope}/Div")
        normed = node("Mul", [x, inv], f"{scope}/Mul")
        w = const(weight_name, Lazy(weights.dims_shape(weight_name), lambda n=weight_name: weights.get(n)))
        return node("Mul", [w, normed], f"{scope}/Mul_1")

    def linear(x: str, hf: str, scope: str) -> str:
        y = node("MatMul", [x, const(f"{hf}.weight", _transposed(weights, f"{hf}.weight"))], f"{scope}/MatMul")
        if weights.has(f"{hf}.bias"):
            b = const(f"{hf}.bias", Lazy(weights.dims_shape(f"{hf}.bias"), lambda n=f"{hf}.bias": weights.get(n)))
            y = node("Add", [y, b], f"{scope}/Add")
        return y

    # shared by every layer: sizes, the rotary cos/sin at position_ids, the mask
    ids_shape = node("Shape", [io.input_ids], "/model/Shape")
    seq = node("Gather", [ids_shape, i64("/model/one", 1)], "/model/Gather_S", axis=0)
    total = node("Gather", [node("Shape", [io.attention_mask], "/model/Shape_1"), "/model/one"], "/model/Gather_T",
                 axis=0)
    # the rotary angles computed from position_ids as HF does (positions x inv_freq in fp32, then cos/sin times the
    # rope type's attention scaling): any position, no table, and the fp32 island export/fp16.py keeps (rotary_emb)
    rotary_emb = model.model.rotary_emb
    rot = "/model/rotary_emb"
    inv_freq = const("/model/rotary_emb/inv_freq", rotary_emb.inv_freq.detach().float().numpy().astype(np.float32))
    pos = node("Unsqueeze", [node("Cast", [io.position_ids], f"{rot}/Cast", to=TensorProto.FLOAT),
                             i64(f"{rot}/axis_last", [-1])], f"{rot}/Unsqueeze")  # [B, S, 1]
    half = node("Mul", [pos, inv_freq], f"{rot}/Mul")  # [B, S, D/2]
    angles = node("Concat", [half, half], f"{rot}/Concat", axis=-1)
    scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
    tables = {}
    for k, op in (("cos", "Cos"), ("sin", "Sin")):
        t = node(op, [angles], f"{rot}/{op}")
        if scaling != 1.0:
            t = node("Mul", [t, f32(f"{rot}/scaling", scaling)], f"{rot}/Mul_{k}")
        tables[k] = node("Unsqueeze", [t, i64(f"{rot}/axis1", [1])], f"{rot}/Unsqueeze_{k}")  # [B, 1, S, D]
    m = "/model/mask"
    q_pos = node("Range", [node("Sub", [total, seq], f"{m}/Sub"), total, "/model/one"], f"{m}/Range_q")
    t_pos = node("Range", [i64(f"{m}/zero", 0), total, "/model/one"], f"{m}/Range_t")
    causal = node("LessOrEqual", [node("Unsqueeze", [t_pos, i64(f"{m}/axis0", [0])], f"{m}/Unsqueeze_t"),
                                  node("Unsqueeze", [q_pos, i64(f"{m}/axis1", [1])], f"{m}/Unsqueeze_q")],
                  f"{m}/LessOrEqual")  # [S, T]: a query sees keys at or before its own position
    padded = node("Unsqueeze", [node("Cast", [io.attention_mask], f"{m}/Cast", to=TensorProto.BOOL),
                                i64(f"{m}/axes12", [1, 2])], f"{m}/Unsqueeze_pad")  # [B, 1, 1, T]
    allowed = node("And", [causal, padded], f"{m}/And")  # [B, 1, S, T]
    if rep > 1:  # q's rows are [rep, S] per K/V head (below): the mask repeats per query head of the group
        allowed = node("Tile", [allowed, i64(f"{m}/repeats", [1, 1, rep, 1])], f"{m}/Tile")
    closed = f32(f"{m}/closed", MASKED)
    scale = f32("/model/attn_scale_sqrt", float(getattr(model.model.layers[0].self_attn, "scaling", D ** -0.5)) ** 0.5)

    def heads(x: str, n: str, count: int, scope: str, norm: str | None) -> str:
        """[B, S, count * D] -> [B, count, S, D], per-head RMSNorm first if the family has one."""
        x = node("Reshape", [x, i64(f"{scope}/{n}_shape", [0, 0, count, D])], f"{scope}/Reshape_{n}")
        if norm:
            x = rms(x, norm, f"{scope}/{n}_norm")
        return node("Transpose", [x], f"{scope}/Transpose_{n}", perm=[0, 2, 1, 3])

    def rotary(x: str, n: str, scope: str) -> str:
        """x * cos + rotate_half(x) * sin (HF's non-interleaved rotary)."""
        lo, hi = (f"{scope}/Split_{n}_output_{k}" for k in (0, 1))
        nodes.append(helper.make_node("Split", [x], [lo, hi], name=f"{scope}/Split_{n}", axis=-1, num_outputs=2))
        turned = node("Concat", [node("Neg", [hi], f"{scope}/Neg_{n}"), lo], f"{scope}/Concat_{n}", axis=-1)
        return node("Add", [node("Mul", [x, tables["cos"]], f"{scope}/Mul_{n}_cos"),
                            node("Mul", [turned, tables["sin"]], f"{scope}/Mul_{n}_sin")], f"{scope}/Add_{n}")

    embed = const("model.embed_tokens.weight", Lazy(weights.dims_shape("model.embed_tokens.weight"),
                                                     lambda: weights.get("model.embed_tokens.weight")))
    x = node("Gather", [embed, io.input_ids], "/model/embed_tokens/Gather")
    for i in range(dims.num_layers):
        p, hf = f"/model/layers.{i}", f"model.layers.{i}"
        a = f"{p}/self_attn"
        h = rms(x, f"{hf}.input_layernorm.weight", f"{p}/input_layernorm")
        qn, kn = ((f"{hf}.self_attn.q_norm.weight", f"{hf}.self_attn.k_norm.weight") if spec.qk_norm else (None, None))
        q = heads(linear(h, f"{hf}.self_attn.q_proj", f"{a}/q_proj"), "q", N, a, qn)
        k = heads(linear(h, f"{hf}.self_attn.k_proj", f"{a}/k_proj"), "k", KV, a, kn)
        v = heads(linear(h, f"{hf}.self_attn.v_proj", f"{a}/v_proj"), "v", KV, a, None)
        q, k = rotary(q, "q", a), rotary(k, "k", a)
        present = [io.present_key.format(i=i), io.present_value.format(i=i)]
        nodes.append(helper.make_node("Concat", [io.past_key.format(i=i), k], [present[0]], name=f"{a}/Concat_past_k",
                                      axis=2))
        nodes.append(helper.make_node("Concat", [io.past_value.format(i=i), v], [present[1]],
                                      name=f"{a}/Concat_past_v", axis=2))
        # q and k each scaled by sqrt(scale) before the score MatMul, as the trace's SDPA does (the same rounding as
        # torch; and in fp16 an unscaled q.k would overflow sqrt(head_dim) times sooner)
        q = node("Mul", [q, scale], f"{a}/Mul_scale_q")
        grouped = node("Reshape", [q, i64(f"{a}/group_shape", [0, KV, -1, D])], f"{a}/Reshape_group")
        keys_t = node("Transpose", [node("Mul", [present[0], scale], f"{a}/Mul_scale_k")], f"{a}/Transpose_keys",
                      perm=[0, 1, 3, 2])
        scores = node("MatMul", [grouped, keys_t], f"{a}/MatMul_scores")
        # masked scores replaced (not added to: a real model's scores can pass any finite offset), in fp32
        probs = node("Softmax", [node("Where", [allowed, scores, closed], f"{a}/Where_mask")], f"{a}/Softmax", axis=-1)
        ctx = node("MatMul", [probs, present[1]], f"{a}/MatMul_values")  # [B, KV, rep * S, D]
        ctx = node("Reshape", [ctx, i64(f"{a}/heads_shape", [0, N, -1, D])], f"{a}/Reshape_heads")
        ctx = node("Transpose", [ctx], f"{a}/Transpose_out", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, i64(f"{a}/out_shape", [0, 0, N * D])], f"{a}/Reshape_out")
        x = node("Add", [x, linear(ctx, f"{hf}.self_attn.o_proj", f"{a}/o_proj")], f"{p}/Add")
        h = rms(x, f"{hf}.post_attention_layernorm.weight", f"{p}/post_attention_layernorm")
        mp = f"{p}/mlp"
        gate = linear(h, f"{hf}.mlp.gate_proj", f"{mp}/gate_proj")
        act = node("Mul", [gate, node("Sigmoid", [gate], f"{mp}/act_fn/Sigmoid")], f"{mp}/act_fn/Mul")
        up = node("Mul", [act, linear(h, f"{hf}.mlp.up_proj", f"{mp}/up_proj")], f"{mp}/Mul")
        x = node("Add", [x, linear(up, f"{hf}.mlp.down_proj", f"{mp}/down_proj")], f"{p}/Add_1")
    x = rms(x, "model.norm.weight", "/model/norm")
    if dims.tie_word_embeddings:  # the quantize stage unties it (export/onnx_weights.py untie_lm_head)
        head = node("Transpose", [embed], "/lm_head/Transpose", perm=[1, 0])
    else:
        head = const("lm_head.weight", _transposed(weights, "lm_head.weight"))
    nodes.append(helper.make_node("MatMul", [x, head], [io.logits], name="/lm_head/MatMul"))

    total_axis = f"{io.past_axis} + {io.sequence_axis}"
    b, s = io.batch_axis, io.sequence_axis
    inputs = [helper.make_tensor_value_info(io.input_ids, TensorProto.INT64, [b, s]),
              helper.make_tensor_value_info(io.attention_mask, TensorProto.INT64, [b, total_axis]),
              helper.make_tensor_value_info(io.position_ids, TensorProto.INT64, [b, s])]
    outputs = [helper.make_tensor_value_info(io.logits, TensorProto.FLOAT, [b, s, dims.vocab_size])]
    for i in range(dims.num_layers):
        for past, present in ((io.past_key, io.present_key), (io.past_value, io.present_value)):
            inputs.append(helper.make_tensor_value_info(past.format(i=i), TensorProto.FLOAT, [b, KV, io.past_axis, D]))
            outputs.append(helper.make_tensor_value_info(present.format(i=i), TensorProto.FLOAT, [b, KV, total_axis, D]))
    g = helper.make_graph(nodes, "edgechat-plain-decoder", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="edgechat", ir_version=8)
