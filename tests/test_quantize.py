"""Quantized graphs, the QDQ placement rules, evaluation metrics, calibration data errors."""

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edge.errors import DataError
from export.data import load_chats, load_jsonl
from export.evaluate import summarize, token_metrics


def _graph(bundle, name):
    return onnx.load(str(bundle.path(bundle.manifest.engine(name).file)))


def test_int8_graphs_are_smaller_and_run(tiny_bundle):
    q = tiny_bundle.manifest
    fp32 = q.engine_bytes("fp32")  # graphs and their external weights
    # tiny model: graph constants dominate; int8-qdq keeps the LM head float by design, and with 2 layers
    # its float first-and-last down_proj are all of them; its float budget (qdq_float_ratio) keeps one more fp32
    for name, bound in (("int8-dynamic", 0.6), ("int8-qdq", 0.9)):
        assert q.engine_bytes(name) < bound * fp32
        assert q.engine(name).quality["top1_agreement"] > 0.5
        assert np.isfinite(q.engine(name).quality["perplexity"])


def test_int8_dynamic_has_no_fp32_weight_matrices(tiny_bundle):
    g = _graph(tiny_bundle, "int8-dynamic")
    big_fp32 = [i.name for i in g.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2
                and i.dims[0] * i.dims[1] >= 64 * 64 and i.name not in ("cos_cache", "sin_cache")]
    assert big_fp32 == []  # the embedding and LM head are INT8 too (the fused graph's rotary tables are not weights)
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits") for n in g.graph.node)


def test_int4_weight_is_asymmetric_4_bit_with_an_8_bit_head_shared_by_the_embedding(tiny_bundle):
    g = _graph(tiny_bundle, "int4-weight")
    bits = {n.name: (next(a.i for a in n.attribute if a.name == "bits"), len(n.input))
            for n in g.graph.node if n.op_type == "MatMulNBits"}
    head = bits.pop("/lm_head/MatMul_Q8")
    assert head == (8, 3)  # 8-bit, symmetric (no zero-point input): the embedding gathers from it
    assert bits and all(b == 4 and n_in == 4 for b, n_in in bits.values())  # 4-bit with per-block zero points
    assert not [n for n in g.graph.node if n.op_type == "MatMul"]
    gathers = [n for n in g.graph.node if n.op_type == "Gather" and n.input[0].endswith(".lm_head_T_Q8")]
    assert gathers, "the embedding should read the LM head's 8-bit table, not keep a table of its own"
    q = tiny_bundle.manifest.engine("int4-weight").quality
    assert q["top1_agreement"] > 0.5 and np.isfinite(q["perplexity"])


def test_int8_dynamic_uses_finer_blocks_only_on_the_edge_down_projections(tiny_bundle):
    g = _graph(tiny_bundle, "int8-dynamic")
    attrs = {n.name: {a.name: a.i for a in n.attribute} for n in g.graph.node if n.op_type == "MatMulNBits"}
    last = tiny_bundle.manifest.model.num_layers - 1
    fine = sorted(k for k, v in attrs.items() if v["block_size"] == 16)
    assert fine == ["/model/layers.0/mlp/down_proj/MatMul_Q8", f"/model/layers.{last}/mlp/down_proj/MatMul_Q8"]
    assert all(v["block_size"] == 32 for k, v in attrs.items() if k not in fine)
    assert all(v["bits"] == 8 and v["accuracy_level"] == 4 for v in attrs.values())  # INT8 activations everywhere
    rec = next(s for s in tiny_bundle.manifest.stages if s.name == "quantize-int8-dynamic")
    assert rec.metrics["block16_nodes"] == [f.removesuffix("_Q8") for f in fine]


def test_qdq_only_on_weight_matmuls_symmetric_and_finite(tiny_bundle):
    g = _graph(tiny_bundle, "int8-qdq")
    inits = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    consumers = {}
    for n in g.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    qs = [n for n in g.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qs
    for n in qs:
        scale, zp = inits.get(n.input[1]), inits.get(n.input[2]) if len(n.input) > 2 else None
        assert scale is not None and np.all(np.isfinite(scale)) and np.all(scale > 0), n.name
        assert zp is None or not zp.any(), f"{n.name} has a non-zero zero point"
        assert zp is None or zp.dtype == np.int8
        if n.op_type == "DequantizeLinear":
            users = consumers.get(n.output[0], [])
            assert users and all(u.op_type in ("MatMul", "Gather", "Transpose", "Shape") for u in users), \
                f"{n.name} feeds {[u.op_type for u in users]}"
    for n in g.graph.node:  # nothing near masks or softmax
        if n.op_type in ("Softmax", "Where", "Equal", "Expand", "Cos", "Sin"):
            assert not any(i.endswith(("_DequantizeLinear_Output", "_dequantized")) for i in n.input), n.name
    weight_dq = [n for n in qs if n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].ndim == 2]
    assert weight_dq and all(inits[n.input[1]].ndim == 1 for n in weight_dq)  # per output channel
    # the first and last block's down_proj stay float (qdq_float_nodes), and so does the tied LM head; so do the
    # MatMuls of the activations the float budget picked (qdq_float_ratio), and nothing else
    last = tiny_bundle.manifest.model.num_layers - 1
    rec = next(s for s in tiny_bundle.manifest.stages if s.name == "quantize-int8-qdq")
    budget = {n.name for n in g.graph.node if n.op_type == "MatMul" and n.input[0] in rec.metrics["qdq_float_activations"]}
    assert set(rec.metrics["float_matmuls"]) == {"/model/layers.0/mlp/down_proj/MatMul",
                                                 f"/model/layers.{last}/mlp/down_proj/MatMul", "/lm_head/MatMul"} | budget
    dq_users = {u.name for n in weight_dq for u in consumers.get(n.output[0], [])}
    assert not dq_users & set(rec.metrics["float_matmuls"])


def test_int8_qdq_embedding_is_dequantized_then_gathered(tiny_bundle):
    """TensorRT reads INT8 only through Q/DQ: the int8-qdq graph's embedding is DequantizeLinear(INT8 table,
    per-row scales) -> Gather on the ids, with no Gather or Cast of an INT8 tensor (export/trt_compat.py)."""
    from export import trt_compat

    g = _graph(tiny_bundle, "int8-qdq")
    inits = {i.name: i for i in g.graph.initializer}
    dq = {n.output[0]: n for n in g.graph.node if n.op_type == "DequantizeLinear"}
    (embed,) = [n for n in g.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    table = dq[embed.input[0]]
    assert inits[table.input[0]].data_type == onnx.TensorProto.INT8 and len(inits[table.input[0]].dims) == 2
    assert list(inits[table.input[1]].dims) == [inits[table.input[0]].dims[0]]  # a scale per row (axis 0)
    assert trt_compat.node_problems(g, "10.3") == []
    onnx.checker.check_model(g)  # a valid ONNX graph: nodes in topological order
    # the CPU engines keep Gather on INT8 rows, then the scale (no whole-table dequantize per step)
    cpu = _graph(tiny_bundle, "int8-dynamic")
    cpu_inits = {i.name: i.data_type for i in cpu.graph.initializer}
    rows = [n for n in cpu.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert any(cpu_inits.get(n.input[0]) in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) for n in rows)
    assert not any(n.op_type == "DequantizeLinear" for n in cpu.graph.node)


def test_int8_qdq_with_a_quantized_tied_head_gathers_from_the_heads_dequantized_table(tiny_bundle, tmp_path):
    """keep_lm_head_float=False: the embedding reads rows of the LM head's own DequantizeLinear output (one INT8
    table for both), and that node is moved before its new reader: the ONNX standard and onnx's checker want the
    nodes in topological order (onnx-tensorrt sorts them itself, ModelImporter.cpp, so TensorRT would not mind)."""
    from export import trt_compat
    from export.quantize import QuantizeOptions, run

    work = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work")
    run(work / "export", work / "load", tmp_path, QuantizeOptions(mode="int8-qdq", samples=4, keep_lm_head_float=False,
                                                                  smoothquant_ablation=False))
    g = onnx.load(str(tmp_path / "model.onnx"))
    onnx.checker.check_model(g)
    order = {o: k for k, n in enumerate(g.graph.node) for o in n.output}
    (embed,) = [n for n in g.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    dq = next(n for n in g.graph.node if n.output[0] == embed.input[0])
    assert dq.op_type == "DequantizeLinear" and dq.input[0].endswith(".lm_head_T_quantized")
    assert order[embed.input[0]] < order[embed.output[0]]
    assert any(n.op_type == "MatMul" and dq.output[0] in n.input for n in g.graph.node)  # the head reads it too
    assert trt_compat.node_problems(g, "10.3") == []


def test_tensorrt_embedding_form_gives_the_same_logits(tiny_plain_graph, tmp_path):
    """DequantizeLinear -> Gather computes what Gather -> Cast -> scale does: the same rows, the same scales."""
    import onnxruntime as ort

    from conftest import embedding_forms

    feed = {"input_ids": np.array([[5, 6, 7, 8, 300]]), "attention_mask": np.ones((1, 5), np.int64),
            "position_ids": np.arange(5)[None]}
    for i in range(2):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, 2, 0, 16), np.float32)
    logits = {name: ort.InferenceSession(str(p)).run(["logits"], feed)[0]
              for name, p in embedding_forms(tiny_plain_graph, tmp_path).items()}
    np.testing.assert_array_equal(logits["dq-gather"], logits["gather-int8"])


def test_onnx_runtime_cpu_runs_the_qdq_graph_as_written(tiny_bundle):
    """On ONNX Runtime's CPU provider the int8-qdq graph runs with its Q/DQ unfused (edge.precisions'
    cpu_session_config): what TensorRT's Q/DQ semantics compute, the weights' DequantizeLinear folded once (not
    the whole embedding table dequantized every call); logits as ORT's fused int8 kernels give them."""
    from edge.backends.onnxruntime import OrtDecoder
    from edge.io_contract import DecoderIO

    m = tiny_bundle.manifest
    e = m.engine("int8-qdq")
    io = DecoderIO.from_dict(m.engine_io(e))
    ids = list(range(5, 40))
    out = {}
    for precision in ("int8-qdq", None):
        dec = OrtDecoder(tiny_bundle.path(e.file), m.model, io, threads=1, precision=precision)
        assert _config(dec, "session.disable_quant_qdq") == ("1" if precision else None)
        out[precision] = dec.prefill(ids, dec.new_cache(capacity=64))
    np.testing.assert_allclose(out["int8-qdq"], out[None], atol=1e-4)
    gpu = OrtDecoder(tiny_bundle.path(e.file), m.model, io, threads=1, precision="int8-qdq",
                     providers=["CUDAExecutionProvider", "CPUExecutionProvider"])  # not CPU alone: left as it is
    assert _config(gpu, "session.disable_quant_qdq") is None


def _config(dec, key: str) -> str | None:
    try:
        return dec.session.get_session_options().get_session_config_entry(key)
    except RuntimeError:  # ONNX Runtime's answer for a key never set
        return None


def test_smoothquant_recorded_and_compared(tiny_bundle):
    rec = next(s for s in tiny_bundle.manifest.stages if s.name == "quantize-int8-qdq")
    assert rec.params["smoothquant_alpha"] == 0.5
    assert rec.metrics["smoothquant_groups"] >= 3 * tiny_bundle.manifest.model.num_layers  # qkv, gate/up, down
    assert "int8-qdq-no-smoothquant" not in {e.name for e in tiny_bundle.manifest.engines}  # not shipped
    md = (tiny_bundle.root / "report" / "report.md").read_text()
    assert "| int8-qdq-no-smoothquant |" in md and "SmoothQuant on vs off (int8-qdq)" in md


def test_smoothing_is_exact_before_quantization(tiny_bundle, tmp_path):
    """Folding 1/s into the norm and s into the weights must not change the fp32 function."""
    import onnxruntime as ort

    from export.onnx_weights import GraphWeights
    from export.int8_qdq import smooth

    src = tiny_bundle.path("engines/fp32/model.onnx")
    gw = GraphWeights(src)
    n = tiny_bundle.manifest.model
    feed = {"input_ids": np.array([[5, 6, 7, 8, 9]]), "attention_mask": np.ones((1, 5), np.int64),
            "position_ids": np.arange(5)[None]}
    for i in range(n.num_layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, n.num_kv_heads, 0, n.head_dim), np.float32)
    before = ort.InferenceSession(str(src)).run(["logits"], feed)[0]
    assert len(smooth(gw, [feed], alpha=0.5, workdir=tmp_path)) > 0
    gw.save(tmp_path / "smoothed.onnx")  # streamed: the weights go to smoothed.onnx.data
    assert (tmp_path / "smoothed.onnx.data").stat().st_size > 0
    after = ort.InferenceSession(str(tmp_path / "smoothed.onnx")).run(["logits"], feed)[0]
    np.testing.assert_allclose(after, before, atol=1e-4)


def test_token_metrics_known_values():
    teacher = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    student = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    m = token_metrics(student, teacher, np.array([0, 1]))
    assert m["n"] == 2 and m["agree"] == 1
    assert m["nll"] == pytest.approx(-np.log(0.25) - np.log(0.8))
    kl0 = 0.5 * np.log(0.5 / 0.25) + 0.25 * np.log(0.25 / 0.5)
    assert m["kl"] == pytest.approx(kl0)
    s = summarize([m])
    assert s["perplexity"] == pytest.approx(np.exp(m["nll"] / 2))
    assert s["top1_agreement"] == 0.5 and s["kl_to_fp32"] == pytest.approx(kl0 / 2)


def test_identical_models_have_zero_kl():
    x = np.random.default_rng(0).normal(size=(7, 11))
    m = token_metrics(x, x, np.arange(7))
    assert m["kl"] == pytest.approx(0, abs=1e-12) and m["agree"] == 7


def test_report_written_into_bundle(tiny_bundle):
    files = tiny_bundle.manifest.files
    for f in ("report/report.html", "report/report.md", "report/size_vs_perplexity.png", "report/tokens_per_second.png"):
        assert f in files
    html = (tiny_bundle.root / "report" / "report.html").read_text()
    assert "int8-qdq" in html and "http" not in html.replace("http-equiv", "")
    assert tiny_bundle.manifest.golden and all("answer" in g for g in tiny_bundle.manifest.golden)


def test_splits_are_disjoint():
    cal = load_chats(None, "calibration", 50)
    ev = load_chats(None, "evaluation", 50)
    key = lambda c: json.dumps(c)  # noqa: E731
    assert cal and ev and not ({key(c) for c in cal} & {key(c) for c in ev})
    assert load_chats(None, "evaluation", 5) == ev[:5]  # deterministic


@pytest.mark.parametrize("content, match", [
    ("", "holds no chats"),
    ("{not json}\n", ":1: not valid JSON"),
    ('{"messages": []}\n', ":1: expected"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', ":1: each message needs a role"),
    ('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": 3}\n', ":2: expected"),
])
def test_bad_calibration_file(tmp_path, content, match):
    p = tmp_path / "chats.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        load_jsonl(p)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_int8_dynamic_is_gptq_rounded_and_closer_to_fp32_than_round_to_nearest(tiny_bundle, tmp_path):
    """The default int8 rounding is GPTQ, symmetric (no zero points: the embedding gathers rows from the head's
    table with the kernel's implicit 128), and recorded; on held-out chats and prose its logits are closer to
    fp32's than those of ONNX Runtime's round to nearest, written from the same graph."""
    from edge.decode.tokenizer import ChatTokenizer
    from export.bundle_eval import EvalRequest, _onnx_logits, eval_sets
    from export.quantize import QuantizeOptions, run

    m = tiny_bundle.manifest
    rec = next(s for s in m.stages if s.name == "quantize-int8-dynamic")
    assert rec.metrics["int8_rounding"] == "gptq" and rec.metrics["gptq_tokens"] > 0
    nodes = [n for n in _graph(tiny_bundle, "int8-dynamic").graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(len(n.input) == 3 for n in nodes)
    work = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work")
    run(work / "export" / "fused", work / "load", tmp_path, QuantizeOptions(mode="int8-dynamic", int8_rounding="minmax"))
    e8 = m.engine("int8-dynamic")
    ref = _onnx_logits(tiny_bundle.path(m.engine("fp32").file), m.model, m.engine_io(m.engine("fp32")), 1)
    gptq = _onnx_logits(tiny_bundle.path(e8.file), m.model, m.engine_io(e8), 1)
    rtn = _onnx_logits(tmp_path / "model.onnx", m.model, m.engine_io(e8), 1)
    tok = ChatTokenizer(tiny_bundle.path(m.tokenizer.file), m.tokenizer)
    for kind, seqs in eval_sets(tok, EvalRequest(bundle=tiny_bundle.root, chats=4, prose_tokens=256), m.model.max_context).items():
        kl = {}
        for name, f in (("gptq", gptq), ("minmax", rtn)):
            kl[name] = summarize([token_metrics(f(ids), ref(ids), np.array(ids[1:])) for ids in seqs])["kl_to_fp32"]
        assert kl["gptq"] < kl["minmax"], (kind, kl)  # tiny random model: ~1.4e-6 against ~1.5e-6 on chats


def _activation_scales(path) -> dict[str, float]:
    """Each QuantizeLinear's scale on an activation (not a weight): input name -> scale."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i for i in m.graph.initializer}
    return {n.input[0]: float(numpy_helper.to_array(inits[n.input[1]])) for n in m.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


def test_int8_qdq_ranges_come_block_by_block_and_equal_the_whole_graph_calibration(tiny_bundle, tmp_path, monkeypatch):
    """The int8-qdq activation ranges come from the model one block at a time (ONNX Runtime's whole-graph
    calibrator never runs) and equal, within float rounding, what that calibrator measured on the smoothed
    graph and on the no-SmoothQuant ablation."""
    import importlib

    from export import int8_qdq, quantize

    ort_quantize = importlib.import_module("onnxruntime.quantization.quantize")  # the module, not its function

    work = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work")
    # one alpha and the max range (what the whole-graph calibrator measures), round-to-nearest weights (faster)
    opts = quantize.QuantizeOptions(mode="int8-qdq", samples=8, qdq_alpha_search=False, qdq_range="max",
                                    int8_rounding="minmax", qdq_float_ratio=0, smoothquant_ablation=True)
    (tmp_path / "whole").mkdir()
    (tmp_path / "blocks").mkdir()
    with monkeypatch.context() as m:
        m.setattr(int8_qdq, "_takes_ranges", lambda: False)  # the whole-graph calibration, as before
        old = quantize.run(work / "export", work / "load", tmp_path / "whole", opts)
    assert old["activation_ranges"] == "whole graph (onnxruntime)"

    def no_calibration(*a, **k):
        raise AssertionError("the whole-graph calibrator ran")

    monkeypatch.setattr(ort_quantize, "create_calibrator", no_calibration)
    new = quantize.run(work / "export", work / "load", tmp_path / "blocks", opts)
    assert new["activation_ranges"] == "by block (torch)" and new["smoothquant_groups"] == old["smoothquant_groups"] > 0
    for sub in ("", quantize.ABLATION):
        want = _activation_scales(tmp_path / "whole" / sub / "model.onnx")
        got = _activation_scales(tmp_path / "blocks" / sub / "model.onnx")
        assert set(got) == set(want) and len(want) >= 4
        for x in want:
            assert got[x] == pytest.approx(want[x], rel=1e-5), x
