"""TensorRT's Q/DQ formats (export/trt_formats.py): int4-qdq (W4A16) and fp8-qdq, their graphs, their quality on
ONNX Runtime's CPU reference kernels, the export-time check and the stand-in's SM floors."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import loaded_plain
from edge.errors import RecipeError


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    """A tiny loaded model, its plain fp32 graph and the two TensorRT formats quantized from it."""
    from export import quantize

    d = tmp_path_factory.mktemp("trtfmt")
    out = loaded_plain(d)
    (d / "plain-listing.json").write_text(json.dumps(sorted(p.name for p in (d / "plain").iterdir())))
    for mode in ("int4-qdq", "fp8-qdq"):
        (d / mode).mkdir()
        # fp8-qdq spends its whole float budget (qdq_float_kl 0: a tiny random model's KLs sum far below the default)
        metrics = quantize.run(d / "plain", d / "hf", d / mode, quantize.QuantizeOptions(
            mode=mode, samples=8, gptq_samples=8, qdq_float_kl=0))
        (d / mode / "metrics.json").write_text(json.dumps(metrics, default=str))
        out[mode] = d / mode
    return out


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """Prefill logits of the graph at `path` on ONNX Runtime's CPU kernels, Q/DQ as written (edge/precisions.py)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(str(path / "model.onnx"), so, providers=["CPUExecutionProvider"])
    n = ids.shape[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None]}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            dt = np.float16 if "float16" in i.type else np.float32
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), dt)
    return sess.run(["logits"], feeds)[0][0].astype(np.float64)


def _kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lq = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean()), float((ref.argmax(-1) == got.argmax(-1)).mean())


def test_int4_qdq_is_symmetric_int4_blocks_dequantized_before_each_matmul(formats):
    g = onnx.load(str(formats["int4-qdq"] / "model.onnx"))
    assert next(o.version for o in g.opset_import if o.domain == "") == 21
    inits = {i.name: i for i in g.graph.initializer}
    dq = {n.output[0]: n for n in g.graph.node if n.op_type == "DequantizeLinear"}
    four = [n for n in dq.values() if inits[n.input[0]].data_type == onnx.TensorProto.INT4]
    assert len(four) == 14  # q, k, v, o, gate, up, down x 2 layers
    for n in four:
        attrs = {a.name: a.i for a in n.attribute}
        k, cols = inits[n.input[0]].dims
        assert attrs["axis"] == 0 and k % attrs["block_size"] == 0 and cols % 2 == 0
        assert len(n.input) == 2  # no zero point: symmetric
        assert list(inits[n.input[1]].dims) == [k // attrs["block_size"], cols]
        assert inits[n.input[1]].data_type == onnx.TensorProto.FLOAT16
    matmuls = [n for n in g.graph.node if n.op_type == "MatMul" and n.input[1] in dq]
    assert len(matmuls) == 15  # every weight MatMul, the head (INT8 per channel) included
    head = next(n for n in matmuls if "lm_head" in n.name)
    hq = dq[head.input[1]]
    assert inits[hq.input[0]].data_type == onnx.TensorProto.INT8 and len(inits[hq.input[1]].dims) == 1
    assert not [i for i in g.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2
                and i.dims[0] * i.dims[1] >= 64 * 64]  # no float weight matrix left (the embedding reads the head's)


def test_fp8_qdq_is_fp8_weights_per_channel_and_activations_per_tensor(formats):
    g = onnx.load(str(formats["fp8-qdq"] / "model.onnx"))
    m = json.loads((formats["fp8-qdq"] / "metrics.json").read_text())
    assert next(o.version for o in g.opset_import if o.domain == "") == 19
    inits = {i.name: i for i in g.graph.initializer}
    q = [n for n in g.graph.node if n.op_type == "QuantizeLinear"]
    # one per activation: q/k/v and gate/up share theirs (o has its own), 2 layers; the down_proj of the first and
    # last block stay fp16 (qdq_float_nodes, as int8-qdq's): here both; and the float budget's picks (6 left)
    floats = m["qdq_float_activations"]
    assert 1 <= len(floats) < 6 and len(q) == 6 - len(floats)
    for n in q:
        assert inits[n.input[2]].data_type == onnx.TensorProto.FLOAT8E4M3FN
        assert numpy_helper.to_array(inits[n.input[1]]).size == 1  # per tensor
        assert numpy_helper.to_array(inits[n.input[1]]).item() > 0
    w = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
         and inits[n.input[0]].data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert len(w) == m["fp8_matmuls"] and all(len(inits[n.input[1]].dims) == 1 for n in w)
    matmuls = [n for n in g.graph.node if n.op_type == "MatMul"]
    assert len(w) + len(m["float_matmuls"]) == 15 and m["fp8_rounding"] == "gptq"  # every weight MatMul
    assert not [n for n in matmuls if n.name in m["float_matmuls"] and any(i.endswith(("/fp8_dq", "_dq")) for i in n.input)]
    assert {"/model/layers.0/mlp/down_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul"} <= set(m["float_matmuls"])


def test_fp8_qdq_leaves_nothing_behind(formats):
    """Its probe and range graphs (copies of the fp32 graph with their weights) are written in its own folder and
    deleted; nothing is ever written beside the fp32 graph, another stage's output."""
    listing = json.loads((formats["fp32"].parent / "plain-listing.json").read_text())
    assert sorted(p.name for p in formats["fp32"].iterdir()) == listing
    assert sorted(p.name for p in formats["fp8-qdq"].iterdir()) == ["metrics.json", "model.onnx", "model.onnx.data"]


def test_the_sensitivity_probe_measures_fp8_as_fp8(formats):
    """QdqProbe(fp8=True) puts FP8 E4M3 Q/DQ on the activation (not INT8's): the same activation, weights and range
    measure another KL, and FP8's relative steps lose less than INT8's on a range set by a rare outlier."""
    from export import quantize
    from export.int8_search import QdqProbe
    from export.load import model_dims
    from export.onnx_weights import GraphWeights, weight_matmuls

    hf, plain = formats["fp32"].parent / "hf", formats["fp32"] / "model.onnx"
    dims = model_dims(hf)
    feeds = quantize.calibration_feeds(hf, quantize.QuantizeOptions(mode="fp8-qdq", samples=2), dims.num_layers,
                                       dims.num_kv_heads, dims.head_dim)
    gw = GraphWeights(plain)
    mm = [n for n in weight_matmuls(gw.model) if "q_proj" in n.name or "k_proj" in n.name or "v_proj" in n.name][:3]
    x = mm[0].input[0]
    groups = {x: [n.name for n in mm if n.input[0] == x]}
    weights = {n.name: gw.array(n.input[1]).astype(np.float32) for n in mm}
    kl = {}
    for fp8 in (False, True):
        probe = QdqProbe(plain, formats["fp8-qdq"], groups, {x: 50.0}, feeds, fp8=fp8)  # a range far above the values
        kl[fp8] = probe.kl(x, weights)
    assert sorted(p.name for p in formats["fp8-qdq"].iterdir()) == ["metrics.json", "model.onnx", "model.onnx.data"]
    assert 0 <= kl[True] < kl[False], kl


def test_fp8_qdq_keeps_float_the_activations_that_hurt_most_per_byte(formats):
    """fp8-qdq's float budget (as int8-qdq's, qdq_float_ratio 0.2): what it measured, and that it kept the
    activations with the most KL per fp16 byte within the budget."""
    from export.sensitivity import allocate

    m = json.loads((formats["fp8-qdq"] / "metrics.json").read_text())
    sens = m["qdq_sensitivity"]
    assert len(sens) == 6 and all(v >= 0 for v in sens.values())  # q/k/v, o, gate/up: 2 layers
    plain = onnx.load(str(formats["fp32"] / "model.onnx"), load_external_data=False)
    dims = {i.name: i.dims for i in plain.graph.initializer}
    cost: dict[str, int] = {}  # the fp16 bytes a float activation's MatMuls add: K x N each
    for n in plain.graph.node:
        if n.op_type == "MatMul" and n.input[0] in sens:
            cost[n.input[0]] = cost.get(n.input[0], 0) + int(np.prod(dims[n.input[1]]))
    assert m["qdq_float_ratio"] == 0.2 and m["qdq_float_kl"] == 0
    assert m["qdq_estimated_kl"] == pytest.approx(sum(v for x, v in sens.items() if x not in m["qdq_float_activations"]))
    assert sorted(m["qdq_float_activations"]) == sorted(allocate(sens, cost, int(0.2 * sum(cost.values()))))


@pytest.mark.parametrize("mode, max_kl, min_top1", [("int4-qdq", 0.05, 0.8), ("fp8-qdq", 0.01, 0.9)])
def test_cpu_reference_kernels_run_it_close_to_fp32(formats, mode, max_kl, min_top1):
    """ONNX Runtime's CPU kernels run the graph as TensorRT's Q/DQ semantics define it: quality is known before any
    GPU sees it (the tiny random model's logits are flat, so KL is small for any sane quantization)."""
    ids = np.random.default_rng(0).integers(3, 250, (1, 48))
    kl, top1 = _kl_top1(_logits(formats["fp32"], ids), _logits(formats[mode], ids))
    assert kl < max_kl and top1 >= min_top1, (kl, top1)


def test_int4_qdq_is_scored_on_cpu_as_its_twin_with_4_bit_weights(formats, tmp_path):
    """The evaluate stage scores int4-qdq on ONNX Runtime's CPU provider as its twin (export/trt_formats.py
    cpu_twin): every INT4 DequantizeLinear -> MatMul as MatMulNBits with fp32 compute, the same levels and scales
    (the weights stay 4-bit in memory; folded at load, the session held every weight as fp32: 7.4 GB for a 1.5B
    model), the INT8 head left to fold; its logits are the graph's as written."""
    from export.cpu_twin import cpu_twin

    twin = cpu_twin(formats["int4-qdq"] / "model.onnx", tmp_path / "twin")
    written = onnx.load(str(formats["int4-qdq"] / "model.onnx"), load_external_data=False).graph
    graph = onnx.load(str(twin), load_external_data=False).graph
    blocks = sum(n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)
                 for n in written.node)
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert blocks and len(nbits) == blocks
    assert all({a.name: a.i for a in n.attribute if a.name in ("accuracy_level", "bits")} == {"accuracy_level": 1, "bits": 4}
               for n in nbits)
    assert not any(n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)
                   for n in graph.node)
    ids = np.random.default_rng(0).integers(3, 250, (1, 48))
    kl, top1 = _kl_top1(_logits(formats["int4-qdq"], ids), _logits(twin.parent, ids))
    assert kl < 1e-5 and top1 == 1.0, (kl, top1)


@pytest.mark.parametrize("mode", ["int4-qdq", "fp8-qdq"])
def test_tensorrt_check_accepts_the_graphs(formats, mode):
    from export.trt_compat import check

    rep = check(formats[mode] / "model.onnx")
    assert rep.compatible, rep.problems
    assert rep.dequantize_nodes >= 15


def _dq_model(q: np.ndarray, scale: np.ndarray, zp=None, axis: int = 0, block: int = 0, quantize_input: bool = False):
    from onnx import helper

    inits = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s")]
    ins = ["q", "s"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "z"))
        ins.append("z")
    attrs = {"axis": axis} | ({"block_size": block} if block else {})
    if quantize_input:  # an activation quantized to q's type
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], **attrs),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["y"], **attrs)]
        inits = inits[1:]
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(q.shape))
    else:
        nodes = [helper.make_node("DequantizeLinear", ins, ["w"], **attrs),
                 helper.make_node("MatMul", ["x", "w"], ["y"])]
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, q.shape[0]])
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _int4(a):
    import ml_dtypes

    return np.asarray(a).astype(ml_dtypes.int4)


@pytest.mark.parametrize("case, match", [
    ("int4-zero-point", "zero point is not 0"),
    ("int4-odd-columns", "odd last dimension"),
    ("int4-activation", "INT4 on an activation"),
    ("int8-blocks", "int8 block quantization"),
    ("two-blocked-axes", "one blocked axis"),
    ("uint8", "uint8 zero point"),
])
def test_check_refuses_what_tensorrts_importer_asserts_on(case, match):
    """onnx-tensorrt's QuantDequantLinearHelper (10.1-GA) and TensorRT's INT4 (weight-only) rules, in the export-time
    check the stand-in's parser shares."""
    from export.trt_compat import qdq_problems

    k, n, b = 64, 8, 32
    s = np.full((k // b, n), 0.1, np.float16)
    m = {
        "int4-zero-point": lambda: _dq_model(_int4(np.ones((k, n))), s, zp=_int4(np.ones((k // b, n))), block=b),
        "int4-odd-columns": lambda: _dq_model(_int4(np.ones((k, n - 1))), s[:, :-1], block=b),
        "int4-activation": lambda: _dq_model(_int4(np.ones((k, n))), np.array(0.1, np.float32),
                                             zp=_int4(0), quantize_input=True),
        "int8-blocks": lambda: _dq_model(np.ones((k, n), np.int8), s, block=b),
        "two-blocked-axes": lambda: _dq_model(_int4(np.ones((k, n))), np.full((k // b, n // 2), 0.1, np.float16),
                                              block=b),
        "uint8": lambda: _dq_model(np.ones((k, n), np.uint8), np.full(n, 0.1, np.float32), zp=np.zeros(n, np.uint8),
                                   axis=1),
    }[case]()
    problems = qdq_problems(m)[2]
    assert any(match in p for p in problems), problems


def test_check_takes_a_symmetric_int4_weight_in_blocks():
    from export.trt_compat import qdq_problems

    m = _dq_model(_int4(np.ones((64, 8))), np.full((2, 8), 0.1, np.float16), block=32)
    assert qdq_problems(m)[2] == []


def test_runtime_refuses_an_engine_below_its_sm_in_one_line():
    from edge.backends.choose import engine_mismatch
    from edge.bundle import Fingerprint
    from edge.device.machine import Machine

    t4 = Machine(arch="x86_64", python="3.11", gpu_sm="7.5", gpu_name="T4", tensorrt="10.8.0")
    for precision, need in (("int4-qdq", "8.0"), ("fp8-qdq", "8.9")):
        why = engine_mismatch(Fingerprint("tensorrt", precision, gpu_sm="7.5", tensorrt_version="10.8.0"), t4)
        assert why and f"{precision} needs SM >= {need}" in why and "this GPU is SM 7.5" in why and "\n" not in why


# ----------------------------------------------------------------------------- engines on the TensorRT stand-in


@pytest.fixture(scope="module")
def qdq_bundle(tmp_path_factory, tiny_model_dir):
    """A tiny bundle built by the whole export path (quantize, evaluate, golden prompts) with both formats."""
    from export.recipe import BuildOptions, build

    out = tmp_path_factory.mktemp("qdq-bundles") / "qdq.bundle"
    return build(BuildOptions(output=out, model=str(tiny_model_dir), precisions=("fp32", "int4-qdq", "fp8-qdq"),
                              max_context=256, eval_samples=4, calibration_samples=8), log=lambda s: None).root


def _gpu(fake_gpu, monkeypatch, name: str, sm: str):
    """The stand-in's GPU replaced by another (the fake_gpu fixture plays an SM 8.7 Orin)."""
    from fake_tensorrt import cuda as fcuda

    dev = fcuda.Device(name=name, sm=sm, memory_bytes=24 << 30)
    monkeypatch.setattr(fcuda, "DEVICE", dev)
    return dev


@pytest.mark.parametrize("precision, profile, gpu, sm", [("int4-qdq", "orin-nano-8gb", None, "8.7"),
                                                         ("fp8-qdq", "l4", "L4 (fake)", "8.9")])
def test_build_engine_cli_builds_each_format_with_the_golden_prompts(fake_gpu, monkeypatch, qdq_bundle, tmp_path,
                                                                      capsys, precision, profile, gpu, sm):
    """`edge-chat build-engine` on the profile that runs it: the stand-in parses the Q/DQ graph (INT4 blocks or
    FP8), builds a strongly typed engine, and the engine answers the golden prompts as the graph it came from."""
    import json as _json
    import shutil

    from edge.bundle import Bundle
    from edge.cli import main

    from conftest import trt_errors

    if gpu:
        _gpu(fake_gpu, monkeypatch, gpu, sm)
    path = tmp_path / "b.bundle"
    shutil.copytree(qdq_bundle, path)
    assert main(["build-engine", str(path), "--profile", profile, "--precision", precision]) == 0, \
        capsys.readouterr().err
    name = f"trt-{precision}-sm{sm.replace('.', '')}"
    assert f"built    engines/{name}/model.engine" in capsys.readouterr().out
    b = Bundle.open(path, verify="full")
    e = b.manifest.engine(name)
    assert (e.fingerprint.precision, e.fingerprint.gpu_sm) == (precision, sm)
    assert e.quality["built_from"] == precision and e.quality["device_profile"] == profile
    same, asked = e.quality["golden_same_as_source"].split("/")
    assert same == asked and int(asked) >= 3
    blob = b.path(e.file).read_bytes()
    header = _json.loads(blob[16:16 + int.from_bytes(blob[8:16], "little")])
    assert header["flags"] == []  # strongly typed: the types come from the Q/DQ graph
    assert not trt_errors()
    assert main(["golden", str(path), "--engine", name, "--json"]) == 0
    res = _json.loads(capsys.readouterr().out)
    assert res["engine"] == name and res["same_as_reference"].split("/")[0] == res["same_as_reference"].split("/")[1]


@pytest.mark.parametrize("precision, need", [("int4-qdq", "8.0"), ("fp8-qdq", "8.9")])
def test_build_engine_cli_refuses_each_format_on_a_t4(fake_gpu, monkeypatch, qdq_bundle, tmp_path, capsys,
                                                      precision, need):
    """On a T4 (SM 7.5) `edge-chat build-engine` refuses both formats in one line naming the SM they need and what
    the T4 can build instead, and leaves the bundle as it was; and the stand-in itself, handed the network past
    EdgeChat's settings, refuses to build it as TensorRT does (no INT4/FP8 GEMMs below their SM)."""
    import shutil

    import fake_tensorrt as trt
    from edge.backends.tensorrt.builder import _network
    from edge.bundle import Bundle
    from edge.cli import main

    from conftest import trt_errors

    _gpu(fake_gpu, monkeypatch, "Tesla T4 (fake)", "7.5")
    path = tmp_path / "b.bundle"
    shutil.copytree(qdq_bundle, path)
    before = (path / "manifest.json").read_bytes()
    assert main(["build-engine", str(path), "--profile", "t4", "--precision", precision]) != 0
    err = capsys.readouterr().err
    assert f"{precision} needs SM >= {need}" in err and "SM 7.5" in err and "int8-qdq" in err, err
    assert (path / "manifest.json").read_bytes() == before
    assert not list((path / "engines").glob("trt-*"))
    logger = trt.Logger()
    builder = trt.Builder(logger)
    network, _ = _network(builder, logger, Bundle.open(path).path(f"engines/{precision}/model.onnx"), True)
    assert builder.build_serialized_network(network, builder.create_builder_config()) is None
    assert any("quantized GEMMs on SM 7.5" in m for m in trt_errors()), trt_errors()


def test_the_build_gives_int4_qdq_the_int4_block_and_budget(tmp_path):
    """`edge-export build --precision int4-qdq --int4-block 64 --int4-budget-mb N` reaches int4-qdq's quantize stage
    (it used to be refused as an int4-weight-only flag, and the build passed int4-qdq neither the block nor the
    budget); --int4-head-bits, int4-weight's alone, is still refused without int4-weight."""
    from edge.errors import RecipeError
    from export.cli import make_parser
    from export.recipe import BuildOptions, _quantize_options

    def parse(*flags: str) -> BuildOptions:
        return BuildOptions.from_cli(make_parser().parse_args(["build", "-o", str(tmp_path / "x.bundle"),
                                                               "--precision", "fp32", "--precision", "int4-qdq", *flags]))

    opts = parse("--int4-block", "64", "--int4-budget-mb", "105.4")
    q = _quantize_options(opts, "int4-qdq")
    assert (q.mode, q.int4_block_size, q.int4_budget_mb) == ("int4-qdq", 64, 105.4)
    with pytest.raises(RecipeError, match="--int4-head-bits shapes the int4-weight engine"):
        parse("--int4-head-bits", "4")


def test_int4_qdq_budget_promotes_matmuls_to_int8_within_it(formats, tmp_path, monkeypatch):
    """With a byte budget the MatMuls whose 4-bit form hurts most go to INT8 per channel while the file fits it;
    the rest keep the all-4-bit graph's levels, and GPTQ rounds each MatMul once per form across the two graphs."""
    from export import gptq, quantize
    from export.onnx_weights import graph_bytes

    base = graph_bytes(formats["int4-qdq"] / "model.onnx")
    calls: list[int] = []
    real = gptq.gptq_block_quant
    monkeypatch.setattr(gptq, "gptq_block_quant", lambda w, h, bits, *a, **k: calls.append(bits) or real(w, h, bits, *a, **k))
    dst = tmp_path / "budget"
    dst.mkdir()
    m = quantize.run(formats["fp32"], formats["hf"], dst, quantize.QuantizeOptions(
        mode="int4-qdq", samples=8, gptq_samples=8, int4_budget_mb=base * 1.15 / 1e6))
    assert m["int4_8bit_matmuls"] and graph_bytes(dst / "model.onnx") <= base * 1.15
    promoted = set(m["int4_8bit_matmuls"])
    old = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(formats["int4-qdq"] / "model.onnx")).graph.initializer}
    new = onnx.load(str(dst / "model.onnx"))
    four = [n for n in new.graph.node if n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)]
    assert four and all(np.array_equal(numpy_helper.to_array(next(i for i in new.graph.initializer if i.name == n.input[0])),
                                       old[n.input[0]]) for n in four)
    # 15 for the all-4-bit graph (14 + the head), one per MatMul the sensitivity measures, and only the promoted
    # ones again for the budget's graph (without the reuse: all 15 again)
    assert len(promoted) < 14 and len(calls) < 2 * 15 + len(m["int4_sensitivity"]), (len(calls), len(promoted))


def test_int4_qdq_budgets_share_one_sensitivity_measurement(formats, tmp_path, monkeypatch):
    """The plan recommends the largest budget that fits, so users build several: int4-qdq's per-MatMul sensitivity
    (most of a budgeted build: 4 of SmolLM2's 6 minutes) is kept in OUT.work's root, as int4-weight's, and a
    second budget re-uses it; a new block size measures again. It was measured anew on every build."""
    from export import quantize, sensitivity

    measured: list[int] = []
    real = sensitivity.measure
    monkeypatch.setattr(sensitivity, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    runs = {}
    for name, ratio, block in (("a", 0.15, 32), ("b", 0.05, 32), ("c", 0.15, 16)):
        dst = tmp_path / name
        dst.mkdir()
        runs[name] = quantize.run(formats["fp32"], formats["hf"], dst, quantize.QuantizeOptions(
            mode="int4-qdq", samples=8, gptq_samples=8, int4_extra_ratio=ratio, int4_block_size=block))
    assert len(measured) == 2  # a, then c's new block; b re-used a's
    assert runs["a"]["int4_sensitivity"] == runs["b"]["int4_sensitivity"]
    assert len(runs["b"]["int4_8bit_matmuls"]) < len(runs["a"]["int4_8bit_matmuls"])  # the smaller budget: fewer
    assert len(list(tmp_path.glob("int4-sensitivity-*.json"))) == 2 and not list(tmp_path.glob("*.partial"))
    # a kept file that is not a measurement (cut short, edited by hand) is measured again, not trusted or crashed on
    for bad in ("", "[{\"x\": 1}", "[1, 2]", "[{\"/m\": \"high\"}, 5]"):
        for f in tmp_path.glob("int4-sensitivity-*.json"):
            f.write_text(bad)
        measured.clear()
        again = quantize.run(formats["fp32"], formats["hf"], tmp_path / "b", quantize.QuantizeOptions(
            mode="int4-qdq", samples=8, gptq_samples=8, int4_extra_ratio=0.05))
        assert measured == [1] and again["int4_sensitivity"] == runs["b"]["int4_sensitivity"], bad


@pytest.mark.parametrize("mode", ["int4-weight", "int4-qdq"])
def test_both_int4_engines_round_4_bit_weights_with_the_chosen_gptq_damping(formats, tmp_path, monkeypatch, mode):
    """int4_gptq_damp reaches every 4-bit GPTQ call of both int4 engines (the budget's sensitivity too); the
    8-bit ones keep GPTQ's default."""
    from export import gptq, quantize

    seen: list[tuple[int, float | None]] = []
    real = gptq.gptq_block_quant
    monkeypatch.setattr(gptq, "gptq_block_quant",
                        lambda w, h, bits, *a, **k: seen.append((bits, k.get("damp"))) or real(w, h, bits, *a, **k))
    quantize.run(formats["fp32"], formats["hf"], tmp_path, quantize.QuantizeOptions(
        mode=mode, samples=8, gptq_samples=8, int4_gptq_damp=0.05, int4_extra_ratio=0.1))
    assert {d for b, d in seen if b == 4} == {0.05} and {d for b, d in seen if b == 8} == {None}
    assert sum(b == 4 for b, _ in seen) >= 14  # the 14 body MatMuls at least once
    with pytest.raises(RecipeError, match="int4_gptq_damp must be in"):
        quantize.QuantizeOptions(mode=mode, int4_gptq_damp=0)
