"""The fp16 plain graph (export/fp16.py): fp16 weights, activations and K/V with fp32 islands where fp16
overflows or loses too much, checked on the tiny model against the fp32 graph it came from.

Two runtimes: ONNX Runtime CPU (what the evaluate stage and the runtime use; it has no fp16 kernels for
MatMul, Add, Mul, Pow..., so it computes those in fp32 between fp16 tensors) and onnx's reference evaluator,
which computes every op in the type the graph declares, as a strongly typed TensorRT network does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge.io_contract import DecoderIO
from edge.backends.onnxruntime import OrtDecoder
from export.architectures import ARCHITECTURES, dims_from_hf_config
from export.fp16 import Fp16ConversionError, Fp16Options, run
from export.onnx_weights import GraphWeights, tensor_types

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 12], list(range(20, 60)), [300, 2, 2, 8, 140, 77] * 5]


def _dims(model_dir: Path):
    return dims_from_hf_config(json.loads((model_dir / "config.json").read_text()))


def _feeds(ids: list[int], dims, kv_dtype) -> dict:
    n = len(ids)
    f = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
         "position_ids": np.arange(n, dtype=np.int64)[None]}
    for i in range(dims.num_layers):
        for kv in ("key", "value"):
            f[f"past_key_values.{i}.{kv}"] = np.zeros((1, dims.num_kv_heads, 0, dims.head_dim), kv_dtype)
    return f


def _probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _reference(path: Path, feeds: dict) -> np.ndarray:
    """Logits with every op computed in its declared type (fp16 ops in fp16)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(onnx.load(str(path))).run(["logits"], feeds)[0]


@pytest.fixture(scope="module")
def fp16_graph(tiny_plain_graph, tmp_path_factory) -> tuple[Path, dict]:
    dst = tmp_path_factory.mktemp("fp16")
    return dst, run(tiny_plain_graph, dst)


def test_fp16_logits_close_to_fp32_and_greedy_tokens_equal(tiny_model_dir, tiny_plain_graph, fp16_graph):
    """Tolerance (the tiny model's logits are within +-2): no logit moves by more than 2e-3 with fp16 arithmetic
    (reference evaluator; measured 6e-4) nor 1e-3 on ONNX Runtime CPU (3e-4), KL to fp32 per position under 1e-6;
    top-1 equal at 95% of positions; greedy tokens from the fp16 K/V cache equal fp32's for 24 steps."""
    dims = _dims(tiny_model_dir)
    d32 = OrtDecoder(tiny_plain_graph / "model.onnx", dims, DecoderIO(), threads=1)
    d16 = OrtDecoder(fp16_graph[0] / "model.onnx", dims, DecoderIO(), threads=1)
    assert d16._kv_dtype == np.float16 and d32._kv_dtype == np.float32  # read from the graphs' declared inputs
    for ids in PROMPTS:
        l32 = d32.forward(np.array([ids]), d32.new_cache(), last_only=False)[0]
        l16 = d16.forward(np.array([ids]), d16.new_cache(), last_only=False)[0]
        assert l16.dtype == np.float32
        assert np.abs(l16 - l32).max() < 1e-3
        typed = _reference(fp16_graph[0] / "model.onnx", _feeds(ids, dims, np.float16))[0]
        assert np.abs(typed - l32).max() < 2e-3
        p32 = _probs(l32)
        assert (p32 * (np.log(p32) - np.log(_probs(typed)))).sum(-1).max() < 1e-6
        assert (typed.argmax(-1) == l32.argmax(-1)).mean() > 0.95

        def greedy(d):
            cache, out = d.new_cache(), []
            logits = d.prefill(ids, cache)
            for _ in range(24):
                out.append(int(np.argmax(logits)))
                logits = d.forward(np.array([[out[-1]]]), cache)[0]
            return out

        assert greedy(d16) == greedy(d32)


def test_batched_fp16_cache_rows_equal_rows_alone(tiny_model_dir, fp16_graph):
    """The plain-graph batch cache pads and stacks fp16 K/V rows (edge/decode/cache.py BatchCache)."""
    from edge.decode.cache import BatchCache

    dims = _dims(tiny_model_dir)
    dec = OrtDecoder(fp16_graph[0] / "model.onnx", dims, DecoderIO(), threads=1)
    bc = BatchCache(dec)
    firsts = [bc.admit(p) for p in PROMPTS[:2]]
    assert bc.values[0].numpy().dtype == np.float16
    steps = [bc.step([7, 9]) for _ in range(3)]
    for i, p in enumerate(PROMPTS[:2]):
        alone = dec.new_cache()
        np.testing.assert_allclose(firsts[i], dec.prefill(p, alone)[0], atol=1e-5)
        for s in steps:
            np.testing.assert_allclose(s[i], dec.forward(np.array([[7 if i == 0 else 9]]), alone)[0], atol=2e-3)


def test_islands_compute_in_fp32_and_the_rest_in_fp16(fp16_graph, tiny_plain_graph, tmp_path):
    model = onnx.load(str(fp16_graph[0] / "model.onnx"), load_external_data=False)
    types = tensor_types(model)
    nodes = list(model.graph.node)
    fp32_ops = [n for n in nodes if n.op_type in ("Softmax", "ReduceMean", "Pow", "Sqrt", "Sin", "Cos")]
    assert {n.op_type for n in fp32_ops} == {"Softmax", "ReduceMean", "Pow", "Sqrt", "Sin", "Cos"}
    for n in fp32_ops:
        assert types[n.input[0]] == types[n.output[0]] == TensorProto.FLOAT, n.name
    norm_scale = [n for n in nodes if n.op_type == "Mul" and n.name.endswith("layernorm/Mul_1")]
    assert norm_scale and all(types[n.output[0]] == TensorProto.FLOAT for n in norm_scale)  # the weight too
    masks = [n for n in nodes if n.op_type in ("Add", "Where")
             and any(c.op_type == "Softmax" and n.output[0] in c.input for c in nodes)]
    assert masks and all(types[n.output[0]] == TensorProto.FLOAT for n in masks)  # the mask (add or select) before softmax
    weights = [n for n in nodes if n.op_type == "MatMul" and "_proj/" in n.name]
    assert weights and all(types[i] == TensorProto.FLOAT16 for n in weights for i in n.input)
    io = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert io["input_ids"] == io["attention_mask"] == io["position_ids"] == TensorProto.INT64
    assert io["logits"] == TensorProto.FLOAT
    assert {t for k, t in io.items() if k.startswith(("past", "present"))} == {TensorProto.FLOAT16}
    names = [n.name for n in nodes]
    assert len(set(names)) == len(names) and all(names)
    onnx.checker.check_model(onnx.load(str(fp16_graph[0] / "model.onnx")))  # topological order, valid types
    again = tmp_path / "again"
    again.mkdir()
    run(tiny_plain_graph, again)
    assert [n.name for n in onnx.load(str(again / "model.onnx"), load_external_data=False).graph.node] == names


def _scaled(src: Path, dst: Path, factor: float) -> Path:
    """The fp32 graph with the embeddings scaled by `factor` (a residual stream as large as real models'
    outliers): RMSNorm divides the scale out, so the fp32 logits stay sensible."""
    gw = GraphWeights(src / "model.onnx")
    g = gw.model.graph
    embed = next(n for n in g.node if n.op_type == "Gather" and n.input[0] in gw.names() and n.input[1] == "input_ids")
    out = embed.output[0]
    embed.output[0] = out + "/unscaled"
    gw.set("embed_scale", np.array(factor, np.float32))
    g.node.insert(list(g.node).index(embed) + 1,
                  helper.make_node("Mul", [out + "/unscaled", "embed_scale"], [out], name="/model/embed_tokens/Scale"))
    dst.mkdir()
    gw.save(dst / "model.onnx")
    return dst


def test_islands_keep_a_norm_over_the_fp16_range_right(tiny_model_dir, tiny_plain_graph, tmp_path):
    """Hidden states of ~400 (x**2 past 65504): with the islands the fp16 graph gives fp32's tokens; without
    them the norms' x**2 overflows to inf, each norm's output collapses to 0 and the logits are lost."""
    import onnxruntime as ort

    dims = _dims(tiny_model_dir)
    src = _scaled(tiny_plain_graph, tmp_path / "scaled", 2e4)
    with_islands, without = tmp_path / "islands", tmp_path / "none"
    with_islands.mkdir(), without.mkdir()
    run(src, with_islands)
    with pytest.raises(Fp16ConversionError, match="would compute in fp16.*fp32_scopes"):
        run(src, without, Fp16Options(fp32_scopes=(), fp32_softmax=False))
    run(src, without, Fp16Options(fp32_scopes=(), fp32_softmax=False, check_islands=False))
    ids = PROMPTS[1]
    ref = ort.InferenceSession(str(src / "model.onnx")).run(["logits"], _feeds(ids, dims, np.float32))[0][0]
    good = _reference(with_islands / "model.onnx", _feeds(ids, dims, np.float16))[0]
    bad = _reference(without / "model.onnx", _feeds(ids, dims, np.float16))[0]
    assert np.isfinite(good).all() and np.abs(good - ref).max() < 0.02 * np.abs(ref).max()
    assert (good.argmax(-1) == ref.argmax(-1)).mean() > 0.9
    lost = not np.isfinite(bad).all() or (bad.argmax(-1) == ref.argmax(-1)).mean() < 0.5
    assert lost, "without fp32 norms the fp16 graph should overflow here (else this test shows nothing)"


def test_weights_are_fp16_and_fp16_constants_finite(fp16_graph):
    model = onnx.load(str(fp16_graph[0] / "model.onnx"), load_external_data=False)
    big = {i.name: i.data_type for i in model.graph.initializer if np.prod(i.dims) >= 64 * 64}
    assert big and set(big.values()) == {TensorProto.FLOAT16}  # every weight matrix and the tied table
    metrics = fp16_graph[1]
    assert metrics["kv_dtype"] == "float16" and metrics["size_ratio"] < 0.7
    consts = [numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"]
    assert all(np.isfinite(c).all() for c in consts if c.dtype == np.float16)


def test_fp32_cache_option_keeps_the_graph_edge_fp32(tiny_model_dir, tiny_plain_graph, tmp_path):
    """fp16_kv=False: fp32 past inputs and present outputs (cast at the edge), the graph's own readers of a
    present tensor still reading the fp16 one; ONNX Runtime loads it and it decodes like fp32."""
    dims = _dims(tiny_model_dir)
    run(tiny_plain_graph, tmp_path, Fp16Options(fp16_kv=False))
    dec = OrtDecoder(tmp_path / "model.onnx", dims, DecoderIO(), threads=1)
    ref = OrtDecoder(tiny_plain_graph / "model.onnx", dims, DecoderIO(), threads=1)
    assert dec._kv_dtype == np.float32
    cache = dec.new_cache()
    dec.prefill(PROMPTS[0], cache)
    assert all(v.numpy().dtype == np.float32 for v in cache.values)
    np.testing.assert_allclose(dec.prefill(PROMPTS[1], dec.new_cache()), ref.prefill(PROMPTS[1], ref.new_cache()), atol=1e-3)


def test_type_mismatches_name_the_node():
    from export.onnx_weights import type_mismatches

    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT16, [2, 2]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert type_mismatches(model) == ["MatMul 'mm': inputs of type T differ: FLOAT (b), FLOAT16 (a)"]


def test_rotary_island_keeps_far_positions_exact(tiny_model_dir, tiny_plain_graph, tmp_path):
    """Positions past 2048 are not all integers in fp16 (at 20,000 one step is 16): with the rotary embedding in
    fp32 the fp16 graph stays as close to fp32 there as at position 0 (5e-4 measured); with only the norms in fp32
    it is 10x further (6e-3 measured)."""
    import onnxruntime as ort

    dims = _dims(tiny_model_dir)
    islands, norms_only = tmp_path / "islands", tmp_path / "norms"
    islands.mkdir(), norms_only.mkdir()
    run(tiny_plain_graph, islands)
    run(tiny_plain_graph, norms_only, Fp16Options(fp32_scopes=(r"/[A-Za-z0-9_]*norm/",), check_islands=False))
    ids = PROMPTS[1]
    f32, f16 = _feeds(ids, dims, np.float32), _feeds(ids, dims, np.float16)
    f32["position_ids"] = f16["position_ids"] = f32["position_ids"] + 20001
    ref = ort.InferenceSession(str(tiny_plain_graph / "model.onnx")).run(["logits"], f32)[0][0]
    err = {p.name: np.abs(_reference(p / "model.onnx", f16)[0] - ref).max() for p in (islands, norms_only)}
    assert err["islands"] < 2e-3 and err["norms"] > 4 * err["islands"], err


def test_kv_dtype_is_read_from_the_declared_type_and_unknown_ones_refused():
    """A bf16 cache used to read as fp16 ("float16" is in "tensor(bfloat16)"): now each type is looked up."""
    from edge.errors import BundleError
    from edge.backends.onnxruntime import kv_dtype

    assert kv_dtype("tensor(float16)", "g") is np.float16 and kv_dtype("tensor(float)", "g") is np.float32
    with pytest.raises(BundleError, match="declares its past K/V as tensor\\(bfloat16\\).*re-export"):
        kv_dtype("tensor(bfloat16)", "g")


@pytest.mark.parametrize("arch", sorted(a for a in ARCHITECTURES if a != "LlamaForCausalLM"))
def test_every_architecture_converts_with_its_islands(arch, tmp_path):
    """Every entry of export/architectures.py (Llama: the tests above): the stage finds each norm (Qwen3's q/k
    norms too) and the fp16 graph stays within 2e-3 of fp32 with fp16 arithmetic (measured 5e-4 to 9e-4)."""
    import onnxruntime as ort

    from conftest import make_tiny_model
    from export import onnx_export

    src = make_tiny_model(tmp_path / "hf", arch=arch)
    (tmp_path / "plain").mkdir(), (tmp_path / "fp16").mkdir()
    onnx_export.run(src, tmp_path / "plain", onnx_export.ExportOptions(fused=False, greedy_tokens=4))
    run(tmp_path / "plain", tmp_path / "fp16")  # raises if a norm, softmax or rotary op were left in fp16
    dims, ids = _dims(src), PROMPTS[1]
    ref = ort.InferenceSession(str(tmp_path / "plain" / "model.onnx")).run(["logits"], _feeds(ids, dims, np.float32))[0]
    assert np.abs(_reference(tmp_path / "fp16" / "model.onnx", _feeds(ids, dims, np.float16)) - ref).max() < 2e-3
