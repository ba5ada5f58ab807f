"""TensorRT up to the GPU boundary: builder settings per device (exact values), the export-time
TensorRT compatibility check, machine detection from Jetson identity files, the fallback decision
table, the RAM refusal and the CLIs. The engine build and decode against the TensorRT stand-in:
tests/test_tensorrt_engine.py (and the fp16 test below, which uses real TensorRT where it exists)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import embedding_forms, run_cli
from edge.backends.choose import decide, engine_mismatch
from edge.bundle import Bundle, EngineEntry, Fingerprint, ModelDims
from edge.errors import BundleError
from edge.io_contract import DecoderIO
from edge.device.machine import Machine, detect, interpret
from edge.device.probe import probe
from edge.device.profiles import load_profile
from edge.backends.tensorrt.settings import (BuildSettingsError, InsufficientMemoryError, builder_settings, check_build_ram,
                               shape_profiles)

MiB = 1 << 20
DIMS = ModelDims("LlamaForCausalLM", num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                 intermediate_size=1536, vocab_size=49152, max_context=8192)
IO = DecoderIO()

# device -> (precision, TensorRT) -> workspace MiB, flags, strongly typed, max batch, max context
EXPECTED = {
    "t4": ("fp16", "10.8", 3635, ("FP16",), False, 8, 4096),
    "l4": ("int8-qdq", "11.0", 4096, (), True, 16, 8192),
    "orin-nano-8gb": ("fp16", "10.3", 1459, ("FP16",), False, 4, 4096),
    "orin-nx-16gb": ("fp16", "10.3", 3097, ("FP16",), False, 8, 4096),
    "agx-orin-32gb": ("int8-qdq", "10.3", 4096, (), True, 16, 8192),
    "agx-orin-64gb": ("fp16", "10.3", 4096, ("FP16",), False, 16, 8192),
}


@pytest.mark.parametrize("device", sorted(EXPECTED))
def test_builder_settings_per_device(device, tmp_path):
    precision, trt, ws_mib, flags, strongly, batch, ctx = EXPECTED[device]
    s = builder_settings(load_profile(device), DIMS, IO, precision, trt, cache_root=tmp_path)
    assert (s.workspace_bytes, s.flags, s.strongly_typed, s.max_batch, s.max_context) == \
        (ws_mib * MiB, flags, strongly, batch, ctx)
    assert s.timing_cache == str(tmp_path / "tensorrt" / f"timing-sm{s.gpu_sm.replace('.', '')}-trt{trt}.cache")
    prefill, decode = s.profiles
    k = IO.past_key.format(i=0)
    assert prefill.shapes[IO.input_ids] == ((1, 1), (1, 512), (1, 512))  # opt: a full chunk
    # each point consistent (mask = past + tokens: TensorRT shape-checks min, opt and max), opt past not empty
    assert prefill.shapes[IO.attention_mask] == ((1, 1), (1, ctx // 4 + 512), (1, ctx - 1 + 512))
    assert prefill.shapes[k] == ((1, 3, 0, 64), (1, 3, ctx // 4, 64), (1, 3, ctx - 1, 64))  # a last chunk starts below ctx
    assert decode.shapes[IO.input_ids] == ((1, 1), (batch // 2, 1), (batch, 1))
    assert decode.shapes[IO.attention_mask] == ((1, 2), (batch // 2, ctx // 4 + 1), (batch, ctx))
    assert decode.shapes[k] == ((1, 3, 1, 64), (batch // 2, 3, ctx // 4, 64), (batch, 3, ctx - 1, 64))
    assert len(decode.shapes) == 3 + 2 * DIMS.num_layers


def test_shapes_follow_the_model_context():
    small = dataclasses.replace(DIMS, max_context=256)
    s = builder_settings(load_profile("orin-nano-8gb"), small, IO, "fp16", "10.3")
    assert s.max_context == 256
    prefill, decode = shape_profiles(small, IO, 4, 256)
    assert prefill.shapes[IO.input_ids][2] == (1, 256) and decode.shapes[IO.attention_mask][2] == (4, 256)


@pytest.mark.parametrize("device, precision, trt, graph, match", [
    ("t4", "bf16", "10.8", None, r"bf16 needs SM >= 8.0 \(BF16 tensor cores"),
    ("t4", "fp8-qdq", "10.8", None, r"fp8-qdq needs SM >= 8.9 .*this GPU is SM 7.5 \(build one of fp32, fp16, int8-qdq"),
    ("t4", "int4-qdq", "10.8", None, r"int4-qdq needs SM >= 8.0 \(TensorRT's INT4 weight-only"),
    ("orin-nano-8gb", "fp8-qdq", "10.3", None, r"fp8-qdq needs SM >= 8.9 .*this GPU is SM 8.7"),
    ("l4", "fp16", "11.0", None, "strongly typed"),
    ("orin-nano-8gb", "int8-dynamic", "10.3", None, "ONNX Runtime graph"),
    ("orin-nano-8gb", "fp16", "8.6", None, "too old"),
    ("cpu", "fp16", "10.3", None, "no NVIDIA GPU"),
])
def test_builder_refuses_what_cannot_work(device, precision, trt, graph, match):
    with pytest.raises(BuildSettingsError, match=match):
        builder_settings(load_profile(device), DIMS, IO, precision, trt, graph_precision=graph)


def test_flags_by_tensorrt_version():
    l4 = load_profile("l4")
    assert builder_settings(l4, DIMS, IO, "fp16", "11.0", graph_precision="fp16").strongly_typed
    assert builder_settings(l4, DIMS, IO, "bf16", "10.8").flags == ("BF16",)
    assert builder_settings(l4, DIMS, IO, "fp32", "11.0").strongly_typed
    assert not builder_settings(l4, DIMS, IO, "fp32", "10.8").strongly_typed
    vc = builder_settings(l4, DIMS, IO, "int8-qdq", "10.8", version_compatible=True)
    assert vc.flags == ("VERSION_COMPATIBLE",) and vc.version_compatible


def test_build_ram_is_what_tensorrts_guide_says_a_build_holds():
    """Two copies of the weights (the parsed network's and the engine's: TensorRT's "How TensorRT Works" > Memory >
    The Build Phase), the CUDA context and libraries, and on a Jetson's unified memory the builder's workspace too;
    the copies are pageable, so a Jetson's swap counts for them, never for the resident part."""
    from edge.backends.tensorrt.settings import build_ram, workspace_bytes

    nano, t4 = load_profile("orin-nano-8gb"), load_profile("t4")
    ws = workspace_bytes(nano)
    assert ws == 1459 * 2**20  # a quarter of 6.6 - 0.9 GB
    need = build_ram(500_000_000, nano)
    assert need.pageable == 1e9 and need.resident == pytest.approx(0.9e9 + ws)
    assert build_ram(500_000_000, t4).resident == pytest.approx(t4.facts["runtime_overhead_gb"] * 1e9)  # own VRAM
    assert build_ram(500_000_000, nano, source_bytes=2e9).pageable == 2.5e9  # fp16 engine from the fp32 graph
    assert check_build_ram(500_000_000, 5.0, nano, 4096) == pytest.approx(need.total_gb)
    big = build_ram(4_759_000_000, nano)  # Llama-3-8B int4-qdq: 9.5 GB of copies, 2.4 GB resident
    assert not big.fits(6.6) and big.fits(6.6, swap_gb=6.0) and not big.fits(2.0, swap_gb=50.0)
    assert big.swap_needed_gb(6.6) == pytest.approx(big.total_gb - 6.6)


def test_build_ram_refusal_names_the_fix():
    nano, t4 = load_profile("orin-nano-8gb"), load_profile("t4")
    with pytest.raises(InsufficientMemoryError, match=r"about 7.4 GB .* 6.6 GB of RAM is available: add 1 GB or more of swap"):
        check_build_ram(2_500_000_000, None, nano, 4096)  # None: the profile's host RAM
    assert check_build_ram(2_500_000_000, None, nano, 4096, swap_gb=2.0) == pytest.approx(7.4, abs=0.05)  # with swap
    with pytest.raises(InsufficientMemoryError, match="build on a machine with more RAM.*lower --max-context"):
        check_build_ram(16_000_000_000, 32.0, t4, 4096, swap_gb=64.0)  # a workstation GPU's swap does not count


def test_plan_refuses_a_build_that_would_run_out_of_ram(tiny_bundle):
    from edge.backends.tensorrt.builder import plan_build

    with pytest.raises(InsufficientMemoryError, match=r"add 3 GB or more of swap .* CUDA runtime must fit in RAM"):
        plan_build(tiny_bundle, "orin-nano-8gb", "fp16", available_gb=0.0001)
    plan = plan_build(tiny_bundle, "orin-nano-8gb", "int8-qdq", available_gb=4.0)
    assert plan.source.name == "int8-qdq" and plan.engine_name == "trt-int8-qdq-sm87"
    assert plan.settings.strongly_typed and plan.settings.max_context == tiny_bundle.manifest.model.max_context


# ----------------------------------------------------------------------------- compatibility check


def test_bundle_graphs_checked_for_tensorrt(tiny_bundle):
    from export import trt_compat

    q = {e.name: e.quality for e in tiny_bundle.manifest.engines}
    assert q["fp32"]["tensorrt_check"]["compatible"] and q["int8-qdq"]["tensorrt_check"]["compatible"]
    assert q["int8-qdq"]["tensorrt_check"]["qdq_nodes"] > 0
    assert q["int8-qdq"]["tensorrt_check"]["tensorrt_version"] == trt_compat.DEFAULT_TENSORRT == "10.3"
    assert "tensorrt_check" not in q["int8-dynamic"]  # an ONNX Runtime graph, never given to TensorRT
    rep = trt_compat.check(tiny_bundle.path("engines/int8-dynamic/model.onnx"))
    assert not rep.compatible and "com.microsoft.MatMulNBits" in rep.problems[0]


def _qdq_graph(*, zp_dtype=np.int8, zp=0, scale=0.05, act_scale_shape=(), w_axis=1, opset=17, op="MatMul"):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((8, 4), dtype=np.int8), "w_q")
    w_scale = numpy_helper.from_array(np.full((4 if w_axis == 1 else 8,), 0.1, np.float32), "w_scale")
    w_zp = numpy_helper.from_array(np.zeros((4 if w_axis == 1 else 8,), np.int8), "w_zp")
    a_scale = numpy_helper.from_array(np.full(act_scale_shape, scale, np.float32), "a_scale")
    a_zp = numpy_helper.from_array(np.full(act_scale_shape, zp, zp_dtype), "a_zp")
    nodes = [helper.make_node("QuantizeLinear", ["x", "a_scale", "a_zp"], ["xq"], name="q_x"),
             helper.make_node("DequantizeLinear", ["xq", "a_scale", "a_zp"], ["xd"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["wd"], name="dq_w", axis=w_axis)]
    if op == "MatMul":
        nodes.append(helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm"))
    else:  # a graph an int8-dynamic quantizer would write
        nodes.append(helper.make_node("MatMulInteger", ["xq", "w_q"], ["y"], name="mmi"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                          initializer=[w, w_scale, w_zp, a_scale, a_zp])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("kw, match", [
    ({}, None),
    ({"zp_dtype": np.uint8, "zp": 128}, "uint8 zero point"),
    ({"zp": 3}, "zero point is not 0"),
    ({"scale": float("inf")}, "finite and > 0"),
    ({"scale": 0.0}, "finite and > 0"),
    ({"act_scale_shape": (8,)}, "activations per tensor"),
    ({"w_axis": 0}, "axis 0, but MatMul 'mm' has its output channels on axis 1"),
    ({"opset": 22}, "opset 22 is outside the 9-21"),
    ({"op": "MatMulInteger"}, "ops TensorRT does not support: MatMulInteger"),
])
def test_compat_check_catches_what_tensorrt_rejects(kw, match):
    from export import trt_compat

    rep = trt_compat.check(_qdq_graph(**kw))
    if match is None:
        assert rep.compatible, rep.problems
        assert (rep.quantize_nodes, rep.dequantize_nodes) == (1, 2)
    else:
        assert not rep.compatible and any(match in p for p in rep.problems), rep.problems
        with pytest.raises(trt_compat.TensorRTCompatibilityError, match="would not build with TensorRT"):
            trt_compat.require_compatible(_qdq_graph(**kw), "test graph")


# ----------------------------------------------------------------------------- this machine


def _device_root(tmp_path: Path, tegra: str | None, model: str | None, mem_gb: float) -> Path:
    root = tmp_path / "device"
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "etc").mkdir()
    if tegra:
        (root / "etc/nv_tegra_release").write_text(tegra)
    if model:
        (root / "proc/device-tree/model").write_bytes(model.encode() + b"\x00")  # the device tree NUL-terminates
    kb = int(mem_gb * 1e9 / 1024)
    (root / "proc/meminfo").write_text(f"MemTotal:       {kb} kB\nMemFree: 1000 kB\nMemAvailable:   {kb // 2} kB\n")
    return root


R36_4_3 = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"


@pytest.mark.parametrize("tegra, model, mem_gb, profile, jetpack, trt", [
    (R36_4_3, "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", 7.6, "orin-nano-8gb@super", "6.2", "10.3"),
    (R36_4_3.replace("4.3", "4.0"), "NVIDIA Jetson AGX Orin Developer Kit", 62.8, "agx-orin-64gb", "6.1", "10.3"),
    (R36_4_3, "NVIDIA Jetson AGX Orin", 30.6, "agx-orin-32gb", "6.2", "10.3"),
    (R36_4_3.replace("4.3", "3.0"), "NVIDIA Jetson Orin NX Engineering Reference Developer Kit", 15.3, "orin-nx-16gb",
     "6.0", "8.6"),
])
def test_jetson_detected_from_its_identity_files(tmp_path, tegra, model, mem_gb, profile, jetpack, trt):
    m = detect(root=str(_device_root(tmp_path, tegra, model, mem_gb)))
    assert m.jetson and m.profile == profile and m.jetpack == jetpack and m.gpu_sm == "8.7"
    assert m.tensorrt == trt and m.tensorrt_source.startswith("JetPack")  # no TensorRT Python here: from the table
    assert m.module == model and m.mem_total_gb == pytest.approx(mem_gb, abs=0.01)


@pytest.mark.parametrize("model, mem_gb, match", [
    ("NVIDIA Jetson Orin Nano Developer Kit", 3.6, "less than the 8 GB module"),
    ("NVIDIA Jetson Xavier NX Developer Kit", 7.6, "no EdgeChat device profile for 'NVIDIA Jetson Xavier NX"),
])
def test_unknown_jetson_module_is_named(tmp_path, model, mem_gb, match):
    m = detect(root=str(_device_root(tmp_path, R36_4_3, model, mem_gb)))
    assert m.jetson and m.profile is None and match in m.profile_error


def test_this_machine_without_gpu_says_why(tmp_path):
    m = detect(root=str(_device_root(tmp_path, None, None, 24)))
    assert not m.jetson and not m.has_gpu and m.profile is None
    assert m.gpu_error  # cuda-python imports, the driver is absent: reported, not raised
    assert "CPUExecutionProvider" in m.ort_providers


def test_probe_runs_alone_on_a_bare_python(tmp_path):
    """deploy pipes edge/device/probe.py into the device's python3 before anything is installed there."""
    root = _device_root(tmp_path, R36_4_3, "NVIDIA Jetson Orin Nano Developer Kit", 7.6)
    src = (Path(__file__).parent.parent / "edge" / "device" / "probe.py").read_text()
    out = subprocess.run([sys.executable, "-S", "-", str(tmp_path / "releases")], input=src, capture_output=True,
                         text=True, env={"EDGECHAT_DEVICE_ROOT": str(root), "PATH": os.environ["PATH"]}, timeout=60)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert "onnxruntime" not in facts  # -S: no site-packages, like a fresh device
    assert facts["disk_free_bytes"] > 0 and facts["mem_total_bytes"] == int(7.6e9 / 1024) * 1024
    assert interpret(facts).profile == "orin-nano-8gb"


# ----------------------------------------------------------------------------- the fallback chain


def _machine(**kw) -> Machine:
    base = dict(arch="x86_64", python="3.11", onnxruntime="1.32.0", ort_providers=["CPUExecutionProvider"])
    return Machine(**(base | kw))


ORIN = dict(arch="aarch64", jetson=True, gpu_sm="8.7", gpu_name="Orin", tensorrt="10.3.0", tensorrt_source="python",
            cuda_bindings="cuda-python", ort_providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
T4 = dict(gpu_sm="7.5", gpu_name="Tesla T4", tensorrt="10.8.0", tensorrt_source="python", cuda_bindings="cuda-python",
          ort_providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def _with_engine(manifest, sm="8.7", trt="10.3.0", vc=False):
    fp = Fingerprint(format="tensorrt", precision="fp16", gpu_sm=sm, tensorrt_version=trt, version_compatible=vc)
    return dataclasses.replace(manifest, engines=[*manifest.engines,
                                                  EngineEntry("trt-fp16-sm87", "engines/x/model.engine", fp)])


@pytest.mark.parametrize("machine, engine_kw, backend, engine, skipped", [
    (_machine(), None, "onnxruntime-cpu", "int8-dynamic",
     ["the bundle has no TensorRT engine", "here has only CPUExecutionProvider"]),
    (_machine(**ORIN), {}, "tensorrt", "trt-fp16-sm87", []),
    (_machine(**T4), {}, "onnxruntime-cuda", "fp32",
     ["engine built for SM 8.7 with TensorRT 10.3.0; this is SM 7.5 with TensorRT 10.8.0"]),
    (_machine(**ORIN | {"tensorrt": "10.4.0"}), {}, "onnxruntime-cuda", "fp32",
     ["run only on the TensorRT that built them"]),
    (_machine(**ORIN | {"tensorrt": "10.4.0"}), {"vc": True}, "tensorrt", "trt-fp16-sm87", []),
    (_machine(**ORIN | {"tensorrt": "11.0.0"}), {"vc": True}, "onnxruntime-cuda", "fp32", ["version-compatible"]),
    (_machine(**ORIN | {"cuda_bindings": None}), {}, "onnxruntime-cuda", "fp32", ["pip install cuda-python"]),
    (_machine(**ORIN | {"tensorrt_source": "header (no Python bindings)"}), {}, "onnxruntime-cuda", "fp32",
     ["python3-libnvinfer"]),
    (_machine(**T4 | {"ort_providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]}),
     None, "onnxruntime-tensorrt", "int8-qdq", ["edge-chat build-engine"]),
    (_machine(ort_providers=["CUDAExecutionProvider", "CPUExecutionProvider"], gpu_error="no driver"), {},
     "onnxruntime-cpu", "int8-dynamic", ["this machine has no usable NVIDIA GPU (no driver)",
                                         "installed but no usable GPU (no driver)"]),
    (_machine(**ORIN | {"ort_providers": ["CPUExecutionProvider"]}), {"sm": "8.9"}, "onnxruntime-cpu",
     "int8-dynamic", ["SM 8.9", "install onnxruntime-gpu"]),
])
def test_fallback_decision_table(tiny_bundle, machine, engine_kw, backend, engine, skipped):
    m = tiny_bundle.manifest if engine_kw is None else _with_engine(tiny_bundle.manifest, **engine_kw)
    c = decide(m, machine)
    assert (c.backend, c.engine) == (backend, engine), c
    for words in skipped:
        assert any(words in line for line in c.skipped), (words, c.skipped)
    assert len(c.skipped) == len(skipped) or backend != "tensorrt"


def test_forced_engine_and_nothing_runnable(tiny_bundle):
    assert decide(tiny_bundle.manifest, _machine(), engine="fp32").engine == "fp32"
    only_trt = dataclasses.replace(_with_engine(tiny_bundle.manifest),
                                   engines=[_with_engine(tiny_bundle.manifest).engines[-1]])
    with pytest.raises(BundleError, match="ONNX Runtime is not installed"):
        decide(only_trt, _machine(onnxruntime=None, ort_providers=[]))
    with pytest.raises(BundleError, match="nothing in this bundle runs on this machine"):
        decide(only_trt, _machine())
    assert engine_mismatch(only_trt.engines[0].fingerprint, _machine(**ORIN)) is None


def test_cuda_layer_fails_cleanly_without_a_driver():
    pytest.importorskip("cuda", reason="cuda-python not installed")
    from edge.backends.tensorrt.cuda_mem import CudaError, open_cuda

    if detect().has_gpu:
        pytest.skip("this machine has a GPU: the no-driver path cannot be shown here")
    with pytest.raises(CudaError, match="driver"):
        open_cuda()


# ----------------------------------------------------------------------------- CLIs


def test_build_engine_cli_up_to_tensorrt(tiny_bundle, tmp_path):
    b = tmp_path / "b.bundle"
    shutil.copytree(tiny_bundle.root, b)
    r = run_cli("edge.cli", "build-engine", str(b), "--profile", "orin-nano-8gb", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "trt-fp16-sm87 for Jetson Orin Nano 8GB from engines/fp32/model.onnx, TensorRT 10.3" in r.stdout
    plan = json.loads(r.stdout[r.stdout.index("{"):])
    assert plan["settings"]["workspace_bytes"] == 1459 * MiB and plan["settings"]["flags"] == ["FP16"]
    r = run_cli("edge.cli", "build-engine", str(b), "--profile", "orin-nano-8gb", "--precision", "int8-qdq")
    if importlib_has("tensorrt"):
        pytest.skip("TensorRT is installed: the GPU test below covers the real build")
    assert r.returncode == 2 and "needs the package 'tensorrt'" in r.stderr and "python3-libnvinfer" in r.stderr
    assert Bundle.open(b, verify="full").manifest.engines == tiny_bundle.manifest.engines  # nothing half-written
    r = run_cli("edge.cli", "build-engine", str(b))
    assert r.returncode == 2 and "cannot tell which device this is" in r.stderr and "--profile" in r.stderr
    r = run_cli("export.cli", "engines", str(b), "--target", "orin-nano-8gb")
    assert r.returncode == 2 and "built on the device itself" in r.stderr
    r = run_cli("export.cli", "engines", str(b), "--target", "t4", "--precision", "bf16")
    assert r.returncode == 2 and "bf16 needs SM >= 8.0" in r.stderr


def test_info_says_which_backend_and_why(tiny_bundle):
    r = run_cli("edge.cli", "info", str(tiny_bundle.root))
    assert r.returncode == 0, r.stderr
    assert "skip   TensorRT: the bundle has no TensorRT engine" in r.stdout
    assert "here     would run 'int8-dynamic' with ONNX Runtime on CPU" in r.stdout


def importlib_has(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


# ----------------------------------------------------------------------------- on a real GPU


def test_fp16_engine_matches_onnxruntime(request, tiny_bundle, tmp_path):
    """With TensorRT and a known GPU: the real build. Without (here): the same code against the strict
    TensorRT stand-in (tests/fake_tensorrt), which computes in fp32, so only the real run checks FP16 numerics."""
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.backends.tensorrt.builder import build_engine, plan_build
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    profile = None
    if importlib_has("tensorrt"):
        here = detect()
        if not here.has_gpu or not here.profile:
            pytest.skip(f"TensorRT imports but no known GPU here ({here.gpu_error or here.gpu_name})")
        profile = here.profile
    else:  # TensorRT cannot be installed here (its pip package fetches from NVIDIA's index):
        # the stand-in plays TensorRT 10.3 on an SM 8.7 GPU
        request.getfixturevalue("fake_gpu")
        here, profile = detect(), "orin-nano-8gb"
    b = tmp_path / "b.bundle"
    shutil.copytree(tiny_bundle.root, b)
    bundle = Bundle.open(b)
    entry = build_engine(plan_build(bundle, profile, "fp16", tensorrt_version=here.tensorrt), here)
    bundle = Bundle.open(b, verify="full")
    assert bundle.manifest.engine(entry.name).fingerprint.gpu_sm == here.gpu_sm
    ort = Generator.from_bundle(bundle, engine="fp32", providers=["CPUExecutionProvider"])
    trt = Generator(ort.tokenizer, TensorRTDecoder.from_entry(bundle, entry), bundle.manifest.generation, bundle)
    ids = ort.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    cfg = SamplingConfig(max_new_tokens=16, ignore_eos=True)
    a, b_ = ort.complete(ids, cfg)[1].token_ids, trt.complete(ids, cfg)[1].token_ids
    assert a[:8] == b_[:8], (a, b_)


def test_tensorrt_decoder_takes_every_call_the_generator_makes():
    """The generation loop and the scheduler call the TensorRT decoder as they call the ONNX Runtime one
    (checked here without a GPU: a missing parameter would only show up as a TypeError on the device)."""
    import inspect

    from edge.backends.onnxruntime import OrtDecoder
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    from edge.backends.decoder import Decoder

    assert issubclass(TensorRTDecoder, Decoder) and issubclass(OrtDecoder, Decoder)
    assert not TensorRTDecoder.__abstractmethods__  # every method the loop calls is implemented
    for name in ("new_cache", "run", "to_device"):
        want = list(inspect.signature(getattr(Decoder, name)).parameters)
        assert list(inspect.signature(getattr(TensorRTDecoder, name)).parameters) == want, name


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    from edge.device.probe import cpu_flags

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_vnni\n\n"
                                           "processor\t: 1\nflags\t\t: fpu avx2 avx512_vnni\n")
    assert cpu_flags(tmp_path) == {"fpu", "avx2", "avx512_vnni"}
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert cpu_flags(tmp_path) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags(tmp_path / "nowhere") == set()


# ----------------------------------------------------------------------------- op x input-type table


@pytest.mark.parametrize("version", ["10.3", "11.0"])
def test_node_types_checked_against_the_tensorrt_table(tiny_plain_graph, tmp_path, version):
    """The old int8-qdq embedding (Gather and Cast on INT8) is flagged, node by node, with the fix; the
    DequantizeLinear -> Gather form, the fp32 and the fp16 graphs pass."""
    import onnx

    from export import fp16, trt_compat

    forms = embedding_forms(tiny_plain_graph, tmp_path)
    old = trt_compat.node_problems(onnx.load(str(forms["gather-int8"]), load_external_data=False), version)
    assert len(old) == 2, old
    gather, cast = old
    assert gather.startswith("Gather '/model/embed_tokens/Gather/GatherInt8': input 0") and " is INT8;" in gather
    assert f"TensorRT {version} takes Gather on BF16, BOOL, FP16, FP32, INT32, INT64 only" in gather
    assert "dequantize first (DequantizeLinear -> Gather)" in gather
    assert cast.startswith("Cast '/model/embed_tokens/Gather/Cast'") and " is INT8;" in cast
    assert not trt_compat.check(forms["gather-int8"]).compatible  # check() reports them too
    (tmp_path / "fp16").mkdir()
    fp16.run(tiny_plain_graph, tmp_path / "fp16")
    for path in (forms["dq-gather"], tiny_plain_graph / "model.onnx", tmp_path / "fp16" / "model.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        assert trt_compat.node_problems(model, version) == [], path
        assert trt_compat.check(path, version).compatible, path


def test_op_outside_the_table_and_an_fp16_op_tensorrt_lacks_are_flagged():
    from onnx import TensorProto, helper

    from export import trt_compat

    def graph(op: str, dtype: int):
        g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="n")], "g",
                              [helper.make_tensor_value_info("x", dtype, [2, 3])],
                              [helper.make_tensor_value_info("y", dtype, [2, 3])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    assert trt_compat.node_problems(graph("Hardmax", TensorProto.FLOAT), "10.3") == [
        "Hardmax 'n': Hardmax is not in export/tensorrt_ops.toml for TensorRT 10.3: add its row from onnx-tensorrt's "
        "docs/operators.md if TensorRT supports it, or export the graph without it"]
    (p,) = trt_compat.node_problems(graph("Relu", TensorProto.DOUBLE), "10.3")
    assert "input 0 'x' is DOUBLE; TensorRT 10.3 takes Relu on BF16, FP16, FP32, INT32, INT64 only" in p
    assert trt_compat.node_problems(graph("Relu", TensorProto.FLOAT16), "10.3") == []
    with pytest.raises(ValueError, match="not like 10.3"):
        trt_compat.node_problems(graph("Relu", TensorProto.FLOAT), "ten")


def test_op_table_loads_with_its_sources():
    from export import trt_compat

    table = trt_compat.load_op_table()
    assert "onnx-tensorrt" in table.source and "10.0" in table.versions
    assert table.ops["DequantizeLinear"].allowed((10, 3)) == {"INT8", "FP8", "INT4"}
    assert table.ops["Gather"].inputs == (0,) and "INT8" not in table.ops["Gather"].allowed((11, 0))
    assert table.ops["Add"].allowed((9, 0)) is None  # the table starts at TensorRT 10


def test_default_tensorrt_version_is_the_lowest_a_profile_names():
    from edge.device.profiles import available
    from export import trt_compat

    named = {v for p in available() for v in load_profile(p).tensorrt_versions if "." in v}  # "10" is any 10.x
    assert trt_compat.DEFAULT_TENSORRT == min(named, key=lambda v: tuple(map(int, v.split("."))))
