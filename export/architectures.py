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
    gguf_loads: bool = True  # transformers (4.57) reads this architecture's GGUF files
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    mlp_gated: bool = True  # gate/up/down gated MLP (3 matrices) vs 2
    optimum_task: str = "text-generation-with-past"
    prunable: bool = True  # our prune stage knows its module names
    not_prunable: str = ""  # why not, when prunable is False (the prune stage says it)
    # export/fused_graph.py can write it (GroupQueryAttention; the rotary outside it where the family needs that)
    fusable: bool = True
    qk_norm: bool = False  # per-head RMSNorm on q and k between the projection and the rotary (Qwen3, Gemma 3)
    packed_proj: bool = False  # one qkv_proj and one gate_up_proj module per layer (Phi-3), not q/k/v, gate/up
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    sandwich_norm: bool = False  # RMSNorm on the attention and MLP outputs too, and before the MLP (Gemma 3)
    # per layer, read from the config by the graph writers: sliding window (`layer_types`), a rotary
    # table for local layers (Gemma 3's rope_local_base_freq), no rotary (SmolLM3's `no_rope_layers`)


ARCHITECTURES: dict[str, ArchSpec] = {
    s.hf_name: s
    for s in (
        # Llama 3.2 1B/3B are this entry: rope_scaling "llama3" and a tied head
        ArchSpec("LlamaForCausalLM", "llama"),
        ArchSpec("MistralForCausalLM", "llama"),
        ArchSpec("Qwen2ForCausalLM", "qwen2", attention_bias=True),
        ArchSpec("Qwen3ForCausalLM", "qwen3", qk_norm=True),
        # Phi-3 and Phi-4-mini (partial rotary, LongRoPE): packed qkv_proj / gate_up_proj
        ArchSpec("Phi3ForCausalLM", "phi3", packed_proj=True),
        # SmolLM3: Llama layers, every fourth without rotary (no_rope_layers)
        ArchSpec("SmolLM3ForCausalLM", "smollm3", gguf_loads=False),
        # Gemma 3 text: sliding-window and global layers with their own rotary bases, GeGLU, tied head
        ArchSpec("Gemma3ForCausalLM", "gemma3", qk_norm=True, norm_offset=1.0, embed_scale=True, sandwich_norm=True,
                 prunable=False, not_prunable="the norms around its attention and MLP and its sqrt(hidden) "
                 "embedding scale are not in the pruner's importance measure or its hidden-channel cut"),
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
    names = sorted({s.gguf_name for s in ARCHITECTURES.values()})
    raise ModelSourceError(f"GGUF architecture '{gguf_arch}' is not supported yet (supported: {', '.join(names)}); "
                           "open an issue with the model's name")


def count_parameters(
    *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, vocab_size: int, tie_word_embeddings: bool, attention_bias: bool = False,
    mlp_gated: bool = True, qk_norm: bool = False, sandwich_norm: bool = False,
) -> int:
    """Parameter count of a Llama-style decoder, from its dims alone."""
    q = hidden_size * num_heads * head_dim
    kv = 2 * hidden_size * num_kv_heads * head_dim
    o = num_heads * head_dim * hidden_size
    bias = (num_heads + 2 * num_kv_heads) * head_dim if attention_bias else 0
    mlp = (3 if mlp_gated else 2) * hidden_size * intermediate_size
    norms = (4 if sandwich_norm else 2) * hidden_size + (2 * head_dim if qk_norm else 0)  # RMSNorm weights
    per_layer = q + kv + o + bias + mlp + norms
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
    n = count_parameters(**dims, attention_bias=spec.attention_bias, mlp_gated=spec.mlp_gated, qk_norm=spec.qk_norm,
                         sandwich_norm=spec.sandwich_norm)
    return ModelDims(
        architecture=spec.hf_name, max_context=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
        num_parameters=n, **dims,
    )
