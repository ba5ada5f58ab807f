"""The plain graph written op by op (export/plain_graph.py) is optimum's trace to float rounding, and the streaming
build's int4-qdq engine (TensorRT's W4A16, written from it one weight at a time) is the quantize stage's: the same
INT4 levels and scales per MatMul, the same answers, and a bundle the TensorRT stand-in builds for an Orin."""

from __future__ import annotations

import numpy as np
import pytest

from test_architectures import LLAMA3_ROPE
from test_fused_graph import FAMILIES

WRITTEN = {"llama": dict(), "qwen2": dict(arch="Qwen2ForCausalLM"), "qwen3": FAMILIES["qwen3"],
           "llama-untied-mha": dict(tie=False, heads=4, kv_heads=4),
           "llama3-rope": dict(rope_scaling=LLAMA3_ROPE, max_pos=512),
           "qwen2-yarn": dict(arch="Qwen2ForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                      "original_max_position_embeddings": 128}),
           "mistral": dict(arch="MistralForCausalLM", sliding_window=None),
           # attention scores past 65504 (real Qwen2.5 reaches them: its q/k biases are large): an additive fp16-range
           # mask let masked keys through, the 1.5B's plain graph missed parity by 0.022
           "qwen2-large-scores": dict(arch="Qwen2ForCausalLM", massive=True)}


def _tiny(path, massive: bool = False, **kw):
    """A tiny model whose norm weights and biases are not HF's init (all ones, all zeros): a graph that dropped or
    swapped one would still match with them. `massive`: q/k biases that make some attention scores huge."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model

    src = make_tiny_model(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            if massive and name.endswith(("q_proj.bias", "k_proj.bias")):
                p.mul_(3000.0)
    model.save_pretrained(src)
    return src


def _run(sess, ids, mask, pos, past) -> list[np.ndarray]:
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    for i in range(len(past) // 2):
        feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
    return sess.run(None, feed)


@pytest.mark.parametrize("case", sorted(WRITTEN))
def test_plain_graph_is_optimums_trace(case, tmp_path):
    """A left-padded batch's prefill, then a decode step of 3 tokens on its K/V: logits and present K/V as the
    trace computes them (padded positions excepted: both compute garbage there, differently)."""
    import onnxruntime as ort

    from export import onnx_export
    from export.stream_build import build_graph
    from export.weight_source import SafetensorsSource

    src = _tiny(tmp_path / case, **WRITTEN[case])
    onnx_export.run(src, tmp_path / "trace", onnx_export.ExportOptions(fused=False, greedy_tokens=8, exporter="optimum"))
    gw = build_graph(SafetensorsSource(src), tmp_path / "ours", "plain")
    (tmp_path / "ours").mkdir()
    gw.save(tmp_path / "ours" / "model.onnx")
    sess = {d: ort.InferenceSession(str(tmp_path / d / "model.onnx"), providers=["CPUExecutionProvider"])
            for d in ("trace", "ours")}
    assert [(i.name, i.type) for i in sess["ours"].get_inputs()] == \
        [(i.name, i.type) for i in sess["trace"].get_inputs()]
    assert [o.name for o in sess["ours"].get_outputs()] == [o.name for o in sess["trace"].get_outputs()]
    past_in = [i for i in sess["trace"].get_inputs() if i.name.startswith("past_key_values")]
    b, p, s = 2, 5, 3
    ids = np.random.default_rng(0).integers(3, 300, (b, p + s))
    mask = np.ones((b, p + s), np.int64)
    mask[1, :2] = 0  # row 1 left-padded by two
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    empty = [np.zeros((b, i.shape[1], 0, i.shape[3]), np.float32) for i in past_in]
    out = {}
    for d, se in sess.items():
        first = _run(se, ids[:, :p], mask[:, :p], pos[:, :p], empty)
        out[d] = first, _run(se, ids[:, p:], mask, pos[:, p:], first[1:])
    for step in (0, 1):
        for k, (want, got) in enumerate(zip(out["trace"][step], out["ours"][step])):
            if step == 0:
                want, got = want[0], got[0]  # the padded row's first positions are garbage in both
            elif k > 0:
                want, got = want[:, :, 2:], got[:, :, 2:]
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"step {step} output {k}")


@pytest.mark.parametrize("case", ["phi3", "phi4-mini", "smollm3", "gemma3"])
def test_plain_graph_names_what_it_cannot_write(case, tmp_path):
    """Families it does not write yet are refused by the streaming build before any engine, naming the way out."""
    from conftest import make_tiny_model
    from edge.errors import RecipeError
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path / case, **FAMILIES[case])
    with pytest.raises(RecipeError, match="cannot write int4-qdq for this model .* without --streaming"):
        build(BuildOptions(output=tmp_path / "x.bundle", model=str(src), precisions=("int4-qdq",), streaming=True,
                           skip_eval=True, int4_rounding="minmax"), log=lambda s: None)
    assert not (tmp_path / "x.bundle").exists()


def _dequantized(path) -> dict[str, np.ndarray]:
    """Each weight MatMul's dequantized weight (levels x scales), by MatMul name (the trace's and ours agree)."""
    from export.onnx_weights import GraphWeights

    gw = GraphWeights(path)
    out = {}
    for n in gw.model.graph.node:
        if n.op_type != "DequantizeLinear" or not n.name.endswith("/MatMul/DequantizeLinear"):
            continue
        q, s = gw.array(n.input[0]).astype(np.float32), gw.array(n.input[1]).astype(np.float32)
        block = next((a.i for a in n.attribute if a.name == "block_size"), 0)
        out[n.name] = q * (np.repeat(s, block, axis=0) if block else s)
        assert len(n.input) == 2 or not gw.array(n.input[2]).any()  # symmetric: TensorRT takes zero points of 0
    return out


@pytest.mark.parametrize("rounding, tie", [("minmax", True), ("gptq", True), ("minmax", False)])
def test_streamed_int4_qdq_is_the_quantize_stages_engine(rounding, tie, tmp_path):
    """Same MatMuls in INT4 blocks (INT8 per channel for the head), the same levels and scales as the quantize stage
    makes from the traced fp16 graph, bit for bit (GPTQ's statistics here from the model run block by block, there
    from the traced graph), the same logits to fp16 rounding."""
    import onnx

    from conftest import loaded_plain
    from export import quantize, stream_build
    from export.weight_source import SafetensorsSource
    from test_trt_formats import _kl_top1, _logits

    d = loaded_plain(tmp_path, "optimum", tie=tie)  # untied: the embedding's own INT8 table, dequantized in fp16
    opts = quantize.QuantizeOptions(mode="int4-qdq", int4_rounding=rounding, gptq_samples=8, int4_block_size=16)
    (tmp_path / "today").mkdir()
    today = quantize.run(d["fp32"], d["hf"], tmp_path / "today", opts)
    stats = None
    if rounding == "gptq":
        from export.gptq_statistics import streamed_statistics
        from export.quantize import gptq_feeds
        from export.load import model_dims

        def stats(input_of, widths):
            return streamed_statistics(SafetensorsSource(d["hf"]), list(d["hf"].glob("*.safetensors")),
                                       tmp_path / "streamed", gptq_feeds(d["hf"], opts, model_dims(d["hf"])),
                                       input_of, widths, shared=False)
    got = stream_build.write_quantized(SafetensorsSource(d["hf"]), tmp_path / "streamed", opts, statistics=stats)
    assert got["int4_matmuls"] == today["int4_matmuls"] > 0 and got["int8_matmuls"] == today["int8_matmuls"]
    dq = [sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(tmp_path / d / "model.onnx"),
                                                              load_external_data=False).graph.node)
          for d in ("today", "streamed")]
    assert dq[0] == dq[1]  # no other tensor quantized (the rotary cos/sin tables the op-by-op graph gathers stay float)
    want_w, got_w = _dequantized(tmp_path / "today/model.onnx"), _dequantized(tmp_path / "streamed/model.onnx")
    assert sorted(got_w) == sorted(want_w)
    for name, w in want_w.items():
        np.testing.assert_array_equal(got_w[name], w, err_msg=name)
    ids = np.random.default_rng(0).integers(3, 250, (1, 32))
    kl, top1 = _kl_top1(_logits(tmp_path / "today", ids), _logits(tmp_path / "streamed", ids))
    assert kl < 1e-6 and top1 == 1.0, (kl, top1)  # the graphs differ in op order only (fp16 rounding)
    assert (got.get("gptq_tokens") or 0) > 0 if rounding == "gptq" else "gptq_tokens" not in got


def test_streaming_build_makes_int4_qdq_for_an_orin(fake_gpu, tmp_path, capsys):
    """`edge-export build --streaming --precision int4-qdq` (no fp32 graph, no trace): the engine has the plain graph's
    contract, is evaluated against the block-by-block reference like the others (its golden prompts recorded),
    answers through the runtime on CPU, and the TensorRT stand-in builds it for an Orin (SM 8.7) with the golden
    answers its graph gave."""
    from conftest import make_tiny_model
    from edge.bundle import Bundle
    from edge.cli import main
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path / "m")
    out = tmp_path / "s.bundle"
    bundle = build(BuildOptions(output=out, model=str(src), precisions=("int8-dynamic", "int4-qdq"), streaming=True,
                                eval_samples=4, int8_rounding="minmax", int4_rounding="minmax", int4_block_size=16,
                                max_context=256), log=lambda s: None)
    stage = next(s for s in bundle.manifest.stages if s.name == "quantize-int4-qdq")
    assert stage.metrics["streamed"] and stage.metrics["int4_matmuls"] > 0
    assert not list((tmp_path / "s.bundle.work").glob("export*"))  # no fp32 graph, no trace
    q = bundle.manifest.engine("int4-qdq").quality
    passed, asked = map(int, q["golden_passed"].split("/"))
    assert q["kl_to_fp32"] < 0.05 and q["top1_agreement"] > 0.8 and asked >= 3, q  # a random model: answers may differ
    gen = Generator.from_bundle(Bundle.open(out), engine="int4-qdq", threads=1)
    assert not gen.decoder.io.fused
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    events = list(gen.stream(ids, SamplingConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)))
    assert events[-1].finish_reason == "length"
    assert main(["build-engine", str(out), "--profile", "orin-nano-8gb", "--precision", "int4-qdq"]) == 0, \
        capsys.readouterr().err
    assert "built    engines/trt-int4-qdq-sm87/model.engine" in capsys.readouterr().out
    same, asked = Bundle.open(out).manifest.engine("trt-int4-qdq-sm87").quality["golden_same_as_source"].split("/")
    assert same == asked and int(asked) >= 3


def test_int4_qdq_refuses_an_offset_rounding(tmp_path):
    """int4-qdq's blocks are symmetric: kquant (a scale and an offset per block) is refused, naming the choices,
    by the build before any stage runs (not after the engines before it were made) and by the stage's options."""
    from edge.errors import RecipeError
    from export import quantize
    from export.recipe import BuildOptions

    with pytest.raises(RecipeError, match="symmetric .* gptq or minmax"):
        BuildOptions(output=tmp_path / "x", precisions=("int4-weight", "int4-qdq"), int4_rounding="kquant")
    BuildOptions(output=tmp_path / "x", precisions=("int4-weight",), int4_rounding="kquant")  # int4-weight takes it
    with pytest.raises(RecipeError, match="symmetric .* 'gptq' or 'minmax'"):
        quantize.QuantizeOptions(mode="int4-qdq", int4_rounding="kquant")
