"""The fused (GroupQueryAttention) decoder graph computes what the HF model computes, with a shared KV buffer."""

from __future__ import annotations

import numpy as np
import pytest

from edge.io_contract import FUSED_IO


def _step(session, ids: np.ndarray, past: int, bufs: list, layers: int, at: np.ndarray | None = None) -> np.ndarray:
    """One call: `ids` after `past` cached tokens; K/V written in place into `bufs` (bound as past and present).
    Logits at input positions `at` [batch, k] (default: all)."""
    io = FUSED_IO
    b = session.io_binding()
    b.bind_output(io.logits)  # first, so it is get_outputs()[0]
    b.bind_cpu_input(io.input_ids, ids)
    b.bind_cpu_input(io.seqlens_k, np.array([past + ids.shape[1] - 1], np.int32))
    b.bind_cpu_input(io.total_sequence_length, np.array(past + ids.shape[1], np.int32))
    b.bind_cpu_input(io.logit_positions, np.arange(ids.shape[1])[None, :] if at is None else at)
    for name, out, v in zip(io.past_names(layers), io.present_names(layers), bufs):
        b.bind_ortvalue_input(name, v)
        b.bind_ortvalue_output(out, v)
    session.run_with_iobinding(b)
    return b.get_outputs()[0].numpy()


def test_fused_graph_matches_the_torch_model(tiny_model_dir, tmp_path):
    import onnx
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    from export import fused_graph

    fused_graph.write(tiny_model_dir, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cfg = model.config
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == FUSED_IO.input_names(cfg.num_hidden_layers)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops and "Concat" not in ops

    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 23))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    new_bufs = lambda: [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv_heads, 64, head_dim), np.float32))
                        for _ in range(2 * cfg.num_hidden_layers)]
    # whole prompt in one pass
    got = _step(session, ids, 0, new_bufs(), cfg.num_hidden_layers)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    # prefill 15, then one token at a time into the same buffers: every position's logits agree
    bufs = new_bufs()
    parts = [_step(session, ids[:, :15], 0, bufs, cfg.num_hidden_layers)]
    for t in range(15, 23):
        parts.append(_step(session, ids[:, t:t + 1], t, bufs, cfg.num_hidden_layers))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=1e-4, rtol=1e-3)
    # and a second chunk of several tokens after a cached past (chunked prefill)
    bufs = new_bufs()
    first = _step(session, ids[:, :10], 0, bufs, cfg.num_hidden_layers)
    second = _step(session, ids[:, 10:], 10, bufs, cfg.num_hidden_layers)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), want, atol=1e-4, rtol=1e-3)
    # logit_positions picks rows before the LM head: the last position alone, or any subset in any order
    last = _step(session, ids, 0, new_bufs(), cfg.num_hidden_layers, at=np.array([[22]]))
    assert last.shape == (1, 1, cfg.vocab_size)
    np.testing.assert_allclose(last[0, 0], want[0, 22], atol=1e-4, rtol=1e-3)
    some = _step(session, ids, 0, new_bufs(), cfg.num_hidden_layers, at=np.array([[20, 3, 3]]))
    np.testing.assert_allclose(some[0], want[0, [20, 3, 3]], atol=1e-4, rtol=1e-3)


# one tiny config per family the fused graph writes differently from Llama: q/k norms before an outside rotary
# (Qwen3), packed projections (Phi-3), partial rotary with LongRoPE's two tables (Phi-4-mini: the parity runs past
# original_max_position_embeddings), layers without rotary (SmolLM3), Gemma 3 (q/k norms, sliding and global layers
# with their own rotary bases and linear scaling on the global ones, (1 + weight) norms around attention and MLP,
# scaled embeddings, GeGLU, soft-capped logits)
FAMILIES = {
    "qwen3": dict(arch="Qwen3ForCausalLM", head_dim=16),
    "phi3": dict(arch="Phi3ForCausalLM", tie=False),
    "phi4-mini": dict(arch="Phi3ForCausalLM", partial_rotary_factor=0.75, original_max_position_embeddings=24,
                      rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                                    "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 8.0]}),
    "smollm3": dict(arch="SmolLM3ForCausalLM", layers=4, no_rope_layers=[1, 1, 1, 0]),
    "gemma3": dict(arch="Gemma3ForCausalLM", head_dim=16, layer_types=["sliding_attention", "full_attention"],
                   sliding_window=12, rope_local_base_freq=1000.0, query_pre_attn_scalar=16,
                   final_logit_softcapping=30.0, attn_logit_softcapping=2.0,  # HF applies the first, not the second
                   rope_scaling={"rope_type": "linear", "factor": 8.0}),  # Gemma 3 4B+: global layers scaled
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_graph_of_each_family_matches_torch(family, tmp_path):
    """Whole prompt and token-by-token decode, 40 positions (past the sliding window and LongRoPE's switch), against
    the torch model run the same two ways: HF's own incremental decode is the reference for the second (LongRoPE
    rotates new positions with the long table once the sequence is past the switch; cached keys keep theirs)."""
    import onnx
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from export import fused_graph

    src = make_tiny_model(tmp_path / family, **FAMILIES[family])
    fused_graph.write(src, tmp_path / "g")
    ops = {n.op_type for n in onnx.load(str(tmp_path / "g/model.onnx"), load_external_data=False).graph.node}
    assert "GroupQueryAttention" in ops and "Concat" not in ops
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    c = model.config
    L, T = c.num_hidden_layers, 40
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    session = ort.InferenceSession(str(tmp_path / "g/model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.RandomState(0).randint(0, c.vocab_size, (1, T))
    bufs = lambda: [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, c.num_key_value_heads, 64, head_dim), np.float32))
                    for _ in range(2 * L)]
    with torch.no_grad():
        whole = model(torch.tensor(ids)).logits.numpy()
        r = model(torch.tensor(ids[:, :15]), use_cache=True)
        steps = [r.logits.numpy()]
        for t in range(15, T):
            r = model(torch.tensor(ids[:, t:t + 1]), past_key_values=r.past_key_values, use_cache=True)
            steps.append(r.logits.numpy())
    np.testing.assert_allclose(_step(session, ids, 0, bufs(), L), whole, atol=1e-4, rtol=1e-3)
    cache = bufs()
    got = [_step(session, ids[:, :15], 0, cache, L)] + [_step(session, ids[:, t:t + 1], t, cache, L) for t in range(15, T)]
    np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(steps, 1), atol=1e-4, rtol=1e-3)


def test_fused_graph_refuses_what_it_cannot_express(tmp_path):
    import json

    from edge.errors import ModelSourceError
    from export import fused_graph

    assert fused_graph.supported({"architectures": ["LlamaForCausalLM"]}) is None
    assert fused_graph.supported({"architectures": ["Qwen3ForCausalLM"]}) is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_act": "relu"}))
    with pytest.raises(ModelSourceError, match="activation 'relu'.*plain graph"):
        fused_graph.write(tmp_path, tmp_path / "out")
    dynamic = {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    assert "dynamic NTK" in fused_graph.supported(dynamic)
    embedder = {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}
    assert "bidirectional" in fused_graph.supported(embedder)
