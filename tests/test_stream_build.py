"""The streaming build: weights read one tensor at a time from the checkpoint (safetensors, sharded or not, and
GGUF) equal what transformers loads, and the quantized fused graph written straight from them is the graph the
quantize stage makes from the fp32 fused graph (same nodes, same tensors, same logits)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_fused_graph import FAMILIES

CASES = {"llama": dict(), "qwen2": dict(arch="Qwen2ForCausalLM"), **FAMILIES}


def _state_dict(folder, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    return model, {k: v.numpy() for k, v in model.state_dict().items()}


def test_safetensors_source_reads_what_transformers_loads(tiny_model_dir, tmp_path):
    from export.weight_source import SafetensorsSource

    model, want = _state_dict(tiny_model_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")  # several shards + an index
    assert (tmp_path / "sharded/model.safetensors.index.json").is_file()
    for folder in (tiny_model_dir, tmp_path / "sharded"):
        src = SafetensorsSource(folder)
        for name, value in want.items():  # lm_head.weight included: the tied head is the embedding
            got = src.get(name)
            assert got.dtype == np.float32 and np.array_equal(got, value), name
            assert src.dims_shape(name) == value.shape


def test_bf16_checkpoint_is_widened_one_tensor_at_a_time(tiny_model_dir, tmp_path):
    import torch

    from export.weight_source import SafetensorsSource

    model, _ = _state_dict(tiny_model_dir)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    src = SafetensorsSource(tmp_path / "bf16")
    w = model.model.layers[0].mlp.up_proj.weight.detach().float().numpy()
    assert np.array_equal(src.get("model.layers.0.mlp.up_proj.weight"), w)


def test_gguf_source_reads_what_transformers_loads(tiny_model_dir, tmp_path):
    """llama.cpp's interleaved q/k rows are permuted back, names mapped, as transformers does."""
    from export.weight_source import GGUFSource
    from tiny_gguf import write_llama_gguf

    write_llama_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    _, want = _state_dict(tmp_path, gguf_file="tiny.gguf")
    src = GGUFSource(tmp_path / "tiny.gguf")
    assert src.config["architectures"] == ["LlamaForCausalLM"]
    for name, value in want.items():
        assert np.array_equal(src.get(name), value), name


def test_missing_tensor_is_named(tiny_model_dir):
    from edge.errors import ModelSourceError
    from export.weight_source import SafetensorsSource

    with pytest.raises(ModelSourceError, match="no tensor 'model.layers.9.mlp.up_proj.weight'"):
        SafetensorsSource(tiny_model_dir).get("model.layers.9.mlp.up_proj.weight")


def _graph(path):
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    return m, {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


@pytest.mark.parametrize("mode", ["int8-dynamic", "int4-weight"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_engine_is_the_quantize_stages_graph(case, mode, tmp_path):
    """Same nodes in the same order, same initializers bit for bit, same logits: the streamed graph is today's."""
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from export import fused_graph, quantize, stream_build
    from export.load import META
    from export.weight_source import SafetensorsSource
    from test_fused_graph import _step

    src = make_tiny_model(tmp_path / case, **CASES[case])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    (src / META).write_text(json.dumps({"num_parameters": sum(p.numel() for p in model.parameters())}))  # as loaded
    fused_graph.write(src, tmp_path / "fp32", model=model)  # the export stage's way: from the torch model
    opts = quantize.QuantizeOptions(mode=mode, int8_rounding="minmax", int4_rounding="minmax")
    (tmp_path / "today").mkdir()
    quantize.run(tmp_path / "fp32", src, tmp_path / "today", opts)
    metrics = stream_build.write_quantized(SafetensorsSource(src), tmp_path / "streamed", opts)
    assert metrics["streamed"] and metrics["size_bytes"] > 0
    (want_m, want), (got_m, got) = _graph(tmp_path / "today/model.onnx"), _graph(tmp_path / "streamed/model.onnx")
    assert [(n.op_type, n.name, list(n.input)) for n in got_m.graph.node] == \
        [(n.op_type, n.name, list(n.input)) for n in want_m.graph.node]
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ids = np.random.RandomState(0).randint(0, c.vocab_size, (1, 12))
    logits = []
    for d in ("today", "streamed"):
        s = ort.InferenceSession(str(tmp_path / d / "model.onnx"), providers=["CPUExecutionProvider"])
        bufs = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, c.num_key_value_heads, 32, head_dim), np.float32))
                for _ in range(2 * c.num_hidden_layers)]
        logits.append(_step(s, ids, 0, bufs, c.num_hidden_layers))
    np.testing.assert_array_equal(logits[0], logits[1])


def test_streaming_refuses_what_it_cannot_make(tiny_model_dir, tmp_path):
    from edge.errors import RecipeError
    from export import quantize, stream_build
    from export.weight_source import SafetensorsSource

    src = SafetensorsSource(tiny_model_dir)
    for opts, why in ((quantize.QuantizeOptions(mode="int8-qdq"), "not int8-qdq"),
                      (quantize.QuantizeOptions(mode="int4-weight", int4_rounding="minmax", int4_budget_mb=1.0),
                       "no int4 byte budget"),
                      (quantize.QuantizeOptions(mode="int8-dynamic"), "gptq rounding needs")):
        with pytest.raises(RecipeError, match=why):
            stream_build.write_quantized(src, tmp_path / "x", opts)


def test_streaming_build_is_a_bundle_that_answers(tiny_model_dir, tmp_path):
    """`edge-export build --streaming`: load (no weight loaded), one quantize stage per engine, package; each
    engine is the streamed graph and answers a chat through the runtime."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from export.recipe import BuildOptions, build

    out = tmp_path / "s.bundle"
    bundle = build(BuildOptions(output=out, model=str(tiny_model_dir), precisions=("int8-dynamic", "int4-weight"),
                                streaming=True, skip_eval=True, int8_rounding="minmax", int4_rounding="minmax",
                                max_context=256), log=lambda s: None)
    names = [s.name for s in bundle.manifest.stages]
    assert names == ["load", "quantize-int8-dynamic", "quantize-int4-weight"]
    assert all(s.memory["peak_rss_bytes"] for s in bundle.manifest.stages)
    assert not list((tmp_path / "s.bundle.work").glob("export*"))  # no fp32 graph was written
    for s in bundle.manifest.stages[1:]:  # each engine against the fp32 model run block by block
        ref = s.metrics["reference"]
        assert ref["prompts"] == 3 and 0 <= ref["kl_to_reference"] < 0.01 and ref["top1_agreement"] > 0.9, ref
    for engine in ("int8-dynamic", "int4-weight"):
        gen = Generator.from_bundle(Bundle.open(out), engine=engine, threads=1)
        assert gen.decoder.io.fused
        ids = gen.tokenizer.encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        events = list(gen.stream(ids, SamplingConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)))
        assert events[-1].finish_reason == "length"  # six tokens decoded, EOS ignored


def test_streaming_build_options_are_checked_up_front(tiny_model_dir, tmp_path):
    from edge.errors import RecipeError
    from export.prune import PruneOptions
    from export.recipe import BuildOptions

    base = dict(output=tmp_path / "x", model=str(tiny_model_dir), streaming=True, skip_eval=True,
                int8_rounding="minmax", int4_rounding="minmax")
    for change, why in (({"precisions": ("int8-qdq",)}, "not int8-qdq"), ({"prune": PruneOptions()}, "no prune"),
                        ({"kv_cache": "int8"}, "float K/V cache")):
        with pytest.raises(RecipeError, match=why):
            BuildOptions(**base | change)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "phi3", "phi4-mini", "smollm3"])
def test_block_by_block_reference_is_the_hf_models_logits(case, tmp_path):
    """The bounded-memory parity reference (one decoder block's weights at a time) equals the whole model's run."""
    import torch

    from conftest import make_tiny_model
    from export.stream_reference import reference_logits
    from export.weight_source import SafetensorsSource

    src = make_tiny_model(tmp_path / case, **CASES[case])
    model, _ = _state_dict(src)
    prompts = [list(range(3, 40)), [5, 9, 11]]
    got = reference_logits(SafetensorsSource(src), prompts)
    for ids, g in zip(prompts, got):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-4)


def test_the_cli_builds_with_streaming(tiny_model_dir, tmp_path):
    from conftest import run_cli

    out = tmp_path / "c.bundle"
    r = run_cli("export.cli", "build", str(tiny_model_dir), "-o", str(out), "--streaming", "--skip-eval",
                "--int8-rounding", "minmax", "--int4-rounding", "minmax", "--precision", "int4-weight")
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").is_file()
    r = run_cli("export.cli", "build", str(tiny_model_dir), "-o", str(tmp_path / "d.bundle"), "--streaming",
                "--precision", "int8-qdq")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--streaming" in r.stderr
    assert not (tmp_path / "d.bundle.work").exists()


def _evaluated(bundle) -> dict:
    return next(s for s in bundle.manifest.stages if s.name == "evaluate").metrics


def test_streaming_build_evaluates_as_the_normal_build(tiny_model_dir, tmp_path):
    """--streaming without --skip-eval: the fp32 reference is the model run one block at a time (no fp32 graph),
    each engine scored alone against its logits on disk; the metrics are the normal build's (its reference is the
    fp32 ONNX graph: the two differ by float rounding only)."""
    from export.recipe import BuildOptions, build

    got = {}
    for streaming in (False, True):
        b = build(BuildOptions(output=tmp_path / f"{streaming}.bundle", model=str(tiny_model_dir), streaming=streaming,
                               precisions=("int8-dynamic", "int4-weight"), int8_rounding="minmax",
                               int4_rounding="minmax", max_context=256, eval_samples=4), log=lambda s: None, quiet=True)
        got[streaming] = _evaluated(b)
        if streaming:
            assert [s.name for s in b.manifest.stages] == ["load", "quantize-int8-dynamic", "quantize-int4-weight",
                                                           "evaluate"]
            assert not list((tmp_path / "True.bundle.work").glob("export*"))  # still no fp32 graph
            # the quantize stages leave the comparison with the reference to the evaluate stage (no third read of
            # the checkpoint per engine)
            assert not any("reference" in s.metrics for s in b.manifest.stages[1:3])
            assert not list((tmp_path / "True.bundle.work").rglob("reference-logits*"))  # removed at the end
            shipped = {e.name: e.quality for e in b.manifest.engines}
            assert shipped["int8-dynamic"]["kl_to_fp32"] == got[True]["engines"]["int8-dynamic"]["kl_to_fp32"]
    normal, streamed = got[False]["engines"], got[True]["engines"]
    assert sorted(normal) == sorted(streamed) == ["fp32", "int4-weight", "int8-dynamic"]
    assert "block" in streamed["fp32"]["scored_with"] and "golden_passed" not in streamed["fp32"]
    for name in ("int8-dynamic", "int4-weight"):
        n, s = normal[name], streamed[name]
        assert s["golden_passed"] == n["golden_passed"] and s["decode_tok_s"] > 0
        for q, r in ((n, s), (n["prose"], s["prose"])):
            assert r["top1_agreement"] == pytest.approx(q["top1_agreement"], abs=1e-3)
            assert r["perplexity"] == pytest.approx(q["perplexity"], rel=1e-5)
            assert r["kl_to_fp32"] == pytest.approx(q["kl_to_fp32"], rel=1e-3, abs=1e-7)
            assert r["kl_to_fp32"] > 0


def test_streaming_build_reads_a_gguf(tiny_model_dir, tmp_path):
    """A GGUF as the streaming build's source: linked by the load stage (config and tokenizer from its metadata, the
    tokenizer checked against the GGUF's own), each weight dequantized alone; the engines are the ones streamed from
    the Hugging Face folder the normal load stage makes of the same file."""
    from export import load, stream_build
    from export.model_source import resolve
    from export.recipe import BuildOptions, build
    from export.weight_source import SafetensorsSource
    from tiny_gguf import write_llama_gguf

    (tmp_path / "src").mkdir()
    gguf = write_llama_gguf(tiny_model_dir, tmp_path / "src" / "tiny.gguf")
    template = tmp_path / "chat.jinja"  # the tiny GGUF carries none
    template.write_text("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    b = build(BuildOptions(output=tmp_path / "g.bundle", model=str(gguf), streaming=True, skip_eval=True,
                           precisions=("int8-dynamic",), int8_rounding="minmax", max_context=256,
                           chat_template=str(template)), log=lambda s: None, quiet=True)
    loaded = b.manifest.stages[0]
    assert loaded.metrics["streamed"] and "tokenizer_check" in loaded.metrics, loaded.metrics  # as the normal load records it
    assert not list((tmp_path / "g.bundle.work" / "load").glob("*.safetensors"))  # nothing dequantized to disk
    hf = tmp_path / "hf"
    load.run(resolve(str(gguf)), hf, chat_template=template.read_text())  # the normal load stage: dequantized by transformers
    opts = b.manifest.stages[1].params
    from export.quantize import QuantizeOptions

    qopts = QuantizeOptions(mode="int8-dynamic", int8_rounding="minmax")
    stream_build.write_quantized(SafetensorsSource(hf), tmp_path / "from-hf", qopts)
    (_, want), (_, got) = _graph(tmp_path / "from-hf/model.onnx"), _graph(b.root / "engines/int8-dynamic/model.onnx")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want), opts


def test_streaming_load_refuses_what_it_cannot_read(tmp_path):
    from edge.errors import RecipeError
    from export import stream_build
    from export.model_source import resolve

    with pytest.raises(RecipeError, match="download it first"):
        stream_build.load(resolve("llama-3-8b"), tmp_path / "x")


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_streamed_gptq_rounds_as_the_quantize_stage(case, tmp_path):
    """GPTQ under --streaming: statistics collected one decoder block at a time with that block's weights read from
    the checkpoint (no model loaded in torch), then each weight rounded as it is saved: the same levels, scales and
    zero points as the quantize stage's GPTQ on the fp32 graph's statistics (ONNX Runtime, the whole graph), bit
    for bit on these models; one pass over the calibration texts per engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from export import onnx_export, quantize, stream_build
    from export.load import META

    src = make_tiny_model(tmp_path / case, **CASES[case])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    (src / META).write_text(json.dumps({"num_parameters": sum(p.numel() for p in model.parameters()),
                                        "eos_token_ids": [2]}))
    onnx_export.run(src, tmp_path / "fp32", onnx_export.ExportOptions(greedy_tokens=4))
    for mode in ("int8-dynamic", "int4-weight"):
        opts = quantize.QuantizeOptions(mode=mode, gptq_samples=8, gptq_tokens=64)
        (tmp_path / f"{mode}-today").mkdir()
        today = quantize.run(tmp_path / "fp32" / onnx_export.FUSED_DIR, src, tmp_path / f"{mode}-today", opts)
        metrics = stream_build._engine(src, tmp_path / f"{mode}-streamed", opts)
        assert metrics["gptq_statistics"].startswith("by block") and metrics["gptq_passes"] == 1, metrics
        assert metrics["gptq_tokens"] == today["gptq_tokens"] > 0  # the same calibration texts
        (_, want), (_, got) = _graph(tmp_path / f"{mode}-today/model.onnx"), _graph(tmp_path / f"{mode}-streamed/model.onnx")
        assert sorted(got) == sorted(want)
        for name in want:
            assert np.array_equal(got[name], want[name]), (mode, name)


def test_streaming_build_with_gptq_collects_the_statistics_once(tiny_model_dir, tmp_path):
    """The recipe's streaming build rounds by GPTQ by default: the first engine collects the statistics block by
    block and keeps them in the build's work folder; the next read them back (no second pass), the plain graph's
    int4-qdq too, whose MatMul inputs have other names than the fused graph's (each input is kept under the first
    Linear module reading it)."""
    from export.recipe import BuildOptions, build

    b = build(BuildOptions(output=tmp_path / "q.bundle", model=str(tiny_model_dir), streaming=True, skip_eval=True,
                           precisions=("int8-dynamic", "int4-weight", "int4-qdq"), gptq_samples=4, max_context=256),
              log=lambda s: None, quiet=True)
    q8, q4, qdq = (s.metrics for s in b.manifest.stages[1:4])
    assert q8["int8_rounding"] == "gptq" and q4["int4_rounding"] == "gptq" and qdq["int4_rounding"].startswith("gptq")
    assert q8["gptq_passes"] == 1 and q8["gptq_statistics_computed"] > 0, q8
    for m in (q4, qdq):
        assert m["gptq_passes"] == 0 and m["gptq_statistics_loaded"] > 0, m
        assert m["reference"]["kl_to_reference"] < 0.01


def test_streaming_refuses_block_by_block_work_on_mixed_attention_blocks(tmp_path):
    """Gemma 3's sliding-window and global blocks cannot run one at a time with one set of arguments yet: the
    evaluate stage's reference and GPTQ's statistics are refused after the load stage, before any engine is
    written, naming the flags that build it; with them the build goes through."""
    from conftest import make_tiny_model
    from edge.errors import RecipeError
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path / "gemma3", **CASES["gemma3"])
    base = dict(model=str(src), streaming=True, precisions=("int8-dynamic",), max_context=256)
    with pytest.raises(RecipeError, match="differ in attention type.*add --skip-eval --int8-rounding minmax"):
        build(BuildOptions(output=tmp_path / "a.bundle", **base), log=lambda s: None, quiet=True)
    assert not (tmp_path / "a.bundle.work" / "quantize-int8-dynamic").exists()
    b = build(BuildOptions(output=tmp_path / "b.bundle", skip_eval=True, int8_rounding="minmax", **base),
              log=lambda s: None, quiet=True)
    assert b.manifest.stages[1].metrics["reference"]["skipped"]


def test_streamed_int4_weight_rounds_with_the_chosen_gptq_damping(tmp_path, monkeypatch):
    """int4_gptq_damp reaches the streaming build's int4-weight GPTQ (it kept GPTQ's own default while the quantize
    stage used the option, so streamed and quantize-stage engines differed once the default moved)."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from export import gptq, quantize, stream_build
    from export.load import META

    src = make_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    (src / META).write_text(json.dumps({"num_parameters": sum(p.numel() for p in model.parameters()),
                                        "eos_token_ids": [2]}))
    seen: list[tuple[int, float | None]] = []
    real = gptq.gptq_block_quant
    monkeypatch.setattr(gptq, "gptq_block_quant",
                        lambda w, h, bits, *a, **k: seen.append((bits, k.get("damp"))) or real(w, h, bits, *a, **k))
    stream_build._engine(src, tmp_path / "q", quantize.QuantizeOptions(mode="int4-weight", gptq_samples=4, gptq_tokens=64,
                                                                      int4_gptq_damp=0.05))
    assert {d for b, d in seen if b == 4} == {0.05}
