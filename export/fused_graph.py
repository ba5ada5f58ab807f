"""The fused decoder graph for ONNX Runtime, written op by op from the HF weights.

The plain graph (optimum's trace) spends each decode step on dozens of small
ops per layer and a Concat that copies the whole past KV. This one is the same
network in ONNX Runtime's contrib ops, the way its GenAI model builder writes it:

    Gather -> per layer: SkipSimplifiedLayerNorm, one packed QKV MatMul,
    GroupQueryAttention (rotary inside, KV written in place into a buffer that
    past and present share), o_proj, SkipSimplifiedLayerNorm, one packed
    gate+up MatMul, SiLU * up, down_proj -> final norm -> the rows at
    logit_positions -> LM head.

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
from pathlib import Path

import numpy as np

from edge.errors import ModelSourceError
from edge.io_contract import FUSED_IO
from export.architectures import ARCHITECTURES, arch_spec, dims_from_hf_config
from export.onnx_weights import TensorFile


def supported(cfg: dict) -> str | None:
    """None if the fused graph can express this model, else why not."""
    spec = arch_spec((cfg.get("architectures") or ["LlamaForCausalLM"])[0])
    if not spec.fusable:
        fusable = ", ".join(a for a, s in ARCHITECTURES.items() if s.fusable)
        return f"{spec.hf_name} has no fused graph yet (supported: {fusable})"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"activation {cfg.get('hidden_act')!r} is not SiLU"
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        return "dynamic NTK rope scaling changes with the sequence length"
    return None


def _rotary_caches(model, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_pos, rotary_dim/2] from the model's own rotary module (any rope_type it knows)."""
    import torch

    rot = model.model.rotary_emb
    inv_freq = rot.inv_freq.detach().float()
    scale = float(getattr(rot, "attention_scaling", 1.0))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


def write(src: Path, dst: Path, model=None, opset: int = 18) -> None:
    """HF folder -> dst/model.onnx (+ model.onnx.data): the fused fp32 graph.

    `model`: the fp32 torch model already loaded from `src` (the export stage's parity reference),
    so it is not loaded twice. Each weight goes to the data file as soon as it is made."""
    import torch

    cfg = json.loads((src / "config.json").read_text())
    why = supported(cfg)
    if why:
        raise ModelSourceError(f"cannot write the fused graph: {why}; build with the plain graph only")
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    dst.mkdir(parents=True, exist_ok=True)
    for f in dst.glob("model.onnx*"):
        f.unlink()
    with TensorFile(dst / "model.onnx.data") as data:
        _write(model, cfg, dst, data, opset)


def _write(model, cfg: dict, dst: Path, data: "TensorFile", opset: int) -> None:
    import onnx
    import torch
    from onnx import TensorProto, helper

    c = model.config
    dims = dims_from_hf_config(cfg)
    N, KV, D, eps = dims.num_heads, dims.num_kv_heads, dims.head_dim, float(c.rms_norm_eps)
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    io = FUSED_IO
    inits, nodes = [], []

    def const(name: str, array) -> str:
        """An initializer from a numpy array or a torch tensor."""
        if isinstance(array, torch.Tensor):
            array = array.detach().float().numpy()
        inits.append(data.tensor(name, array))
        return name

    def linear_weight(name: str, *mods) -> str:
        """[in, out] MatMul weight from one or more torch Linear layers, concatenated on the output axis."""
        return const(name, torch.cat([m.weight for m in mods], 0).T)

    def node(op: str, ins: list[str], outs: list[str], name: str, **attrs):
        domain = "com.microsoft" if op in ("SkipSimplifiedLayerNormalization", "GroupQueryAttention") else ""
        nodes.append(helper.make_node(op, ins, outs, name=name, domain=domain, **attrs))
        return outs[0]

    residual = None  # the running sum the next SkipSimplifiedLayerNorm adds to

    def skip_norm(x_in: str, weight: str, tag: str) -> str:
        """RMSNorm(residual + x_in), keeping the sum as the new residual."""
        nonlocal residual
        if residual is None:  # the first one has no residual yet: plain RMSNorm
            residual = x_in
            return node("SimplifiedLayerNormalization", [x_in, weight], [f"{tag}/out"], f"{tag}/RMSNorm",
                        axis=-1, epsilon=eps)
        out, res = f"{tag}/out", f"{tag}/residual"
        node("SkipSimplifiedLayerNormalization", [x_in, residual, weight], [out, "", "", res],
             f"{tag}/SkipRMSNorm", epsilon=eps)
        residual = res
        return out

    sd = model.model
    cos, sin = _rotary_caches(model, dims.max_context)
    const("cos_cache", cos)
    const("sin_cache", sin)
    embed = const("model.embed_tokens.weight", sd.embed_tokens.weight)
    pending = node("Gather", [embed, io.input_ids], ["/embed/out"], "/model/embed_tokens/Gather")
    for i, layer in enumerate(sd.layers):
        p = f"/model/layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        x = skip_norm(pending, const(f"model.layers.{i}.input_layernorm.weight", layer.input_layernorm.weight),
                      f"{p}/input_layernorm")
        qkv = node("MatMul", [x, linear_weight(f"model.layers.{i}.attn.qkv_proj.weight", attn.q_proj, attn.k_proj,
                                               attn.v_proj)], [f"{p}/attn/qkv_proj/out"], f"{p}/attn/qkv_proj/MatMul")
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            qkv = node("Add", [qkv, const(f"model.layers.{i}.attn.qkv_proj.bias", bias)], [f"{p}/attn/qkv_bias/out"],
                       f"{p}/attn/qkv_proj/Add")
        gqa_attrs = dict(num_heads=N, kv_num_heads=KV, do_rotary=1, rotary_interleaved=0,
                         scale=float(getattr(attn, "scaling", D ** -0.5)))
        if window:
            gqa_attrs["local_window_size"] = int(window)
        a = node("GroupQueryAttention",
                 [qkv, "", "", io.past_key.format(i=i), io.past_value.format(i=i), io.seqlens_k,
                  io.total_sequence_length, "cos_cache", "sin_cache"],
                 [f"{p}/attn/out", io.present_key.format(i=i), io.present_value.format(i=i)], f"{p}/attn/GQA",
                 **gqa_attrs)
        o = node("MatMul", [a, linear_weight(f"model.layers.{i}.attn.o_proj.weight", attn.o_proj)],
                 [f"{p}/attn/o_proj/out"], f"{p}/attn/o_proj/MatMul")
        x = skip_norm(o, const(f"model.layers.{i}.post_attention_layernorm.weight",
                               layer.post_attention_layernorm.weight), f"{p}/post_attention_layernorm")
        inter = mlp.gate_proj.out_features
        gu = node("MatMul", [x, linear_weight(f"model.layers.{i}.mlp.gate_up_proj.weight", mlp.gate_proj, mlp.up_proj)],
                  [f"{p}/mlp/gate_up_proj/out"], f"{p}/mlp/gate_up_proj/MatMul")
        split = const(f"{p}/mlp/split", np.array([inter, inter], np.int64))
        node("Split", [gu, split], [f"{p}/mlp/gate", f"{p}/mlp/up"], f"{p}/mlp/Split", axis=-1)
        node("Sigmoid", [f"{p}/mlp/gate"], [f"{p}/mlp/sig"], f"{p}/mlp/Sigmoid")
        node("Mul", [f"{p}/mlp/gate", f"{p}/mlp/sig"], [f"{p}/mlp/silu"], f"{p}/mlp/SiLU")
        node("Mul", [f"{p}/mlp/silu", f"{p}/mlp/up"], [f"{p}/mlp/act"], f"{p}/mlp/GateMul")
        pending = node("MatMul", [f"{p}/mlp/act", linear_weight(f"model.layers.{i}.mlp.down_proj.weight", mlp.down_proj)],
                       [f"{p}/mlp/down_proj/out"], f"{p}/mlp/down_proj/MatMul")
    x = skip_norm(pending, const("model.norm.weight", sd.norm.weight), "/model/norm")
    # only the rows the caller asks for reach the LM head: hidden [B, S, H] -> [B, K, H] at logit_positions
    idx = node("Unsqueeze", [io.logit_positions, const("/logits/axis2", np.array([2], np.int64))],
               ["/logits/index"], "/logits/Unsqueeze")  # [B, K, 1]
    x = node("GatherND", [x, idx], ["/logits/hidden_rows"], "/logits/GatherND", batch_dims=1)
    if dims.tie_word_embeddings:  # Transpose(embedding): the quantize stage unties it into one shared INT8 table
        head = node("Transpose", [embed], ["/lm_head/weight_T"], "/lm_head/Transpose", perm=[1, 0])
    else:
        head = linear_weight("lm_head.weight", model.lm_head)
    node("MatMul", [x, head], [io.logits], "/lm_head/MatMul")

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
    graph = helper.make_graph(nodes, "edgechat-fused-decoder", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)],
                              producer_name="edgechat", ir_version=8)
    onnx.save_model(proto, str(dst / "model.onnx"))  # the graph alone: its weights are in model.onnx.data
