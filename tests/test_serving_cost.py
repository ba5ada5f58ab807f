"""The serving path's cost per token (issue 46): what the server adds to the decoder's step must stay small.

Timed assertions are not benchmarks (scripts/bench_serve.py measures the ratio, interleaved); these tests pin
the causes the profile found, each by a property that fails when the cause comes back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge.bundle import Bundle
from edge.decode.generate import Generator


@pytest.fixture(scope="module")
def serving_decoder(tiny_bundle):
    """The decoder as `edge-chat serve` loads it (spin=False), on two threads so ORT has workers."""
    return Generator.from_bundle(Bundle.open(tiny_bundle.root), engine="int8-dynamic", threads=2, spin=False).decoder


def _config(dec, key: str) -> str:
    try:
        return dec.session.get_session_options().get_session_config_entry(key)
    except Exception:  # onnxruntime raises when the key was never set
        return ""


def test_serving_session_spins_within_a_call_and_stops_after_it(serving_decoder):
    """`allow_spinning=0` made each operator wake ORT's workers: 25% of a 135M model's step through the server
    (docs/speed.md). The server's session spins between operators and stops when the call returns."""
    assert _config(serving_decoder, "session.intra_op.allow_spinning") != "0"
    assert _config(serving_decoder, "session.force_spinning_stop") == "1"


def _idle_cpu_after_calls(spin: bool, tmp_path) -> float:
    """CPU seconds the process uses in 30 ms of idle after a call, median of 10, on a graph big enough that ONNX
    Runtime hands its work to its worker threads (the tiny test models are not)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edge.backends.onnxruntime import session_options

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 1024])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 1024])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "mm.onnx")
    s = ort.InferenceSession(str(tmp_path / "mm.onnx"), session_options(2, spin), providers=["CPUExecutionProvider"])
    x = np.ones((64, 1024), np.float32)
    busy = []
    for _ in range(10):
        s.run(None, {"x": x})
        t = time.process_time()
        time.sleep(0.03)
        busy.append(time.process_time() - t)
    return float(np.median(busy))


def test_serving_session_leaves_the_cores_idle_between_calls(tmp_path):
    """Between two steps the HTTP side needs the cores: after a call, ORT's workers must not keep spinning
    (with spinning on and no stop, each call left a worker busy ~25 ms of every 30)."""
    assert _idle_cpu_after_calls(spin=False, tmp_path=tmp_path) < 0.005
