"""Every entry of the architecture table, built end to end on a tiny random-init model of that architecture.

For each: the export stage (plain graph, and the fused graph where the entry says it can be written,
each parity-checked against PyTorch: logits, cached decode, 64 greedy tokens), int8-dynamic and
int4-weight quantization, and each shipped engine decoding through the edge runtime with logits
close to the fp32 graph's. The cases carry what distinguishes the family as users meet it: Llama 3's
rope scaling and untied head (and Llama 3.2's tied one), Mistral's sliding window (shorter than the parity
prompts plus their answers, so it engages), Qwen2's attention bias with tied and untied embeddings, Qwen3's
q/k norms, Phi-3's packed projections and Phi-4-mini's partial rotary with LongRoPE, SmolLM3's layers without
rotary, Gemma 3's sliding and global layers with their own rotary bases. On the families whose fused graph
differs from Llama's, the runtime features of the fused graph run too: batched steps, the prompt cache,
the scheduler's batched answers and drafts.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_batched_steps_equal_alone, make_tiny_model
from export.architectures import ARCHITECTURES

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {
    "LlamaForCausalLM": dict(tie=False, rope_scaling=LLAMA3_ROPE),
    "LlamaForCausalLM-3.2": dict(tie=True, rope_scaling=LLAMA3_ROPE, head_dim=16),  # Llama 3.2 1B/3B's shape
    "MistralForCausalLM": dict(tie=False, sliding_window=24),
    "Qwen2ForCausalLM": dict(tie=True),
    "Qwen2ForCausalLM-untied": dict(tie=False),
    "Qwen3ForCausalLM": dict(tie=True, head_dim=16),
    "Phi3ForCausalLM": dict(tie=False),
    # Phi-4-mini: 3/4 of each head rotated, LongRoPE (the parity prompts stay under original_max_position_embeddings,
    # as the plain graph's trace keeps the short table; tests/test_fused_graph.py runs the fused graph past it)
    "Phi3ForCausalLM-phi4-mini": dict(tie=True, partial_rotary_factor=0.75, original_max_position_embeddings=256,
                                      rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                                                    "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 8.0]}),
    "SmolLM3ForCausalLM": dict(tie=True, layers=4, no_rope_layers=[1, 1, 1, 0]),
    "Gemma3ForCausalLM": dict(tie=True, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=24, rope_local_base_freq=1000.0, query_pre_attn_scalar=16),
}
# the families whose fused graph is not Llama's (rotary outside GroupQueryAttention, packed projections, ...)
FUSED_FEATURES = ["Qwen3ForCausalLM", "Phi3ForCausalLM", "Phi3ForCausalLM-phi4-mini", "SmolLM3ForCausalLM",
                  "Gemma3ForCausalLM"]


def test_every_architecture_in_the_table_has_a_case():
    assert set(ARCHITECTURES) == {c.split("-")[0] for c in CASES}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> its bundle (fp32, int8-dynamic, int4-weight), built once for this module's tests."""
    from export.recipe import BuildOptions, build

    bundles = {}

    def get(case: str):
        if case not in bundles:
            tmp = tmp_path_factory.mktemp(case)
            src = make_tiny_model(tmp / case, arch=case.split("-")[0], **CASES[case])
            bundles[case] = build(BuildOptions(output=tmp / "b.bundle", model=str(src), max_context=256, skip_eval=True,
                                               precisions=("fp32", "int8-dynamic", "int4-weight"), calibration_samples=2),
                                  log=lambda s: None)
        return bundles[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_architecture_builds_and_runs(case, built):
    from edge.bundle import Bundle
    from edge.backends.onnxruntime import OrtDecoder

    arch = case.split("-")[0]
    bundle = built(case)
    export = next(s for s in bundle.manifest.stages if s.name == "export")
    assert export.metrics["greedy_tokens_identical"]  # the plain graph vs PyTorch (a ParityError otherwise)
    assert export.metrics["max_abs_logit_diff"] <= 1e-3
    fused = export.metrics["fused"]
    assert fused["written"] == ARCHITECTURES[arch].fusable, fused
    if fused["written"]:
        assert fused["greedy_tokens_identical"] and fused["max_abs_logit_diff"] <= 1e-3
    b = Bundle.open(bundle.root)
    ids = list(range(3, 40))
    logits = {}
    for e in b.manifest.engines:
        dec = OrtDecoder.from_entry(b, b.manifest.engine(e.name), threads=1)
        logits[e.name] = dec.forward(np.array([ids]), dec.new_cache(capacity=len(ids)), last_only=False)[0]
        assert np.isfinite(logits[e.name]).all()
        assert e.fingerprint.variant == ("fused" if fused["written"] and e.name != "fp32" else "plain")
    ref = logits["fp32"]
    for name in ("int8-dynamic", "int4-weight"):
        corr = np.corrcoef(logits[name].ravel(), ref.ravel())[0, 1]
        assert corr > (0.99 if name == "int8-dynamic" else 0.9), f"{case} {name}: correlation {corr:.4f}"


@pytest.mark.parametrize("case", FUSED_FEATURES)
def test_fused_runtime_features_on_the_family(case, built):
    """The fused int8 engine of the family serves as the Llama-family one does: batched steps equal each row
    alone, a prompt that starts like an earlier one reuses its K/V and gets the uncached numbers bit for bit,
    the scheduler's batched answers equal single-user answers, and drafts leave greedy answers unchanged."""
    from edge.bundle import Bundle
    from edge.decode.cache import SharedBatchCache
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.decode.scheduler import Scheduler
    from edge.decode.speculative import RowSpeculator, SpecStats, lookup_draft

    gen = Generator.from_bundle(Bundle.open(built(case).root), engine="int8-dynamic", threads=1)
    dec = gen.decoder
    assert dec.io.fused
    # batched decode steps: every row's logits equal the row decoded alone (rows of different lengths)
    assert_batched_steps_equal_alone(dec, [list(range(10, 13)), list(range(20, 47)), list(range(30, 35))],
                                     [40, 41, 42], capacity=64, atol=1e-5)
    # prompt cache: spans up to a prefill boundary are copied, the rest prefilled; bit for bit the uncached prefill
    bc = SharedBatchCache(dec, slots=5, capacity=64, prompt_cache_bytes=1 << 22)
    first = list(range(10, 110))
    bc.prefill_rows([first])
    bc.remember(0, first)
    bc.remove([0])
    prompts = [first[:70] + [60, 61], first + [63], [5, 6, 7], list(range(200, 230))]  # 2 cached starts, 2 new
    got = bc.prefill_rows(prompts)  # the two new prompts' first span in one batched call
    assert bc.reused_rows == [64, 64, 0, 0] and bc.prompts.hits == 2
    for i, p in enumerate(prompts):
        alone = dec.new_cache(capacity=128)
        np.testing.assert_array_equal(got[i], dec.prefill(p, alone)[0], err_msg=f"prompt {i}")
    # the scheduler: answers that share steps equal the single-user answers
    chats = ["Hello!", "What is the capital of Japan?", "Tell me a fun fact about octopuses and the ocean."]
    ids = [gen.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in chats]
    cfgs = [gen.sampling(max_new_tokens=12 + 5 * i, ignore_eos=True) for i in range(len(ids))]
    alone = [gen.complete(p, c)[1].token_ids for p, c in zip(ids, cfgs)]
    sched = Scheduler(gen, max_batch=3, max_queue=4).start()
    try:
        reqs = [sched.submit(p, c) for p, c in zip(ids, cfgs)]
        assert [r.answer(timeout=120)[1].token_ids for r in reqs] == alone
    finally:
        sched.stop()
    # drafts (prompt lookup, 4 tokens at every step): checked by the target, the greedy answer unchanged
    cfg = SamplingConfig(max_new_tokens=30, ignore_eos=True)
    prompt = gen.tokenizer.encode_chat([{"role": "user", "content": "Hello! How are you doing today? Hello! How"}])
    want = list(gen.stream(prompt, cfg, speculator=None))[-1].token_ids
    stats = SpecStats()
    speculator = RowSpeculator.fixed(lambda seq, k: (want + [0] * k)[len(seq) - len(prompt):][:k], 4)
    speculator.stats = stats
    assert list(gen.stream(prompt, cfg, speculator=speculator))[-1].token_ids == want
    assert stats.drafted > 0 and stats.accepted > 0
    speculator = RowSpeculator.fixed(lookup_draft, 4)
    assert list(gen.stream(prompt, cfg, speculator=speculator))[-1].token_ids == want


def test_phi3_packed_modules_prune_as_their_parts(tmp_path):
    """Phi-3 is Llama with q/k/v and gate/up packed into one module each: a Phi-3 model and the Llama model with
    the same weights unpacked, pruned with the same importance to the same shape (fewer KV groups, hidden channels,
    MLP channels and layers), compute the same logits, so the packed rows were cut where their parts were."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from edge.errors import RecipeError
    from export import prune

    phi = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "phi3", arch="Phi3ForCausalLM", tie=False,
                                                               layers=3), dtype=torch.float32).eval()
    c = phi.config
    llama = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=False)).eval()
    sd, nq, nkv, inter = {}, c.hidden_size, c.num_key_value_heads * c.hidden_size // c.num_attention_heads, c.intermediate_size
    for k, v in phi.state_dict().items():
        if "qkv_proj" in k:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.split([nq, nkv, nkv])):
                sd[k.replace("qkv_proj", name)] = part
        elif "gate_up_proj" in k:
            sd[k.replace("gate_up_proj", "gate_proj")], sd[k.replace("gate_up_proj", "up_proj")] = v.split([inter, inter])
        else:
            sd[k] = v
    llama.load_state_dict(sd)
    ids = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        np.testing.assert_allclose(phi(ids).logits.numpy(), llama(ids).logits.numpy(), atol=1e-5)
    imp = prune.measure(phi, [list(range(3, 60)), list(range(100, 140))])
    shape = prune.Shape(layers=[0, 2], kv_groups=1, hidden=48, intermediate=64)
    small_phi, small_llama = prune.prune_state(phi, imp, shape), prune.prune_state(llama, imp, shape)
    assert small_phi.model.layers[0].self_attn.qkv_proj.weight.shape == ((2 + 1 + 1) * 16, 48)
    with torch.no_grad():
        np.testing.assert_allclose(small_phi(ids).logits.numpy(), small_llama(ids).logits.numpy(), atol=1e-5)
    # Phi-4-mini's LongRoPE factors are checked against hidden_size / heads: that ratio must stay
    longrope = dict(CASES["Phi3ForCausalLM-phi4-mini"])
    phi4 = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "phi4", arch="Phi3ForCausalLM", **longrope),
                                                dtype=torch.float32).eval()
    imp4 = prune.measure(phi4, [list(range(3, 60))])
    opts = prune.PruneOptions(target_ratio=0.6, kv_groups=1, hidden_ratio=0.75, multiple=16)
    with pytest.raises(RecipeError, match="LongRoPE.*drop_layers"):
        prune.solve_shape(phi4.config, imp4, opts, 0.6)
    ok = prune.solve_shape(phi4.config, imp4, prune.PruneOptions(target_ratio=0.7, drop_layers=1, multiple=16), 0.7)
    assert prune.prune_state(phi4, imp4, ok).config.rope_scaling["type"] == "longrope"


def _write_gguf(hf_dir, dst, arch: str, **extra_kv):
    """A tiny checkpoint as an F32 GGUF the way llama.cpp's convert_hf_to_gguf.py names it for `arch` ("phi3":
    packed attn_qkv and ffn_up; "gemma3": q/k norms, four norms a block, norm weights stored + 1), vocabulary
    tokens only (the model, not the tokenizer, is what this checks)."""
    import json

    import gguf
    from safetensors.numpy import load_file
    from tiny_gguf import write_out

    cfg = json.loads((hf_dir / "config.json").read_text())
    st = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(dst), arch)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("rope.dimension_count", int(head_dim * cfg.get("partial_rotary_factor", 1.0))),
                       *extra_kv.items()):
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_file_type(0)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm" if arch == "gemma3" else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    plus = 1.0 if arch == "gemma3" else 0.0  # llama.cpp stores Gemma's norm weights as the (1 + w) they scale by

    def tensor(name: str, t):
        w.add_tensor(name, (t + plus if "norm" in name else t).astype(np.float32))

    w.add_tensor("token_embd.weight", st["model.embed_tokens.weight"].astype(np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            if p + hf + ".weight" in st:
                tensor(f"blk.{i}.{g}.weight", st[p + hf + ".weight"])
    tensor("output_norm.weight", st["model.norm.weight"])
    if "lm_head.weight" in st:  # an untied head
        w.add_tensor("output.weight", st["lm_head.weight"].astype(np.float32))
    return write_out(w, dst)


@pytest.mark.parametrize("case", ["Phi3ForCausalLM", "Gemma3ForCausalLM"])
def test_gguf_of_the_family_loads_as_the_same_model(case, tmp_path):
    """A GGUF named as llama.cpp names the family (phi3, gemma3) is recognised before any weight loads (the planner's
    dims read from its metadata) and transformers reads it back into the same network: same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.load import check_architecture
    from export.model_source import describe, resolve

    cfg = CASES[case]
    if case == "Gemma3ForCausalLM":  # what transformers' GGUF reader takes from a gemma3 file: Gemma 3's defaults
        cfg = dict(cfg, layer_types=None, query_pre_attn_scalar=256, rope_local_base_freq=10000.0)
    src = make_tiny_model(tmp_path / case, arch=case, **cfg)
    extra = {"attention.sliding_window": 24} if case == "Gemma3ForCausalLM" else {}
    path = _write_gguf(src, tmp_path / "m.gguf", ARCHITECTURES[case].gguf_name, **extra)
    ref, dims = describe(str(path))
    assert dims.architecture == case and dims.num_layers == 2
    check_architecture(resolve(str(path)))
    ids = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits.numpy()
        got = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()(ids)
    np.testing.assert_allclose(got.logits.numpy(), want, atol=1e-4)


def test_a_gguf_transformers_would_misread_is_refused_before_loading(tmp_path):
    """Phi-4-mini's GGUF (partial rotary, LongRoPE factors as tensors): transformers 4.57 reads phi3 files as
    fully rotated without the factors, a different network; Gemma 3 4B+'s rotary scaling it drops too;
    SmolLM3's it does not read at all; an architecture
    outside the table is named with the supported list. Each one line, before any weight is read."""
    from edge.errors import ModelSourceError
    from export.load import check_architecture
    from export.model_source import resolve

    src = make_tiny_model(tmp_path / "phi4", arch="Phi3ForCausalLM", **CASES["Phi3ForCausalLM-phi4-mini"])
    with pytest.raises(ModelSourceError, match="rotates 12 of each head's 16 dims"):
        check_architecture(resolve(str(_write_gguf(src, tmp_path / "phi4.gguf", "phi3"))))
    gemma = make_tiny_model(tmp_path / "gemma", arch="Gemma3ForCausalLM", **CASES["Gemma3ForCausalLM"])
    scaled = _write_gguf(gemma, tmp_path / "gemma.gguf", "gemma3", **{"rope.scaling.factor": 8.0})
    with pytest.raises(ModelSourceError, match="scales its rotary by 8.*Hugging Face folder"):
        check_architecture(resolve(str(scaled)))
    smol = make_tiny_model(tmp_path / "smol", arch="SmolLM3ForCausalLM", **CASES["SmolLM3ForCausalLM"])
    with pytest.raises(ModelSourceError, match="cannot read 'smollm3' GGUF.*Hugging Face folder"):
        check_architecture(resolve(str(_write_gguf(smol, tmp_path / "smol.gguf", "smollm3"))))
    with pytest.raises(ModelSourceError, match=r"'mamba' is not supported yet \(supported: gemma3, llama, phi3"):
        check_architecture(resolve(str(_write_gguf(smol, tmp_path / "mamba.gguf", "mamba"))))


def test_an_architecture_outside_the_table_is_refused_before_any_weight_loads(tmp_path):
    """One line naming the architecture and the supported ones; the weights file is garbage, so an attempt to read
    it would fail differently."""
    import json

    from edge.errors import ModelSourceError
    from export import load
    from export.model_source import resolve

    (tmp_path / "m").mkdir()
    (tmp_path / "m/config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    (tmp_path / "m/model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ModelSourceError) as e:
        load.run(resolve(str(tmp_path / "m")), tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and "'MambaForCausalLM' is not supported yet" in msg
    assert all(name in msg for name in ARCHITECTURES)


def test_docs_list_every_architecture_with_its_flags():
    """docs/models.md's table says for each entry what its flags say: fused graph, prunable, GGUF."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs/models.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:5]]
            for line in doc.splitlines() if line.startswith("| `")}
    assert set(rows) == set(ARCHITECTURES)
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    for name, spec in ARCHITECTURES.items():
        fused, prunable, gguf = rows[name]
        assert fused == yes(spec.fusable) and prunable.split(" ")[0] == yes(spec.prunable), name
        assert gguf.startswith(f"{yes(spec.gguf_loads)} (`{spec.gguf_name}`"), name
