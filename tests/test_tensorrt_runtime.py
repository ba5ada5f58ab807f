"""The TensorRT runtime where the stand-in is as strict as the GPU: TensorRT 11's strong typing, version-compatible
plans, one activation block for both contexts, buffers reused across tokens, a driver older than the CUDA
bindings, and decoding on the server's scheduler thread (CUDA contexts are per thread; pycuda's are not the
runtime's). Each test here failed on the runtime before these rules were kept (see docs/tensorrt.md)."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import numpy as np
import pytest

from edge.bundle import Bundle
from edge.errors import BundleError

from conftest import TRT_PROFILE as PROFILE, build_trt as _build, trt_errors as _errors  # noqa: E402


def _header(path) -> dict:
    import json

    blob = path.read_bytes()
    return json.loads(blob[16:16 + int.from_bytes(blob[8:16], "little")])


# ----------------------------------------------------------------------------- TensorRT 11


def test_tensorrt11_has_no_precision_flags_and_builds_strongly_typed(fake_gpu, bundle_copy, monkeypatch):
    import fake_tensorrt
    import tensorrt as trt

    from edge.backends.tensorrt.builder import plan_build
    from edge.backends.tensorrt.settings import BuildSettingsError

    monkeypatch.setattr(fake_tensorrt, "__version__", "11.4.0")
    assert not hasattr(trt.BuilderFlag, "FP16") and not hasattr(trt.BuilderFlag, "INT8")
    assert hasattr(trt.BuilderFlag, "VERSION_COMPATIBLE")
    with pytest.raises(BuildSettingsError, match="builds only strongly typed networks"):
        plan_build(Bundle.open(bundle_copy), PROFILE, "fp16", tensorrt_version="11.4.0", available_gb=8.0)
    entry = _build(bundle_copy, "fp32", recheck=True)
    assert _header(Bundle.open(bundle_copy).path(entry.file))["strongly_typed"]
    same, asked = entry.quality["golden_same_as_source"].split("/")
    assert same == asked


# ----------------------------------------------------------------------------- version-compatible plans


def test_version_compatible_plan_loads_with_host_code_allowed(fake_gpu, bundle_copy, monkeypatch):
    """TensorRT refuses a version-compatible plan unless the runtime allows engine host code; the decoder allows
    it exactly when the bundle's fingerprint says the engine was built version-compatible."""
    import fake_tensorrt
    import tensorrt as trt

    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy, version_compatible=True)
    b = Bundle.open(bundle_copy)
    assert entry.fingerprint.version_compatible
    plan = b.path(entry.file).read_bytes()
    assert trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan) is None
    assert "setEngineHostCodeAllowed" in _errors()[-1]
    monkeypatch.setattr(fake_tensorrt, "__version__", "10.8.0")  # a later 10.x runs it
    dec = TensorRTDecoder.from_entry(b, entry)
    assert dec.prefill([5, 6, 7], dec.new_cache()).shape == (1, dec.dims.vocab_size)
    m = b.manifest
    from edge.io_contract import DecoderIO

    with pytest.raises(BundleError, match="could not load"):  # the same plan, not declared version-compatible
        TensorRTDecoder(b.path(entry.file), m.model, DecoderIO.from_dict(m.engine_io(entry)))


# ----------------------------------------------------------------------------- device memory


def test_both_contexts_share_one_activation_block(fake_gpu, bundle_copy):
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy)
    before = fake_gpu.used
    dec = TensorRTDecoder.from_entry(Bundle.open(bundle_copy), entry)
    block = dec.engine_.device_memory_size_v2
    assert len(dec.contexts) == 2 and {c.memory for c in dec.contexts} == {(dec.activations.ptr, block)}
    assert fake_gpu.used - before < 2 * block  # one block (+ the stream's nothing), not one per context
    dec.prefill([5, 6, 7, 8], dec.new_cache())  # and it runs in it


def test_a_decode_step_allocates_only_its_kv_cache(fake_gpu, bundle_copy, monkeypatch):
    """Inputs and logits go to device buffers reused across tokens: each step's cudaMalloc calls are the
    present K/V it returns (they become the next past), nothing else."""
    from fake_tensorrt import cuda as fcuda

    from edge.backends.tensorrt.runtime import TensorRTDecoder

    dec = TensorRTDecoder.from_entry(Bundle.open(bundle_copy), _build(bundle_copy))
    cache = dec.new_cache()
    dec.prefill([5, 6, 7, 8], cache)
    dec.forward(np.array([[9]]), cache)  # the decode profile's scratch views exist from here on
    calls = []
    real = fcuda.runtime.cudaMalloc
    monkeypatch.setattr(fcuda.runtime, "cudaMalloc", lambda n: (calls.append(n), real(n))[1])
    for t in range(10):
        dec.forward(np.array([[10 + t]]), cache)
    assert len(calls) == 10 * len(dec.present_names)


# ----------------------------------------------------------------------------- driver and bindings


def test_bindings_newer_than_the_driver_say_which_cuda_python_to_install(fake_gpu, monkeypatch):
    """cuda-python 13 on a CUDA 12 driver (JetPack 6, most T4/L4 clouds) answers cudaErrorInsufficientDriver to
    everything: say what to install instead."""
    from fake_tensorrt import cuda as fcuda

    from edge.backends.tensorrt.cuda_mem import CudaError, open_cuda

    monkeypatch.setattr(fcuda.runtime, "BINDINGS_CUDA", "13.0")
    fake_gpu.driver_cuda = "12.6"
    with pytest.raises(CudaError, match=r"built for CUDA 13, but this NVIDIA driver runs CUDA 12.6 at most: "
                                        r"pip install 'cuda-python>=12.0,<13'"):
        open_cuda()
    fake_gpu.driver_cuda = "13.0"
    assert open_cuda().stream_handle


# ----------------------------------------------------------------------------- threads


def _pycuda_only(monkeypatch) -> None:
    """pycuda and no cuda-python (older Jetson images); `import pycuda.autoinit` does what the real one does."""
    from fake_tensorrt import cuda as fcuda

    for name, mod in (("pycuda", fcuda.pycuda), ("pycuda.driver", fcuda.pycuda_driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "pycuda.autoinit", raising=False)
    monkeypatch.setattr(sys, "meta_path", [fcuda.PycudaAutoinit(), *sys.meta_path])
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cuda" else
                        (object() if name == "pycuda" else real_find(name, *a)))


@pytest.mark.parametrize("bindings", ["cuda-python", "pycuda"])
def test_the_server_decodes_on_its_scheduler_thread(fake_gpu, bundle_copy, monkeypatch, bindings):
    """`edge-chat serve` loads the engine on the main thread and decodes on the scheduler's: the CUDA context
    must be current there (pycuda's autoinit context is current only where it was imported)."""
    from edge.decode.generate import Generator
    from edge.decode.scheduler import Scheduler

    if bindings == "pycuda":
        _pycuda_only(monkeypatch)
    _build(bundle_copy)
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert gen.choice.backend == "tensorrt" and type(gen.decoder.cuda).__name__ == \
        ("PyCuda" if bindings == "pycuda" else "CudaPython")
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of Japan?"}])
    cfg = gen.sampling(max_new_tokens=8, temperature=0)
    alone = "".join(ev.text for ev in gen.stream(ids, cfg))
    sched = Scheduler(gen, max_batch=2).start()
    try:
        text, last = sched.submit(ids, cfg).answer(timeout=60)
    finally:
        sched.stop()
    assert last.finish_reason in ("stop", "length"), last.stats
    assert text == alone


# ----------------------------------------------------------------------------- the stand-in itself


def test_the_stand_in_runs_an_engine_at_stream_synchronization(fake_gpu, bundle_copy):
    """Work queued on a stream has not run until the stream is synchronized (what makes buffer-lifetime
    bugs show): the logits buffer is untouched after enqueue, filled after the sync."""
    from edge.backends.tensorrt.cuda_mem import DeviceArray
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    dec = TensorRTDecoder.from_entry(Bundle.open(bundle_copy), _build(bundle_copy))
    ctx = dec.contexts[0]
    io = dec.io
    with dec.cuda.active():
        for name, arr in ((io.input_ids, np.array([[5, 6]])), (io.attention_mask, np.ones((1, 2))),
                          (io.position_ids, np.array([[0, 1]]))):
            d = DeviceArray.from_numpy(dec.cuda, arr.astype(dec._in_dtype[name]))
            dec._bind_input(ctx, name, d, 1, 2, 0)
            ctx.keep = [*getattr(ctx, "keep", []), d]
        for name, val in zip(dec.past_names, dec.new_cache().values):
            dec._bind_input(ctx, name, val, 1, 2, 0)
        logits = DeviceArray.from_numpy(dec.cuda, np.full((1, 2, dec.dims.vocab_size), 7, np.float32))
        ctx.set_tensor_address(io.logits, logits.ptr)
        dec.cuda.sync()  # the copies above are queued too
        present = [DeviceArray(dec.cuda, tuple(int(x) for x in ctx.get_tensor_shape(n)), dec._kv_dtype)
                   for n in dec.present_names]
        for n, d in zip(dec.present_names, present):
            ctx.set_tensor_address(n, d.ptr)
        assert ctx.execute_async_v3(dec.cuda.stream_handle)
        view = fake_gpu.view(logits.ptr, logits.nbytes)
        assert (view.view(np.float32) == 7).all()  # queued, not run
        dec.cuda.sync()
        assert not (view.view(np.float32) == 7).all()


# ----------------------------------------------------------------------------- the bundle changes last


def test_an_engine_that_fails_its_golden_recheck_leaves_the_bundle_unchanged(fake_gpu, bundle_copy, monkeypatch):
    """The engine is asked the golden prompts before it is renamed into place and the manifest names it: one
    that does not load (here: no context, as with too little GPU memory) leaves no trace in the bundle."""
    import fake_tensorrt

    before = (bundle_copy / "manifest.json").read_bytes()
    monkeypatch.setattr(fake_tensorrt.ICudaEngine, "create_execution_context", lambda self, *a: None)
    with pytest.raises(BundleError, match="did not pass its golden re-check .*the bundle is unchanged"):
        _build(bundle_copy, recheck=True)
    assert (bundle_copy / "manifest.json").read_bytes() == before
    assert not list((bundle_copy / "engines").glob("trt-*/*"))
    Bundle.open(bundle_copy, verify="full")


# ----------------------------------------------------------------------------- ONNX Runtime's TensorRT EP


def _parse_profiles(text: str) -> dict[str, list[tuple[int, ...]]]:
    out: dict[str, list[tuple[int, ...]]] = {}
    for item in text.split(","):
        name, dims = item.rsplit(":", 1)
        out.setdefault(name, []).append(tuple(int(d) for d in dims.split("x")))
    return out


def test_the_tensorrt_ep_gets_the_engines_profiles(tiny_bundle, monkeypatch):
    """Chosen from the fallback chain, ONNX Runtime's TensorRT EP is given the prefill and decode profiles of the
    I/O contract (each input once per profile), an engine cache and a timing cache: without them it rebuilds its
    engine every time the growing past leaves the shapes it has seen."""
    from edge.backends import choose
    from edge.device.machine import Machine
    from edge.backends.tensorrt.settings import shape_profiles
    from edge.io_contract import DecoderIO

    here = Machine(arch="x86_64", python="3.11.7", tensorrt="10.13.0", tensorrt_source="python", gpu_name="NVIDIA L4",
                   gpu_sm="8.9", onnxruntime="1.31.1", profile="l4", cuda_bindings="cuda-python",
                   ort_providers=["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(choose, "detect", lambda: here)
    dec, choice = choose.load_decoder(tiny_bundle)  # this onnxruntime has no TensorRT EP: it runs on CPU, saying so
    assert choice.backend == "onnxruntime-tensorrt"
    name, opts = dec.asked_providers[0]
    assert name == "TensorrtExecutionProvider" and dec.asked_providers[1:] == ["CUDAExecutionProvider",
                                                                              "CPUExecutionProvider"]
    m = tiny_bundle.manifest
    io = DecoderIO.from_dict(m.engine_io(m.engine(choice.engine)))
    from edge.device.profiles import load_profile

    l4 = load_profile("l4")
    profiles = shape_profiles(m.model, io, l4.max_batch, min(l4.max_context, m.model.max_context))
    for k, key in enumerate(("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")):
        parsed = _parse_profiles(opts[key])
        assert parsed == {n: [p.shapes[n][k] for p in profiles] for n in profiles[0].shapes}
    assert opts["trt_engine_cache_enable"] == "True" and opts["trt_engine_cache_path"]
    # every decode step of a long answer is inside the decode profile: no rebuild as the past grows
    _, decode = profiles
    lo, _, hi = decode.shapes[io.attention_mask]
    assert all(lo[1] <= past + 1 <= hi[1] for past in range(1, m.model.max_context))


# ----------------------------------------------------------------------------- the formats each TensorRT takes


@pytest.fixture(scope="module")
def fp16_bundle(tmp_path_factory, tiny_model_dir):
    """A tiny bundle with the fp32, fp16 (fp32 islands) and int8-qdq graphs TensorRT builds from."""
    from export.recipe import BuildOptions, build

    out = tmp_path_factory.mktemp("bundles") / "trt.bundle"
    return build(BuildOptions(output=out, model=str(tiny_model_dir), precisions=("fp32", "fp16", "int8-qdq"),
                              max_context=256, eval_samples=2, calibration_samples=8), log=lambda s: None).root


def _golden_same_as_fp32(bundle_path, engine: str) -> tuple[int, int]:
    from edge.decode.generate import Generator
    from edge.decode.golden import recheck

    b = Bundle.open(bundle_path)
    res = recheck(Generator.from_bundle(b, engine=engine), b.manifest, reference="fp32")
    same, asked = res["same_as_reference"].split("/")
    return int(same), int(asked)


def test_tensorrt11_builds_fp16_from_the_fp16_graph_with_fp32s_golden_answers(fake_gpu, fp16_bundle, tmp_path,
                                                                              monkeypatch, capsys):
    """TensorRT 11 has no FP16 flag: `--precision fp16` builds the bundle's fp16 graph as a strongly typed
    network (the stand-in then runs it in the graph's own types), and it answers the golden prompts as fp32 does."""
    import fake_tensorrt

    from edge.cli import main

    monkeypatch.setattr(fake_tensorrt, "__version__", "11.4.0")
    path = tmp_path / "b.bundle"
    shutil.copytree(fp16_bundle, path)
    assert main(["build-engine", str(path), "--profile", PROFILE, "--precision", "fp16"]) == 0, capsys.readouterr().err
    e = Bundle.open(path, verify="full").manifest.engine("trt-fp16-sm87")
    assert e.quality["built_from"] == "fp16" and e.fingerprint.tensorrt_version == "11.4.0"
    header = _header(Bundle.open(path).path(e.file))
    assert header["strongly_typed"] and header["flags"] == []
    assert e.quality["golden_same_as_source"].split("/")[0] == e.quality["golden_same_as_source"].split("/")[1]
    same, asked = _golden_same_as_fp32(path, "trt-fp16-sm87")
    assert same == asked and asked >= 3


def test_tensorrt103_parses_the_int8_qdq_graph_and_refuses_the_old_embedding(fake_gpu, fp16_bundle, tmp_path,
                                                                            tiny_plain_graph, capsys):
    """TensorRT 10.3's parser (onnx-tensorrt's op x type table) takes the int8-qdq graph, whose embedding is
    DequantizeLinear -> Gather, and its engine gives the graph's golden answers; the old form (Gather on the
    INT8 table, then Cast) is refused by the same parser, naming the node."""
    import tensorrt as trt

    from conftest import embedding_forms
    from edge.cli import main

    path = tmp_path / "b.bundle"
    shutil.copytree(fp16_bundle, path)
    assert main(["build-engine", str(path), "--profile", PROFILE, "--precision", "int8-qdq"]) == 0, \
        capsys.readouterr().err
    e = Bundle.open(path, verify="full").manifest.engine("trt-int8-qdq-sm87")
    same, asked = e.quality["golden_same_as_source"].split("/")
    assert same == asked and int(asked) >= 3
    forms = embedding_forms(tiny_plain_graph, tmp_path)
    for form, ok in (("dq-gather", True), ("gather-int8", False)):
        logger = trt.Logger()
        parser = trt.OnnxParser(trt.Builder(logger).create_network(0), logger)
        assert parser.parse_from_file(str(forms[form])) is ok, form
        if not ok:
            assert "Gather" in str(parser.get_error(0)) or "Cast" in str(parser.get_error(0))


# ----------------------------------------------------------------------------- falling back


def test_an_engine_that_fails_to_load_in_any_way_falls_back(fake_gpu, bundle_copy, monkeypatch):
    """TensorRT's create_execution_context answers None when it cannot (device memory), and its calls raise
    RuntimeError/TypeError: not EdgeChatErrors. The chain must still go on to ONNX Runtime, and not say the
    bundle has no TensorRT engine when it has one that did not load."""
    import fake_tensorrt

    from edge.bundle import Bundle
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    from edge.decode.generate import Generator
    from edge.errors import EdgeChatError

    entry = _build(bundle_copy)
    path = bundle_copy
    monkeypatch.setattr(fake_tensorrt.ICudaEngine, "create_execution_context", lambda self, *a: None)
    gen = Generator.from_bundle(Bundle.open(path))
    assert gen.choice.backend == "onnxruntime-cpu" and not isinstance(gen.decoder, TensorRTDecoder)
    assert gen.choice.skipped[0].startswith(f"TensorRT '{entry.name}': it did not load here")
    assert not any("has no TensorRT engine" in line for line in gen.choice.skipped), gen.choice.skipped
    with pytest.raises(EdgeChatError, match="execution context"):  # asked for by name: the error, one line
        Generator.from_bundle(Bundle.open(path), engine=entry.name)


