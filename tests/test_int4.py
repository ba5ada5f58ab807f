"""INT4 mixed precision: the measured sensitivity finds the weight that 4 bits hurt, and the budget holds."""

from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import make_tiny_model
from edge.errors import RecipeError
from export.int4 import block_quant, dequantize, pack
from export.sensitivity import allocate

SENSITIVE = "/model/layers.1/mlp/down_proj/MatMul"  # the fused graph's name for the weight made sensitive below


def _outlier_model(dst: Path) -> Path:
    """A tiny model whose layer-1 down_proj has one large weight in every block of 32 inputs: 4-bit blocks then
    spend their 16 levels on the outlier and round the other 31 weights coarsely (llama.cpp's reason for
    keeping some ffn_down at more bits)."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(dst, seed=3)
    sd = load_file(str(dst / "model.safetensors"))
    # a random-init model's MLPs barely touch the residual stream and its logits are nearly flat: make this
    # down_proj carry the stream (x100) and the logits sharp (the tied table x10), so its error shows in the KL
    w = sd["model.layers.1.mlp.down_proj.weight"] * 100  # [hidden, intermediate]: blocks run along intermediate
    w[:, ::32] = 12 * w.std()
    sd["model.layers.1.mlp.down_proj.weight"] = w
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 10
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def mixed_bundle(tmp_path_factory):
    from export.recipe import BuildOptions, build

    src = _outlier_model(tmp_path_factory.mktemp("outlier") / "tiny-outlier")
    out = tmp_path_factory.mktemp("mixed") / "mixed.bundle"
    return build(BuildOptions(output=out, model=str(src), precisions=("int4-weight",), max_context=256, skip_eval=True,
                              calibration_samples=4, int4_extra_ratio=0.1), log=lambda s: None)


def test_sensitivity_ranks_the_outlier_weight_first_and_keeps_it_at_8_bits(mixed_bundle):
    m = next(s for s in mixed_bundle.manifest.stages if s.name == "quantize-int4-weight").metrics
    ranking = list(m["int4_sensitivity"])
    assert ranking[0] == SENSITIVE, m["int4_sensitivity"]
    assert m["int4_sensitivity"][SENSITIVE] > 1.2 * m["int4_sensitivity"][ranking[1]]
    assert SENSITIVE in m["int4_8bit_matmuls"], {k: v for k, v in m.items() if k != "int4_sensitivity"}
    g = onnx.load(str(mixed_bundle.path(mixed_bundle.manifest.engine("int4-weight").file)), load_external_data=False)
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in g.graph.node if n.op_type == "MatMulNBits"}
    assert bits[SENSITIVE + "_Q8"] == 8
    assert sum(b == 4 for b in bits.values()) >= 4  # most stay at 4 bits (8 weight MatMuls besides the head)


def test_the_byte_budget_is_honoured(mixed_bundle):
    m = next(s for s in mixed_bundle.manifest.stages if s.name == "quantize-int4-weight").metrics
    size = mixed_bundle.manifest.engine_bytes("int4-weight")
    assert size <= m["int4_budget_bytes"]
    assert m["int4_planned_bytes"] <= m["int4_budget_bytes"] < m["int4_all4_bytes"] * 1.11
    assert m["int4_8bit_matmuls"], "the budget should leave room for at least one 8-bit MatMul"


def test_a_budget_below_the_all_4_bit_engine_is_refused(mixed_bundle, tmp_path):
    from export.quantize import QuantizeOptions, run

    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    with pytest.raises(RecipeError, match="less than the all-4-bit engine"):
        run(work / "export" / "fused", work / "load", tmp_path, QuantizeOptions(mode="int4-weight", int4_budget_mb=0.01))


def test_allocate_takes_most_kl_per_byte_within_the_budget():
    sens, cost = {"a": 1.0, "b": 0.9, "c": 0.1}, {"a": 100, "b": 10, "c": 10}
    assert allocate(sens, cost, 25) == ["b", "c"]   # a is worth less per byte and does not fit anyway
    assert sorted(allocate(sens, cost, 120)) == ["a", "b", "c"] and allocate(sens, cost, 0) == []


@pytest.mark.parametrize("k,n,block", [(64, 8, 32), (96, 5, 64), (40, 3, 32)])
def test_kquant_levels_pack_the_way_matmulnbits_reads_them(k, n, block):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = block_quant(w, 4, block, "kquant")
    b, zp = pack(q, z, 4)
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, n])],
                              [numpy_helper.from_array(b, "B"), numpy_helper.from_array(s.reshape(-1), "S"),
                               numpy_helper.from_array(zp.reshape(-1), "Z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    a = rng.standard_normal((2, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
    np.testing.assert_allclose(y, a @ dequantize(q, s, z, k), rtol=1e-4, atol=1e-4)
    assert np.linalg.norm(dequantize(q, s, z, k) - w) < 0.15 * np.linalg.norm(w)
