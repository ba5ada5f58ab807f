"""The single-user path of the one loop (Generator.stream: CLI, REPL, evaluation, golden prompts): stopping early,
finish reasons, failures, two threads on one generator (ONNX Runtime and TensorRT), long prompts on a plain graph,
a fused graph whose K/V live on a GPU. Each test here failed before its fix (issue 24's review)."""

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



# ----------------------------------------------------------------------------- TensorRT: two callers


def test_two_threads_stream_on_one_tensorrt_generator_at_once(fake_gpu, bundle_copy):
    """The engine's execution contexts belong to the decoder: two callers (two Generator.stream in two threads,
    or the server's loop and a golden-prompt check) must not interleave their shapes and addresses."""
    from edge.bundle import Bundle
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    from conftest import build_trt

    build_trt(bundle_copy)
    path = bundle_copy
    gen = Generator.from_bundle(Bundle.open(path))
    assert isinstance(gen.decoder, TensorRTDecoder)
    prompts = [_ids(gen), _ids(gen, "What is the capital of Japan? " * 3)]
    cfg = _greedy(16, ignore_eos=True)
    want = [gen.tokens(p, cfg) for p in prompts]
    got, errors = _stream_in_two_threads(gen, prompts, cfg, want, join_s=300)
    assert not errors and got == want




def test_two_threads_on_one_fused_decoder_each_read_their_own_logits(fused_generator, monkeypatch):
    """The fused decoder keeps its IO binding and a logits buffer between calls (docs/speed.md): shared by every
    thread, a second thread's call wrote its logits into the buffer the first had not yet copied out (this
    file's two-thread test failed once in a full run: one answer took the other's token). Forced here: thread
    A's call returns only after thread B's whole call; A must still read its own logits. They are kept per
    thread now."""
    import threading

    import numpy as np

    from edge.decode.cache import batch_cache

    dec = fused_generator.decoder
    prompts = {"A": fused_generator.tokenizer.encode("Hello there"), "B": fused_generator.tokenizer.encode("Japan")}
    assert max(map(len, prompts.values())) <= dec.prefill_span(0)  # one call each: A's is the one it reads
    alone = {k: batch_cache(dec, 1).prefill_rows([p]) for k, p in prompts.items()}
    assert not np.array_equal(alone["A"], alone["B"])
    a_ran, b_done = threading.Event(), threading.Event()
    session = dec.session

    class Interleaved:
        def __getattr__(self, name):
            return getattr(session, name)

        def run_with_iobinding(self, binding, *a):
            session.run_with_iobinding(binding, *a)
            if threading.current_thread().name == "A":
                a_ran.set()
                b_done.wait(30)

    monkeypatch.setattr(dec, "session", Interleaved())
    got: dict = {}

    def run(name: str) -> None:
        if name == "B":
            a_ran.wait(30)
        try:
            got[name] = batch_cache(dec, 1).prefill_rows([prompts[name]])
        finally:
            if name == "B":
                b_done.set()

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert np.array_equal(got["A"], alone["A"]) and np.array_equal(got["B"], alone["B"])
