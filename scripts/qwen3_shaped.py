#!/usr/bin/env python
"""A Qwen3-shaped model from a real Qwen2/Qwen2.5 checkpoint's weights, for decode-speed comparisons only.

No Qwen3 checkpoint ships inside a package on the registries this machine reaches, so the fused Qwen3 path
is timed on Qwen2.5's real-size weights in Qwen3's shape: Qwen3ForCausalLM with the same dims, the per-head
q/k RMSNorm weights set to ones, the q/k/v biases dropped (Qwen3 has none). Each decode step computes what a
Qwen3 of that size computes (the q/k norms, the rotary after them, no bias); its answers are not Qwen's and
its quality means nothing.

  bash scripts/real-models.sh "" qwen0.5b
  .venv/bin/edge-export build ~/.cache/edgechat/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
      --precision int8-dynamic --skip-eval -o q25.bundle            # its load stage: the HF folder
  .venv/bin/python scripts/qwen3_shaped.py q25.bundle.work/load q3shaped-hf
  .venv/bin/edge-export build q3shaped-hf --precision int8-dynamic --int8-rounding minmax --skip-eval -o q3.bundle
  .venv/bin/edge-export build q3shaped-hf --precision int8-dynamic --int8-rounding minmax --skip-eval \\
      --no-fused -o q3plain.bundle
  .venv/bin/python scripts/bench_decode.py q3.bundle --engines int8-dynamic --compare plain=q3plain.bundle \\
      --compare qwen2.5=q25.bundle --no-lookup --no-genai --no-llama-cpp --rounds 5
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a Qwen2 / Qwen2.5 Hugging Face folder (e.g. a build's OUT.work/load)")
    ap.add_argument("dst", type=Path, help="the folder to write the Qwen3-shaped model to")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    m = AutoModelForCausalLM.from_pretrained(a.src, dtype=torch.float32)
    c = m.config
    if c.model_type != "qwen2":
        ap.error(f"{a.src} is a {c.model_type!r} model; give a Qwen2 / Qwen2.5 folder")
    cfg = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=False,
                      bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, architectures=["Qwen3ForCausalLM"])
    q3 = Qwen3ForCausalLM(cfg)
    weights = {k: v for k, v in m.state_dict().items() if not k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    missing, unexpected = q3.load_state_dict(weights, strict=False)
    if unexpected or not all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing):
        raise SystemExit(f"error: weights do not map onto Qwen3: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for layer in q3.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    q3.generation_config = m.generation_config
    q3.save_pretrained(a.dst)
    for f in a.src.iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, a.dst / f.name)
    print(f"wrote {a.dst}: Qwen3ForCausalLM, {sum(p.numel() for p in q3.parameters()) / 1e6:.0f}M parameters "
          f"({len(missing)} q/k norm weights set to ones); for speed only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
