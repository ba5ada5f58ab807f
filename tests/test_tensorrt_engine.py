"""The TensorRT build and decode code run end to end against a strict TensorRT stand-in on CPU
(tests/fake_tensorrt: TensorRT's Python API over ONNX Runtime, and cuda-python over host memory).

What this shows: `edge-chat build-engine` writes an engine, its fingerprint and the manifest and re-asks
the golden prompts; `edge-chat run` decodes with TensorRTDecoder; greedy tokens equal ONNX Runtime CPU's
on the same graph (fp32 and int8-qdq) over several prefill chunks and past the profiles' opt shapes; and
each rule TensorRT enforces (profile ranges, unset addresses, dtypes, SM, version, memory) is refused by the
stand-in and turned by EdgeChat into the documented error or fallback. What it cannot show: TensorRT's
own numerics (an FP16 build computes in fp32 here) and speed; scripts/gpu_check.sh does that on a GPU.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from edge.bundle import Bundle
from edge.errors import BundleError

from conftest import TRT_PROFILE as PROFILE, build_trt as _build, trt_errors as _errors  # noqa: E402


def test_stand_in_is_what_the_probe_sees(fake_gpu):
    from edge.backends.choose import engine_mismatch
    from edge.bundle import Fingerprint
    from edge.device.machine import detect

    m = detect()
    assert (m.gpu_sm, m.gpu_name, m.tensorrt, m.tensorrt_source) == ("8.7", "Orin (fake)", "10.3.0", "python")
    assert engine_mismatch(Fingerprint(format="tensorrt", precision="fp16", gpu_sm="8.7", tensorrt_version="10.3.0"), m) is None


# ----------------------------------------------------------------------------- build + run through the CLI


@pytest.mark.parametrize("precision, source", [("fp32", "fp32"), ("int8-qdq", "int8-qdq"), ("fp16", "fp32")])
def test_build_engine_cli_writes_engine_fingerprint_manifest_and_golden(fake_gpu, bundle_copy, capsys, precision,
                                                                         source):
    from edge.cli import main

    assert main(["build-engine", str(bundle_copy), "--profile", PROFILE, "--precision", precision]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    name = f"trt-{precision}-sm87"
    assert f"built    engines/{name}/model.engine" in out
    b = Bundle.open(bundle_copy, verify="full")  # the new file is in the manifest with its SHA-256
    e = b.manifest.engine(name)
    fp = e.fingerprint
    assert (fp.format, fp.precision, fp.tensorrt_version, fp.gpu_sm, fp.gpu_name) == \
        ("tensorrt", precision, "10.3.0", "8.7", "Orin (fake)")
    assert set(fp.shapes) == {"prefill", "decode"}
    assert e.quality["built_from"] == source and e.quality["device_profile"] == PROFILE
    same, asked = e.quality["golden_same_as_source"].split("/")
    assert same == asked and int(asked) >= 3  # the stand-in computes in fp32: the source graph's answers
    assert b.path(e.file).read_bytes().startswith(b"FAKETRT1")
    flags = "FP16" if precision == "fp16" else None
    import fake_tensorrt
    import json as _json

    blob = b.path(e.file).read_bytes()
    header = _json.loads(blob[16:16 + int.from_bytes(blob[8:16], "little")])
    assert header["flags"] == ([flags] if flags else [])
    # prefill opt: a full chunk; every point's mask is past + tokens long (TensorRT checks each point)
    assert header["profiles"][0]["input_ids"] == [[1, 1], [1, 256], [1, 256]]
    for prof in header["profiles"]:
        past = next(v for k, v in prof.items() if k.startswith("past_key_values"))
        assert [m[1] for m in prof["attention_mask"]] == [p[2] + t[1] for p, t in zip(past, prof["input_ids"])]
    assert not _errors(), fake_tensorrt.LOG


def test_run_decodes_with_the_tensorrt_engine(fake_gpu, bundle_copy, capsys, tiny_generator):
    from edge.cli import main
    from edge.decode.generate import Generator
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    _build(bundle_copy, "fp32")
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert isinstance(gen.decoder, TensorRTDecoder) and gen.choice.backend == "tensorrt"
    assert main(["run", str(bundle_copy), "What is the capital of Japan?", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    trt_text = capsys.readouterr().out
    ids = tiny_generator.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of Japan?"}])
    cpu_text, _ = tiny_generator.complete(ids, tiny_generator.sampling(max_new_tokens=12, temperature=0))
    assert trt_text.strip() == cpu_text.strip()
    assert main(["info", str(bundle_copy)]) == 0
    assert "here     would run 'trt-fp32-sm87' with TensorRT engine" in capsys.readouterr().out
    assert main(["golden", str(bundle_copy), "--json"]) == 0
    import json as _json

    res = _json.loads(capsys.readouterr().out)
    assert res["engine"] == "trt-fp32-sm87" and res["same_as_reference"].split("/")[0] == \
        res["same_as_reference"].split("/")[1]


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("precision", ["fp32", "int8-qdq"])
def test_greedy_tokens_equal_onnxruntime_over_chunks_and_past_opt(fake_gpu, bundle_copy, monkeypatch, precision):
    """Prefill in 24-token chunks (the engine's prefill profile, read back by the decoder) and decode past
    both profiles' opt shapes: the same greedy tokens as ONNX Runtime on CPU running the same graph."""
    import fake_tensorrt
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy, precision, prefill_chunk=24)
    bundle = Bundle.open(bundle_copy)
    ort = Generator.from_bundle(bundle, engine=precision, providers=["CPUExecutionProvider"], threads=1)
    dec = TensorRTDecoder.from_entry(bundle, entry)
    assert dec.prefill_chunk == 24
    trt = Generator(ort.tokenizer, dec, bundle.manifest.generation, bundle)
    calls = []
    real = fake_tensorrt.IExecutionContext.execute_async_v3

    def spy(ctx, stream):
        calls.append((ctx.profile, ctx.shapes[dec.io.input_ids], ctx.shapes[dec.past_names[0]][2]))
        return real(ctx, stream)

    monkeypatch.setattr(fake_tensorrt.IExecutionContext, "execute_async_v3", spy)
    ids = ort.tokenizer.encode_chat([{"role": "user", "content": "Tell me a fun fact about the ocean, the stars "
                                                                 "and octopuses, and what you like to read."}])
    assert len(ids) > 2 * 24
    cfg = SamplingConfig(max_new_tokens=80, ignore_eos=True)
    want = ort.complete(ids, cfg)[1].token_ids
    got = trt.complete(ids, cfg)[1].token_ids
    assert got == want
    prefill = [c for c in calls if c[0] == 0]
    decode = [c for c in calls if c[0] == 1]
    assert len(prefill) == -(-len(ids) // 24) and all(c[1][1] <= 24 for c in prefill)
    opt_past = entry.fingerprint.shapes["decode"][dec.past_names[0]][1][2]
    # one decode step per generated token after the first (which comes from the prefill): no step is wasted
    # on logits nobody samples
    assert len(decode) == len(got) - 1 and max(c[2] for c in decode) > opt_past
    assert not _errors()


# ----------------------------------------------------------------------------- strictness: stand-in + EdgeChat


def _decoder(bundle_copy, precision="fp32"):
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy, precision)
    return TensorRTDecoder.from_entry(Bundle.open(bundle_copy), entry)


def test_shape_outside_the_profile(fake_gpu, bundle_copy):
    dec = _decoder(bundle_copy)
    ctx = dec.contexts[0]
    assert ctx.set_input_shape(dec.io.input_ids, (1, 257)) is False  # the stand-in: False + a logged error
    assert "does not satisfy any optimization profiles" in _errors()[-1]
    ids = np.zeros((1, 257), np.int64)
    with pytest.raises(BundleError, match=r"'input_ids' shape \(1, 257\) .* outside the engine's shape profile "
                                          r"\(1, 1\)\.\.\(1, 256\); rebuild the engine with a larger --max-context"):
        dec.run(ids, np.ones((1, 257), np.int64), np.arange(257)[None], dec.new_cache().values)
    cache = dec.new_cache(batch=5)  # the decode profile takes up to 4 sequences on an Orin Nano
    dec.prefill([5, 6, 7], c1 := dec.new_cache())
    past = [dec.to_device(np.repeat(v.numpy(), 5, axis=0)) for v in c1.values]
    with pytest.raises(BundleError, match=r"batch 5 x 1 tokens after 3\) is outside"):
        dec.run(np.zeros((5, 1), np.int64), np.ones((5, 4), np.int64), np.full((5, 1), 3), past)
    del cache


def test_unset_tensor_address(fake_gpu, bundle_copy, monkeypatch):
    dec = _decoder(bundle_copy)
    ctx = dec.contexts[0]
    stream = dec.cuda.stream_handle
    for name in dec.io.input_names(dec.dims.num_layers)[:3]:
        ctx.set_input_shape(name, (1, 4))
    for name in dec.past_names:
        ctx.set_input_shape(name, (1, dec.dims.num_kv_heads, 0, dec.dims.head_dim))
    assert ctx.execute_async_v3(stream) is False
    assert "Address is not set for input tensor input_ids" in _errors()[-1]
    real = type(ctx).set_tensor_address  # EdgeChat's run with one output left unbound: its error, not garbage
    monkeypatch.setattr(type(ctx), "set_tensor_address",
                        lambda self, name, ptr: True if name == dec.io.logits else real(self, name, ptr))
    with pytest.raises(BundleError, match="TensorRT failed to run .* batch 1 x 3 tokens after 0"):
        dec.prefill([5, 6, 7], dec.new_cache())
    assert "Address is not set for output tensor logits" in _errors()[-1]


def test_dtype_mismatch(fake_gpu, bundle_copy):
    from edge.backends.tensorrt.cuda_mem import CudaError, DeviceArray

    dec = _decoder(bundle_copy)
    cache = dec.new_cache()
    dec.prefill([5, 6, 7], cache)
    half = [DeviceArray.from_numpy(dec.cuda, v.numpy().astype(np.float16)) for v in cache.values]
    with pytest.raises(BundleError, match="past 'past_key_values.0.key' is float16 but the engine takes float32"):
        dec.run(np.array([[8]]), np.ones((1, 4), np.int64), np.array([[3]]), half)
    # the stand-in itself, given the fp16 buffers anyway: the kernel reads past them and the stream faults
    ctx = dec.contexts[1]
    for name, val in zip(dec.past_names, half):
        ctx.set_input_shape(name, val.shape)
        ctx.set_tensor_address(name, val.ptr)
    keep = []
    for name, arr in ((dec.io.input_ids, [[8]]), (dec.io.attention_mask, [[1] * 4]), (dec.io.position_ids, [[3]])):
        keep.append(d := DeviceArray.from_numpy(dec.cuda, np.array(arr, np.int64)))
        ctx.set_input_shape(name, d.shape)
        ctx.set_tensor_address(name, d.ptr)
    for name in [dec.io.logits, *dec.present_names]:
        keep.append(d := DeviceArray(dec.cuda, tuple(ctx.get_tensor_shape(name)), np.float32))
        ctx.set_tensor_address(name, d.ptr)
    assert ctx.execute_async_v3(dec.cuda.stream_handle) is True  # enqueued; the fault shows at the next sync
    with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
        dec.cuda.sync()


def _lie_in_fingerprint(path, name, **changes):
    b = Bundle.open(path)
    m = b.manifest
    engines = [dataclasses.replace(e, fingerprint=dataclasses.replace(e.fingerprint, **changes)) if e.name == name
               else e for e in m.engines]
    b.update_manifest(dataclasses.replace(m, engines=engines))


@pytest.mark.parametrize("change", ["sm", "version"])
def test_engine_for_another_gpu_or_tensorrt_falls_back(fake_gpu, bundle_copy, monkeypatch, change):
    import fake_tensorrt
    from edge.decode.generate import Generator
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy, "fp32")
    if change == "sm":
        fake_gpu.sm, fake_gpu.name, words = "7.5", "Tesla T4 (fake)", "expecting compute 75 got compute 87"
        fp = {"gpu_sm": "7.5"}  # an engine copied from an Orin with a wrong fingerprint
    else:
        monkeypatch.setattr(fake_tensorrt, "__version__", "10.3.1")
        words, fp = "Version tag does not match", {"tensorrt_version": "10.3.1"}
    # the fingerprint check alone skips it (the chain's first step)
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert gen.choice.backend == "onnxruntime-cpu" and "TensorRT 'trt-fp32-sm87'" in gen.choice.skipped[0]
    # an engine whose fingerprint says it fits: TensorRT refuses the plan; EdgeChat says so and falls back
    _lie_in_fingerprint(bundle_copy, entry.name, **fp)
    with pytest.raises(BundleError, match="built by another TensorRT version or for another GPU; rebuild it here"):
        TensorRTDecoder.from_entry(Bundle.open(bundle_copy), entry)
    assert words in _errors()[-1]
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert gen.choice.backend == "onnxruntime-cpu" and not isinstance(gen.decoder, TensorRTDecoder)
    assert gen.choice.skipped[0].startswith("TensorRT 'trt-fp32-sm87': it did not load here")
    with pytest.raises(BundleError, match="rebuild it here"):  # asked for by name: no silent fallback
        Generator.from_bundle(Bundle.open(bundle_copy), engine=entry.name)


def test_version_compatible_engine_runs_on_a_later_tensorrt(fake_gpu, bundle_copy, monkeypatch):
    import fake_tensorrt
    from edge.decode.generate import Generator
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy, "fp32", version_compatible=True)
    monkeypatch.setattr(fake_tensorrt, "__version__", "10.8.0")
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert isinstance(gen.decoder, TensorRTDecoder) and gen.decoder.engine.name == entry.name
    monkeypatch.setattr(fake_tensorrt, "__version__", "11.0.0")
    assert fake_tensorrt.Runtime(fake_tensorrt.Logger()).deserialize_cuda_engine(
        Bundle.open(bundle_copy).path(entry.file).read_bytes()) is None


def test_build_out_of_device_memory_leaves_the_bundle_as_it_was(fake_gpu, bundle_copy, capsys):
    from edge.cli import main

    before = Bundle.open(bundle_copy).manifest
    fake_gpu.memory_bytes = 64 << 20  # less than the workspace limit plus the weights
    assert main(["build-engine", str(bundle_copy), "--profile", PROFILE, "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT failed to build trt-fp32-sm87" in err and "lower --max-context or --max-batch" in err
    assert "OutOfMemory" in _errors()[-1]
    after = Bundle.open(bundle_copy, verify="full")
    assert after.manifest.engines == before.engines and not (bundle_copy / "engines/trt-fp32-sm87").exists()


def test_parser_and_builder_refusals(fake_gpu, bundle_copy):
    """What TensorRT refuses before a build: ONNX Runtime contrib ops, precision flags on a strongly typed
    network, a profile that does not match the network (the stand-in is checked, so it cannot pass what
    TensorRT would not)."""
    import fake_tensorrt as trt
    from edge.backends.tensorrt.builder import _network

    logger = trt.Logger()
    builder = trt.Builder(logger)
    with pytest.raises(BundleError, match="parser rejected model.onnx: .*No importer registered for op: "):
        _network(builder, logger, Bundle.open(bundle_copy).path("engines/int8-dynamic/model.onnx"), False)
    network, _ = _network(builder, logger, Bundle.open(bundle_copy).path("engines/int8-qdq/model.onnx"), True)
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    assert builder.build_serialized_network(network, config) is None
    assert "Precision flags are not allowed with a strongly typed network" in _errors()[-1]
    config = builder.create_builder_config()
    assert builder.build_serialized_network(network, config) is None
    assert "no optimization profile has been defined" in _errors()[-1]
    p = builder.create_optimization_profile()
    for t in network.inputs:
        p.set_shape(t.name, [1, 3, 0, 16] if "past" in t.name else [1, 1], [1, 3, 0, 16] if "past" in t.name else
                    [1, 1], [1, 3, 0, 16] if "past" in t.name else [1, 1])
    config.add_optimization_profile(p)
    assert builder.build_serialized_network(network, config) is None  # 3 KV heads; the graph has 2
    assert "does not match the network's dimensions" in _errors()[-1]
    bad = builder.create_optimization_profile()
    bad.set_shape("input_ids", [1, 8], [1, 4], [1, 16])
    assert config.add_optimization_profile(bad) == -1


def test_device_buffers_and_cuda_errors(fake_gpu):
    from edge.backends.tensorrt.cuda_mem import CudaError, DeviceArray, open_cuda

    cuda = open_cuda()
    a = DeviceArray.from_numpy(cuda, np.arange(6, dtype=np.float32).reshape(2, 3))
    b = DeviceArray(cuda, (2, 3), np.float32)
    cuda.dtod(b.ptr, a.ptr, a.nbytes)
    np.testing.assert_array_equal(b.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert DeviceArray(cuda, (0, 4), np.float32).numpy().shape == (0, 4)
    with pytest.raises(CudaError, match="copy to GPU failed: cudaErrorInvalidValue"):
        cuda.htod(b.ptr, np.zeros(100, np.float32))  # past the allocation
    fake_gpu.memory_bytes = fake_gpu.used + 10
    with pytest.raises(CudaError, match="cudaMalloc failed: cudaErrorMemoryAllocation"):
        DeviceArray(cuda, (1024,), np.float32)


def test_pycuda_backend_where_only_pycuda_is_installed(fake_gpu, bundle_copy, monkeypatch):
    """Older Jetson images have pycuda and no cuda-python: the same decode through edge.backends.tensorrt.cuda_mem.PyCuda."""
    import importlib.util

    from fake_tensorrt import cuda as fcuda

    for name, mod in (("pycuda", fcuda.pycuda), ("pycuda.driver", fcuda.pycuda_driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "pycuda.autoinit", raising=False)
    monkeypatch.setattr(sys, "meta_path", [fcuda.PycudaAutoinit(), *sys.meta_path])  # what importing it does
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cuda" else
                        (object() if name == "pycuda" else real_find(name, *a)))
    dec = _decoder(bundle_copy)
    assert type(dec.cuda).__name__ == "PyCuda"
    cache = dec.new_cache()
    logits = dec.prefill([5, 6, 7, 8], cache)
    assert logits.shape == (1, dec.dims.vocab_size) and cache.values[0].shape[2] == 4
    a = dec.to_device(np.ones((1, 2, 3, 16)))
    b = type(a)(dec.cuda, a.shape, a.dtype)
    dec.cuda.dtod(b.ptr, a.ptr, a.nbytes)
    dec.cuda.sync()  # the queued copy has run
    assert b.numpy().sum() == 96
    dec.cuda.free(b.ptr)
    dec.cuda.free(b.ptr)  # a second free of the same pointer is ignored (DeviceArray.__del__ frees once more)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("cuda", "pycuda") else
                        real_find(name, *a))
    from edge.backends.tensorrt.cuda_mem import open_cuda
    from edge.errors import MissingDependencyError

    with pytest.raises(MissingDependencyError, match="pip install cuda-python"):
        open_cuda()


def test_plan_summary_and_compat_report_in_process(fake_gpu, bundle_copy, capsys):
    """The dry run and the compatibility report as data (the CLI test above runs them in a subprocess)."""
    from edge.cli import main
    from export import trt_compat

    assert main(["build-engine", str(bundle_copy), "--profile", PROFILE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    import json as _json

    plan = _json.loads(out[out.index("{"):])
    assert plan["engine"] == "trt-fp16-sm87" and plan["settings"]["profiles"][0]["name"] == "prefill"
    rep = trt_compat.check(Bundle.open(bundle_copy).path("engines/int8-qdq/model.onnx")).to_dict()
    assert rep["compatible"] and rep["opset"] == 18


def test_tensorrt_missing_or_only_stubs_is_one_clear_error(monkeypatch, tmp_path):
    """No tensorrt: the install line. A `tensorrt` that is only a folder (tensorrt-stubs installed into the
    environment makes one: tensorrt/__init__.pyi, no __init__.py) imports as an empty namespace package."""
    import types

    from edge.errors import MissingDependencyError
    from edge.backends.tensorrt.runtime import import_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    with pytest.raises(MissingDependencyError, match="python3-libnvinfer"):
        import_tensorrt()
    empty = types.ModuleType("tensorrt")
    empty.__path__ = [str(tmp_path / "site-packages/tensorrt")]
    monkeypatch.setitem(sys.modules, "tensorrt", empty)
    with pytest.raises(MissingDependencyError, match="without TensorRT's Python bindings \\(type stubs alone\\?\\)"):
        import_tensorrt()


def test_batched_decode_rows_equal_rows_alone(fake_gpu, bundle_copy):
    """The scheduler's plain-graph BatchCache on the TensorRT decoder: rows of different lengths, right-aligned
    and masked, decoded together through the decode profile give each row's logits decoded alone."""
    from edge.decode.cache import BatchCache, batch_cache

    dec = _decoder(bundle_copy)
    assert isinstance(batch_cache(dec, 4), BatchCache)
    prompts, tokens = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20, 21]], [30, 31, 32]
    bc = BatchCache(dec)
    for p in prompts:
        bc.admit(p)
    steps = [bc.step(tokens) for _ in range(3)]
    bc.remove([1])
    after = bc.step([tokens[0], tokens[2]])
    for i, p in enumerate(prompts):
        alone = dec.new_cache()
        dec.prefill(p, alone)
        for k, step in enumerate(steps):
            np.testing.assert_allclose(step[i], dec.forward(np.array([[tokens[i]]]), alone)[0], atol=1e-4, rtol=0,
                                       err_msg=f"row {i}, step {k}")
        if i != 1:
            np.testing.assert_allclose(after[0 if i == 0 else 1], dec.forward(np.array([[tokens[i]]]), alone)[0],
                                       atol=1e-4, rtol=0)
    with pytest.raises(BundleError, match=r"batch 5 x 1 tokens .* outside the engine's shape profile"):
        for p in [[40, 41]] * 3:  # the Orin Nano profile's decode batch is at most 4
            bc.admit(p)
        bc.step([1] * len(bc))


def test_scheduler_keeps_to_the_engines_decode_batch(fake_gpu, bundle_copy, caplog):
    """`edge-chat serve --max-users 8` (the default) with an engine built for 4 sequences per step: the
    scheduler serves 4 at once and says why, rather than failing the 5th user's step."""
    from edge.decode.scheduler import Scheduler
    from edge.decode.generate import Generator

    _build(bundle_copy, "fp32")
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert gen.decoder.max_batch == 4 and gen.decoder.prefill_chunk == 256
    with caplog.at_level("WARNING", logger="edgechat"):
        s = Scheduler(gen, max_batch=8)
    assert s.max_batch == 4 and "rebuild it with --max-batch 8" in caplog.text
    assert Scheduler(gen, max_batch=2).max_batch == 2


def test_engine_built_for_a_shorter_context_ends_answers_there(fake_gpu, bundle_copy):
    """--max-context 64 on a 256-token model: the decoder reports the engine's context, so a long answer
    ends with finish "length" at 64 tokens and a longer prompt is refused up front, not failed mid-step."""
    from edge.errors import ContextOverflowError
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig

    _build(bundle_copy, "fp32", max_context=64)
    gen = Generator.from_bundle(Bundle.open(bundle_copy))
    assert gen.max_context == 64 and gen.decoder.dims.max_context == 64
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "Tell me a fun fact."}])
    text, last = gen.complete(ids, SamplingConfig(max_new_tokens=200, ignore_eos=True))
    assert last.finish_reason == "length" and len(ids) + len(last.token_ids) == 64
    with pytest.raises(ContextOverflowError, match="the context holds 64"):
        list(gen.tokens(list(range(3, 70)), SamplingConfig(max_new_tokens=4)))


def test_invalid_optimization_profile_is_an_error_not_ignored(fake_gpu, bundle_copy):
    from edge.device.machine import detect
    from edge.backends.tensorrt.builder import build_engine, plan_build
    from edge.backends.tensorrt.settings import ShapeProfile

    plan = plan_build(Bundle.open(bundle_copy), PROFILE, "fp32", tensorrt_version="10.3.0", available_gb=8.0)
    prefill, decode = plan.settings.profiles
    bad = ShapeProfile("prefill", prefill.shapes | {"input_ids": ((1, 8), (1, 4), (1, 16))})
    plan = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, profiles=(bad, decode)))
    with pytest.raises(BundleError, match="TensorRT refused the 'prefill' optimization profile"):
        build_engine(plan, detect())
    assert "min <= opt <= max violated for 'input_ids'" in _errors()[-1]


def test_prompt_whose_last_chunk_starts_past_context_minus_chunk(fake_gpu, bundle_copy, monkeypatch):
    """A prompt's chunks start at multiples of the chunk; when the context is not a multiple of it the last
    chunk starts after context - chunk (here 240 > 256 - 24), which the prefill profile must take."""
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    entry = _build(bundle_copy, "fp32", prefill_chunk=24)
    bundle = Bundle.open(bundle_copy)
    ort = Generator.from_bundle(bundle, engine="fp32", providers=["CPUExecutionProvider"], threads=1)
    trt = Generator(ort.tokenizer, TensorRTDecoder.from_entry(bundle, entry), bundle.manifest.generation, bundle)
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 390, 250)]
    cfg = SamplingConfig(max_new_tokens=4, ignore_eos=True)
    assert trt.complete(prompt, cfg)[1].token_ids == ort.complete(prompt, cfg)[1].token_ids
