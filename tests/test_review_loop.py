"""A hostile review of issue 24's one loop (edge.decode.scheduler), its caches (edge.decode.cache), the loader (edge.backends.load) and
the design checks (tests/test_design.py): each test here failed before its fix."""

from __future__ import annotations

import dataclasses
import shutil
import threading

import numpy as np
import pytest

from edge.decode import scheduler as sched_mod
from edge.errors import EdgeChatError
from edge.decode.generate import Generator
from edge.decode.sampling import SamplingConfig
from edge.decode.scheduler import Scheduler

PROMPT = [{"role": "user", "content": "Hello! Tell me about the ocean and the stars, please."}]


def _ids(gen, text: str = PROMPT[0]["content"]) -> list[int]:
    return gen.tokenizer.encode_chat([{"role": "user", "content": text}])


def _greedy(n: int = 12, **kw) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, temperature=0.0, **kw)


def _served(gen, prompts: list[list[int]], cfg: SamplingConfig, max_batch: int = 4, **admission):
    """Answers through a started (threaded) scheduler, all submitted at once."""
    s = Scheduler(gen, max_batch=max_batch, max_queue=16)
    s.admission = dataclasses.replace(s.admission, **admission)
    s.start()
    try:
        reqs = [s.submit(p, cfg) for p in prompts]
        return [r.answer(timeout=120) for r in reqs], s
    finally:
        s.stop()


@pytest.fixture(params=["plain", "fused"])
def gen(request, tiny_generator, fused_generator):
    return tiny_generator if request.param == "plain" else fused_generator


# ----------------------------------------------------------------------------- the single-user path


def _stream_in_two_threads(gen, prompts: list[list[int]], cfg, want: list[list[int]], join_s: float):
    """Thread i asks `gen` for prompts[i]'s tokens three times (stopping at the first answer that is not
    want[i]); returns each thread's last answer and any exception raised."""
    got: list = [None, None]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = gen.tokens(prompts[i], cfg)
                if got[i] != want[i]:
                    return
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return got, errors


@pytest.mark.parametrize("how", ["close", "break", "cancel"])
def test_stopping_early_leaves_the_scheduler_and_generator_clean(gen, how):
    ids, cfg = _ids(gen), _greedy(16, ignore_eos=True)
    want = gen.tokens(ids, cfg)
    s = Scheduler(gen, max_batch=1, max_queue=1, prompt_cache_mb=0)
    cancel = threading.Event()
    last = None
    if how == "break":  # the for loop holds the only reference: leaving it closes the generator
        for i, ev in enumerate(s.generate(ids, cfg, cancel)):
            if i == 2:
                break
    else:
        it = s.generate(ids, cfg, cancel)
        for i, ev in enumerate(it):
            last = ev
            if i == 2:
                if how == "close":
                    it.close()
                    break
                cancel.set()
    if how == "cancel":
        assert last is not None and last.finish_reason == "cancelled"
    assert s.rows == [] and s.prefilling is None and len(s.cache) == 0 and not s.pending
    # the same scheduler and the same generator answer again, unchanged
    assert list(s.generate(ids, cfg))[-1].token_ids == want
    assert gen.tokens(ids, cfg) == want


def test_finish_reasons_match_the_served_path(gen, monkeypatch):
    ids = _ids(gen)
    ref_text, ref = gen.complete(ids, _greedy(24, ignore_eos=True))
    stop = ref_text[len(ref_text) // 3: len(ref_text) // 3 + 3]
    long = [ids[0]] * (gen.max_context - 3) + ids[-2:]
    cases = [(ids, _greedy(5)), (ids, _greedy(24, stop=(stop,))), (long[-(gen.max_context - 2):], _greedy(20))]
    for prompt, cfg in cases:
        alone = gen.complete(prompt, cfg)
        (served,), _ = _served(gen, [prompt], cfg)
        assert (alone[0], alone[1].finish_reason, alone[1].token_ids) == \
               (served[0], served[1].finish_reason, served[1].token_ids), cfg
    # EOS: a token the greedy answer reaches made an end-of-sequence id
    sampled = dict(max_new_tokens=24, temperature=1.0, seed=5)
    ref = gen.complete(ids, SamplingConfig(**sampled, ignore_eos=True))[1]
    k = next(i for i, t in enumerate(ref.token_ids) if i and t not in ref.token_ids[:i])
    monkeypatch.setattr(gen.tokenizer, "eos_ids", frozenset(gen.tokenizer.eos_ids | {ref.token_ids[k]}))
    alone = gen.complete(ids, SamplingConfig(**sampled))
    (served,), _ = _served(gen, [ids], SamplingConfig(**sampled))
    assert alone[1].finish_reason == served[1].finish_reason == "stop"
    assert alone[1].token_ids == served[1].token_ids == ref.token_ids[:k]


def test_a_failure_raises_and_the_generator_goes_on(gen, monkeypatch):
    ids, cfg = _ids(gen), _greedy(8, ignore_eos=True)
    want = gen.tokens(ids, cfg)
    calls = {"n": 0}
    real = type(gen.decoder).run_fused if gen.decoder.io.fused else type(gen.decoder).run

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return real(self, *a, **kw)

    monkeypatch.setattr(type(gen.decoder), "run_fused" if gen.decoder.io.fused else "run", flaky)
    with pytest.raises(EdgeChatError, match="device lost"):
        for _ in gen.stream(ids, cfg):
            pass
    assert gen.tokens(ids, cfg) == want


def test_two_threads_stream_on_one_generator_at_once(gen):
    prompts = [_ids(gen), _ids(gen, "What is the capital of Japan?")]
    cfg = _greedy(24, ignore_eos=True)
    want = [gen.tokens(p, cfg) for p in prompts]
    got, errors = _stream_in_two_threads(gen, prompts, cfg, want, join_s=120)
    assert not errors and got == want


# ----------------------------------------------------------------------------- long prompts on a plain graph


def test_plain_graph_long_prompts_served_equal_single_user(tiny_generator, monkeypatch):
    gen = tiny_generator
    monkeypatch.setattr(gen.decoder, "prefill_chunk", 16)  # several chunks per prompt, alone or served
    base = _ids(gen, "I like to read books about the ocean, the stars and octopuses. " * 3)
    prompts = [base, base[:40], _ids(gen), base[:-5] + _ids(gen, "Tell me a fun fact.")]
    assert max(map(len, prompts)) > 40
    for temperature in (0.0, 0.8):
        cfg = SamplingConfig(max_new_tokens=12, temperature=temperature, seed=7, ignore_eos=True)
        alone = [gen.tokens(p, cfg) for p in prompts]
        served, s = _served(gen, prompts, cfg, max_batch=3, long_prompt=30)
        assert [ev.token_ids for _, ev in served] == alone
        assert s.cache.side is None and len(s.cache) == 0


def test_a_cancelled_side_prefill_leaves_nothing_behind(gen, monkeypatch):
    ids = _ids(gen, "I like to read books about the ocean, the stars and octopuses. " * 3)
    cfg = _greedy(6, ignore_eos=True)
    want = gen.tokens(ids, cfg)
    monkeypatch.setattr(sched_mod, "ADMISSION", sched_mod.Admission(long_prompt=20, interleaved_span=8))
    s = Scheduler(gen, max_batch=2, max_queue=4, prompt_cache_mb=0)
    cancel = threading.Event()
    real = type(gen.decoder).forward
    monkeypatch.setattr(type(gen.decoder), "forward",
                        lambda self, *a, **kw: (cancel.set(), real(self, *a, **kw))[1])
    out = list(s.generate(ids, cfg, cancel))
    assert out[-1].finish_reason == "cancelled" and out[-1].token_ids == []
    assert s.prefilling is None and s.cache.side is None and len(s.cache) == 0
    monkeypatch.setattr(type(gen.decoder), "forward", real)
    assert list(s.generate(ids, cfg))[-1].token_ids == want


def test_fresh_after_a_failed_step_serves_again(gen, monkeypatch):
    ids, cfg = _ids(gen), _greedy(6, ignore_eos=True)
    want = gen.tokens(ids, cfg)
    s = Scheduler(gen, max_batch=2, max_queue=4, prompt_cache_mb=1)
    s.cache.admit(ids)
    s.cache.admit(ids[:-3])
    s._reset()  # what the supervisor does after a failure
    assert len(s.cache) == 0 and type(s.cache).__name__ in ("BatchCache", "SharedBatchCache")
    assert list(s.generate(ids, cfg))[-1].token_ids == want


# ----------------------------------------------------------------------------- a fused graph on a GPU


def test_fused_graph_whose_kv_live_on_a_gpu_answers_a_single_user(fused_generator, monkeypatch):
    """ONNX Runtime's CUDA EP runs the fused int8/int4 graphs (edge.backends.choose' CUDA order ranks them); their K/V
    are device buffers numpy cannot see. The single-user path ran there before issue 24 (Decoder.prefill and
    forward only): `edge-chat run --engine int4-weight` and scripts/gpu_check.py's int8-dynamic decode must
    still work. Stand-in: the fused CPU decoder with its buffers hidden from numpy, as on a GPU."""
    import onnxruntime as ort

    from edge.backends.onnxruntime import OrtDecoder

    class DeviceKV(OrtDecoder):
        def _place(self, cache, arrays):
            cache.capacity = arrays[0].shape[2]
            cache.arrays = None
            cache.values = [ort.OrtValue.ortvalue_from_numpy(np.array(a)) for a in arrays]

        def to_device(self, array):
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=self._kv_dtype))

    ref = fused_generator
    dec = DeviceKV.from_entry(ref.bundle, ref.decoder.engine, threads=1)
    dec.device = "cuda"
    gpu = Generator(ref.tokenizer, dec, ref.defaults, ref.bundle)
    ids = _ids(ref)
    for cfg in (_greedy(40, ignore_eos=True), _greedy(300, ignore_eos=True)):  # the second grows the buffers
        assert gpu.tokens(ids, cfg) == ref.tokens(ids, cfg)
    with monkeypatch.context() as mp:  # a long prompt, prefilled a span at a time in the side row
        mp.setattr(sched_mod, "ADMISSION", sched_mod.Admission(long_prompt=20))
        assert gpu.tokens(ids, _greedy(20)) == ref.tokens(ids, _greedy(20))
    # and a served (batched) fused graph there is still refused with the documented message
    with pytest.raises(EdgeChatError, match="serve a plain engine there"):
        Scheduler(gpu, max_batch=2)


# ----------------------------------------------------------------------------- TensorRT: loading and sharing


@pytest.fixture
def trt_bundle(fake_gpu, tiny_bundle, tmp_path):
    from edge.bundle import Bundle
    from edge.device.machine import detect
    from edge.backends.tensorrt.builder import build_engine, plan_build

    dst = tmp_path / "b.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    here = detect()
    entry = build_engine(plan_build(Bundle.open(dst), "orin-nano-8gb", "fp32", tensorrt_version=here.tensorrt,
                                    available_gb=8.0), here)
    return dst, entry


def test_an_engine_that_fails_to_load_in_any_way_falls_back(trt_bundle, monkeypatch):
    """TensorRT's create_execution_context answers None when it cannot (device memory), and its calls raise
    RuntimeError/TypeError: not EdgeChatErrors. The chain must still go on to ONNX Runtime, and not say the
    bundle has no TensorRT engine when it has one that did not load."""
    import fake_tensorrt

    from edge.bundle import Bundle
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    path, entry = trt_bundle
    monkeypatch.setattr(fake_tensorrt.ICudaEngine, "create_execution_context", lambda self, *a: None)
    gen = Generator.from_bundle(Bundle.open(path))
    assert gen.choice.backend == "onnxruntime-cpu" and not isinstance(gen.decoder, TensorRTDecoder)
    assert gen.choice.skipped[0].startswith(f"TensorRT '{entry.name}': it did not load here")
    assert not any("has no TensorRT engine" in line for line in gen.choice.skipped), gen.choice.skipped
    with pytest.raises(EdgeChatError, match="execution context"):  # asked for by name: the error, one line
        Generator.from_bundle(Bundle.open(path), engine=entry.name)


def test_two_threads_stream_on_one_tensorrt_generator_at_once(trt_bundle):
    """The engine's execution contexts belong to the decoder: two callers (two Generator.stream in two threads,
    or the server's loop and a golden-prompt check) must not interleave their shapes and addresses."""
    from edge.bundle import Bundle
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    path, _ = trt_bundle
    gen = Generator.from_bundle(Bundle.open(path))
    assert isinstance(gen.decoder, TensorRTDecoder)
    prompts = [_ids(gen), _ids(gen, "What is the capital of Japan? " * 3)]
    cfg = _greedy(16, ignore_eos=True)
    want = [gen.tokens(p, cfg) for p in prompts]
    got, errors = _stream_in_two_threads(gen, prompts, cfg, want, join_s=300)
    assert not errors and got == want


# ----------------------------------------------------------------------------- engine pickers and the manifest


PROVIDER_SETS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "ort-trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


@pytest.mark.parametrize("eps", PROVIDER_SETS)
@pytest.mark.parametrize("keep", [None, ("int8-qdq", "int4-weight"), ("int8-dynamic", "fp32")])  # noqa: precision
def test_forced_providers_pick_the_engine_the_chain_would(tiny_bundle, eps, keep):
    """`--providers` (load_decoder's forced ONNX Runtime providers) and the fallback chain read one table: the
    same providers get the same engine (the TensorRT EP runs standard-op graphs only: not a fused one)."""
    from edge.backends.choose import decide
    from edge.bundle import Bundle
    from edge.backends.load import load_decoder
    from edge.device.machine import Machine

    real = Bundle.open(tiny_bundle.root)
    m = real.manifest
    if keep:
        m = dataclasses.replace(m, engines=[e for e in m.engines if e.fingerprint.precision in keep])
    bundle = type("B", (), {"manifest": m, "path": staticmethod(real.path)})()
    here = Machine(arch="x86_64", python="3.11", onnxruntime="1.32.0", ort_providers=PROVIDER_SETS[eps],
                   gpu_sm="8.9" if eps != "cpu" else None, gpu_name="L4" if eps != "cpu" else None,
                   tensorrt="10.8.0" if eps == "ort-trt" else None)
    dec, _ = load_decoder(bundle, threads=1, providers=PROVIDER_SETS[eps])  # this CPU build runs it on CPU
    assert dec.engine.name == decide(m, here).engine


def test_an_io_key_this_runtime_does_not_know_is_refused(tiny_bundle, tmp_path):
    """A manifest's `io` is the graph's contract: a key the runtime does not know (a newer exporter's input, a
    typo) must not be dropped silently; the schema version is what lets a newer bundle through."""
    import json

    from edge.bundle import READS_SCHEMA_VERSIONS, Bundle
    from edge.errors import ManifestError
    from edge.io_contract import DecoderIO

    with pytest.raises(ManifestError, match="kv_scale"):
        DecoderIO.from_dict({**DecoderIO().to_dict(), "kv_scale": "k_scale.{i}"})
    # this change added `prefill_chunk` to every bundle's io: a reader from before it (DecoderIO(**io), reads
    # schema 1-4) must refuse such a bundle by its version, as the schema's own rule says (edge/bundle.py)
    m = json.loads((tiny_bundle.root / "manifest.json").read_text())
    assert "prefill_chunk" in m["io"]
    assert m["schema_version"] not in (1, 2, 3, 4) and m["schema_version"] in READS_SCHEMA_VERSIONS
    dst = tmp_path / "b.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    m["schema_version"] = 4  # an older bundle: no prefill_chunk in its io
    m["io"].pop("prefill_chunk")
    for e in m["engines"]:
        e.get("io", {}).pop("prefill_chunk", None)
    (dst / "manifest.json").write_text(json.dumps(m))
    gen = Generator.from_bundle(Bundle.open(dst), engine="fp32", threads=1)
    assert gen.decoder.prefill_chunk == 512


# ----------------------------------------------------------------------------- the design checks can fail


def _plant(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("files", [
    {"edge/__init__.py": "", "edge/a.py": "def f():\n    from . import b\n", "edge/b.py": "from edge import a\n"},
    {"edge/__init__.py": "", "edge/t/__init__.py": "", "edge/t/a.py": "def f():\n    from .b import g\n",
     "edge/t/b.py": "import edge.t.a\n"},
    {"edge/__init__.py": "", "edge/a.py": "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n    import edge.b\n",
     "edge/b.py": "def f():\n    import edge.a\n"},
], ids=["relative-lazy", "relative-from-module", "not-TYPE_CHECKING"])
def test_the_circle_check_finds_a_planted_circle(tmp_path, monkeypatch, files):
    import test_design

    _plant(tmp_path, {"export/__init__.py": "", **files})
    monkeypatch.setattr(test_design, "ROOT", tmp_path)
    assert test_design._cycle(test_design._graph(False)) is not None


def test_the_edge_side_check_sees_a_relative_import_of_export(tmp_path, monkeypatch):
    import test_design

    _plant(tmp_path, {"edge/__init__.py": "", "edge/a.py": "def f():\n    from .. import export\n"})
    monkeypatch.setattr(test_design, "ROOT", tmp_path)
    assert "export" in test_design._runtime_imports(tmp_path / "edge" / "a.py")


def test_the_module_level_circle_check_sees_imports_in_try_blocks(tmp_path, monkeypatch):
    import test_design

    _plant(tmp_path, {"export/__init__.py": "", "edge/__init__.py": "",
                      "edge/a.py": "try:\n    import edge.b\nexcept ImportError:\n    pass\n",
                      "edge/b.py": "import edge.a\n"})
    monkeypatch.setattr(test_design, "ROOT", tmp_path)
    assert test_design._cycle(test_design._graph(True)) is not None


def test_a_failing_step_in_the_cli_is_one_line_not_a_traceback(tiny_bundle, monkeypatch, caplog, capsys):
    """edge/errors.py: the CLIs turn an EdgeChatError into one line on stderr. Before issue 24 a decode error in
    `edge-chat run` was raised as it was; the one loop must not also log its traceback (at ERROR, which the CLI
    prints) when the caller gets the error raised."""
    import logging

    from edge.cli import main
    from edge.errors import BundleError
    from edge.backends.onnxruntime import OrtDecoder

    calls = {"n": 0}
    real = OrtDecoder.run

    def failing(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise BundleError("'input_ids' is outside the engine's shape profile; rebuild the engine")
        return real(self, *a, **kw)

    monkeypatch.setattr(OrtDecoder, "run", failing)
    caplog.set_level(logging.WARNING, logger="edgechat")
    rc = main(["run", str(tiny_bundle.root), "Hello!", "--engine", "fp32", "--threads", "1", "--max-new-tokens", "8",
               "--temperature", "0"])
    assert rc == 2 and "rebuild the engine" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING], \
        [r.getMessage() for r in caplog.records]
