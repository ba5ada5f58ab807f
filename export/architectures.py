"""Per-architecture facts, in one table keyed on the Hugging Face `architectures` name.

Everything that differs between decoder families lives on an `ArchSpec` entry
(attention bias, GGUF naming, which exporter covers it), so no code elsewhere
special-cases model names. tests/test_architectures.py builds every entry end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge.bundle import ModelDims
from edge.errors import ModelSourceError


@dataclass(frozen=True)
class ArchSpec:
    hf_name: str
    gguf_name: str  # general.architecture in GGUF files
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    mlp_gated: bool = True  # gate/up/down SwiGLU MLP (3 matrices) vs 2
    optimum_task: str = "text-generation-with-past"
    prunable: bool = True  # our prune stage knows its module names
    # export/fused_graph.py can write it: plain GQA + RoPE (Qwen3's per-head q/k norms sit between
    # the projection and the rotary, which GroupQueryAttention cannot take)
    fusable: bool = True


ARCHITECTURES: dict[str, ArchSpec] = {
    s.hf_name: s
    for s in (
        ArchSpec("LlamaForCausalLM", "llama"),
        ArchSpec("MistralForCausalLM", "llama"),
        ArchSpec("Qwen2ForCausalLM", "qwen2", attention_bias=True),
        ArchSpec("Qwen3ForCausalLM", "qwen3", fusable=False),
        # packed qkv_proj / gate_up_proj modules: the plain graph only, and our pruner does not know them
        ArchSpec("Phi3ForCausalLM", "phi3", fusable=False, prunable=False),
    )
}


def arch_spec(name: str) -> ArchSpec:
    if name not in ARCHITECTURES:
        raise ModelSourceError(
            f"architecture '{name}' is not supported yet (supported: {', '.join(sorted(ARCHITECTURES))}); "
            "open an issue with the model's config.json"
        )
    return ARCHITECTURES[name]


def arch_from_gguf(gguf_arch: str) -> ArchSpec:
    for spec in ARCHITECTURES.values():
        if spec.gguf_name == gguf_arch:
            return spec
    raise ModelSourceError(f"GGUF architecture '{gguf_arch}' is not supported yet")


def count_parameters(
    *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, vocab_size: int, tie_word_embeddings: bool, attention_bias: bool = False,
    mlp_gated: bool = True,
) -> int:
    """Parameter count of a Llama-style decoder, from its dims alone."""
    q = hidden_size * num_heads * head_dim
    kv = 2 * hidden_size * num_kv_heads * head_dim
    o = num_heads * head_dim * hidden_size
    bias = (num_heads + 2 * num_kv_heads) * head_dim if attention_bias else 0
    mlp = (3 if mlp_gated else 2) * hidden_size * intermediate_size
    per_layer = q + kv + o + bias + mlp + 2 * hidden_size  # two RMSNorm weights
    embed = vocab_size * hidden_size
    head = 0 if tie_word_embeddings else vocab_size * hidden_size
    return num_layers * per_layer + embed + head + hidden_size  # + final norm


def dims_from_hf_config(cfg: dict[str, Any]) -> ModelDims:
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    spec = arch_spec(archs[0])
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        dims = dict(
            num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ModelSourceError(f"model config lacks {e.args[0]!r}: is this a causal LM config.json?") from None
    n = count_parameters(**dims, attention_bias=spec.attention_bias, mlp_gated=spec.mlp_gated)
    return ModelDims(
        architecture=spec.hf_name, max_context=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
        num_parameters=n, **dims,
    )
