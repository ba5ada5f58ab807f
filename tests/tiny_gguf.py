"""Write a tiny Hugging Face Llama checkpoint as an F32 GGUF that llama.cpp loads (what convert_hf_to_gguf.py
does for Llama, reduced to what the tests' models use): the same weights, so llama.cpp's logits on the same
token ids must match the fp32 ONNX graph's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary halves -> llama.cpp's interleaved pairs (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_dir: Path, dst: Path) -> Path:
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    st = load_file(str(hf_dir / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_file_type(0)
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    added = {t["id"]: t["content"] for t in tj["added_tokens"]}
    tokens = [added.get(i, t) for t, i in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_vocab_size(len(tokens))
    names = {"self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", st["model.embed_tokens.weight"].astype(np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(st[p + "self_attn.q_proj.weight"], heads).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(st[p + "self_attn.k_proj.weight"], kv).astype(np.float32))
        for hf, g in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", st[p + hf + ".weight"].astype(np.float32))
    w.add_tensor("output_norm.weight", st["model.norm.weight"].astype(np.float32))
    if not cfg.get("tie_word_embeddings"):
        w.add_tensor("output.weight", st["lm_head.weight"].astype(np.float32))
    return write_out(w, dst)


def write_out(w, dst: Path) -> Path:
    """A GGUFWriter's header, metadata and tensors written to `dst`, the file closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
