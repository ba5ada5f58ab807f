"""GraphWeights: a graph's weights read one tensor at a time and streamed back to disk, checked with real
ONNX Runtime sessions on small hand-made graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge.errors import EdgeChatError
from export.onnx_weights import GraphWeights, graph_bytes


def matmul_graph(path, w: np.ndarray, c: np.ndarray, *, drop_length: bool = False) -> None:
    """y = (x @ W) + C, with W in external data and C a Constant node's (external) attribute tensor."""
    k, n = w.shape
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c, "c"))
    nodes = [const, helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(m, str(path), save_as_external_data=True, location="orig.bin", size_threshold=0,
                    convert_attribute=True)
    if drop_length:  # "length" is optional in the ONNX spec
        m = onnx.load(str(path), load_external_data=False)
        for t in [*m.graph.initializer, m.graph.node[0].attribute[0].t]:
            keep = [(e.key, e.value) for e in t.external_data if e.key != "length"]
            del t.external_data[:]
            for k_, v in keep:
                t.external_data.add(key=k_, value=v)
        onnx.save_model(m, str(path))


def run(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]


@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 300)).astype(np.float32), rng.standard_normal(300).astype(np.float32)


@pytest.mark.parametrize("drop_length", [False, True])
def test_edits_stream_back_and_saving_over_itself_is_safe(tmp_path, weights, drop_length):
    w, c = weights
    matmul_graph(tmp_path / "m.onnx", w, c, drop_length=drop_length)
    x = np.ones((1, 64), np.float32)
    gw = GraphWeights(tmp_path / "m.onnx")
    np.testing.assert_array_equal(gw.array("W"), w)
    gw.transform("W", lambda a: a * 2)
    gw.transform("W", lambda a: a + 1)  # edits compose: (w * 2) + 1
    gw.save(tmp_path / "m.onnx")  # over the file it reads from
    np.testing.assert_allclose(run(tmp_path / "m.onnx", x), x @ (w * 2 + 1) + c, rtol=1e-5, atol=1e-4)
    gw.save(tmp_path / "m.onnx")  # again, with nothing edited: the same function
    np.testing.assert_allclose(run(tmp_path / "m.onnx", x), x @ (w * 2 + 1) + c, rtol=1e-5, atol=1e-4)
    assert graph_bytes(tmp_path / "m.onnx") >= w.nbytes + c.nbytes


def test_an_edit_that_does_not_match_its_record_is_refused(tmp_path, weights):
    w, c = weights
    matmul_graph(tmp_path / "m.onnx", w, c)
    gw = GraphWeights(tmp_path / "m.onnx")
    gw.transform("W", lambda a: a * np.ones(300))  # float64: would write twice the bytes
    with pytest.raises(ValueError, match="float64.*its record says float32"):
        gw.save(tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()  # nothing half-written left looking complete


def test_a_removed_tensor_still_feeds_a_pending_computed_edit(tmp_path, weights):
    w, c = weights
    matmul_graph(tmp_path / "m.onnx", w, c)
    gw = GraphWeights(tmp_path / "m.onnx")
    gw.set("W2", lambda: gw.stored("W") * 3, dims=w.shape, dtype=np.float32)
    gw.model.graph.node[1].input[1] = "W2"
    gw.remove("W")
    gw.save(tmp_path / "out.onnx")
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(run(tmp_path / "out.onnx", x), x @ (w * 3) + c, rtol=1e-5, atol=1e-4)
    assert "W" not in GraphWeights(tmp_path / "out.onnx").names()


def test_a_truncated_weights_file_is_a_clear_error(tmp_path, weights):
    w, c = weights
    matmul_graph(tmp_path / "m.onnx", w, c)
    with open(tmp_path / "orig.bin", "r+b") as f:
        f.truncate(1000)
    gw = GraphWeights(tmp_path / "m.onnx")
    with pytest.raises(EdgeChatError, match="orig.bin ends before the tensor 'W'.*build again with --fresh"):
        gw.array("W")
    with pytest.raises(EdgeChatError, match="ends before the tensor it should hold"):
        gw.save(tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
