"""Continuous batching on the tiny model: batched answers equal single-user answers, slots free at once."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from edge.decode.cache import BatchCache, SharedBatchCache
from edge.decode.scheduler import QueueFullError, Scheduler
from edge.errors import ContextOverflowError, EdgeChatError
from edge.serve.metrics import Metrics
from edge.backends.decoder import boundary_at_or_below

from conftest import assert_batched_steps_equal_alone

PROMPTS = ["Hello!", "What is the capital of Japan?", "Tell me a fun fact about octopuses and the ocean.",
           "Naïve café 🙂", "I like to read books.", "How are you doing today? I am fine."]


@pytest.fixture(params=["plain", "fused"])
def any_generator(request, tiny_generator, fused_generator):
    """Both batch caches: the plain graph's right-aligned rows and the fused graph's shared in-place buffer."""
    return tiny_generator if request.param == "plain" else fused_generator


@pytest.fixture()
def sched(any_generator):
    s = Scheduler(any_generator, max_batch=4, max_queue=8, metrics=Metrics()).start()
    yield s
    s.stop()


def _ids(gen, text):
    return gen.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 1234)])
def test_batched_answers_equal_single_user_answers(any_generator, sched, temperature, seed):
    gen = any_generator
    cfgs = [gen.sampling(max_new_tokens=30 + 7 * i, temperature=temperature, top_p=0.95, seed=seed) for i in range(len(PROMPTS))]
    alone = [gen.complete(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs)]
    # more requests than slots: the later ones join while others decode (each prefill runs alone)
    reqs = [sched.submit(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs)]
    got = [r.answer(timeout=60) for r in reqs]
    assert sched.metrics.peak_batch == 4  # rows really shared steps
    for (want_text, want_last), (text, last) in zip(alone, got):
        assert last.token_ids == want_last.token_ids
        assert text == want_text
        assert last.finish_reason == want_last.finish_reason


def test_cancel_frees_the_slot_at_once(tiny_generator):
    gen = tiny_generator
    s = Scheduler(gen, max_batch=1, max_queue=4).start()
    try:
        long = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=200))
        nxt = s.submit(_ids(gen, "Tell me a fun fact."), gen.sampling(max_new_tokens=5))
        first = next(long.events(timeout=30))
        assert first.finish_reason is None
        long.cancel()
        text, last = nxt.answer(timeout=60)
        assert last.finish_reason in ("length", "stop") and last.stats["completion_tokens"] >= 1
        rest = list(long.events(timeout=30))
        assert rest[-1].finish_reason == "cancelled"
        assert len(rest[-1].token_ids) < 200
        assert s.active == 0 and s.queue_depth == 0
    finally:
        s.stop()


def test_full_queue_is_refused_with_retry_after(tiny_generator):
    gen = tiny_generator
    s = Scheduler(gen, max_batch=1, max_queue=1).start()
    try:
        block = threading.Event()  # a's consumer blocks the scheduler thread, so b must wait in the queue
        a = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=200), on_event=lambda ev: block.wait(5))
        time.sleep(0.2)  # a is decoding (and its consumer is slow)
        b = s.submit(_ids(gen, "Hi"), gen.sampling(max_new_tokens=2))
        with pytest.raises(QueueFullError, match="busy") as e:
            s.submit(_ids(gen, "Hey"), gen.sampling(max_new_tokens=2))
        assert e.value.retry_after_s >= 1
        a.cancel()
        b.cancel()
        block.set()
    finally:
        s.stop()


def test_prompt_longer_than_context_is_refused(any_generator, sched):
    with pytest.raises(ContextOverflowError, match="context holds 256"):
        sched.submit(list(range(5, 305)), any_generator.sampling())


def test_answer_stops_at_the_end_of_the_context(any_generator, sched):
    gen = any_generator
    ids = (_ids(gen, "Hello! " * 40))[:240]
    text, last = sched.submit(ids, gen.sampling(max_new_tokens=100)).answer(timeout=60)
    want_text, want_last = gen.complete(ids, gen.sampling(max_new_tokens=100))
    assert last.token_ids == want_last.token_ids and last.finish_reason == want_last.finish_reason == "length"
    assert len(ids) + len(last.token_ids) <= 256


def test_batch_cache_keeps_rows_right_aligned_and_trims(tiny_generator):
    dec = tiny_generator.decoder
    bc = BatchCache(dec)
    rows = []
    for n in (3, 5, 2):
        c = dec.new_cache()
        dec.prefill(list(range(10, 10 + n)), c)
        rows.append(c)
        bc.add(c)
    assert bc.lengths == [3, 5, 2] and bc.width == 5
    k = bc.values[0].numpy()
    assert k.shape[0] == 3 and k.shape[2] == 5
    assert np.all(k[0, :, :2] == 0) and np.all(k[2, :, :3] == 0)  # left padding
    np.testing.assert_array_equal(k[1], rows[1].values[0].numpy()[0])
    bc.remove([1])
    assert bc.lengths == [3, 2] and bc.width == 3 and bc.values[0].numpy().shape[2] == 3
    np.testing.assert_array_equal(bc.values[0].numpy()[0], rows[0].values[0].numpy()[0])
    bc.remove([0, 1])
    assert bc.values is None and bc.width == 0


def test_shared_batch_cache_prefills_in_place_and_closes_up(fused_generator):
    """Fused graphs: a row is prefilled straight into its slot; a row leaving moves the later ones up intact."""
    dec = fused_generator.decoder
    bc = SharedBatchCache(dec, slots=4, capacity=8)
    for n in (3, 5, 2):
        row = bc.new_row(n)
        dec.prefill(list(range(10, 10 + n)), row)
        bc.add(row)
    assert bc.lengths == [3, 5, 2] and bc.width == 5
    alone = dec.new_cache(capacity=8)
    dec.prefill(list(range(10, 15)), alone)
    k = bc.buffers.arrays[0]
    np.testing.assert_array_equal(k[1, :, :5], alone.arrays[0][0, :, :5])  # row 1 holds the 5-token prompt, unmoved
    third = k[2, :, :2].copy()
    bc.remove([1])
    assert bc.lengths == [3, 2]
    np.testing.assert_array_equal(k[1, :, :2], third)  # the 2-token row moved up into slot 1
    # a step past the buffer's capacity grows it and keeps every row's columns
    bc.step([7, 7]), bc.step([8, 8]), bc.step([9, 9]), bc.step([9, 9]), bc.step([9, 9]), bc.step([9, 9])
    assert bc.lengths == [9, 8] and bc.buffers.capacity >= 9
    np.testing.assert_array_equal(bc.buffers.arrays[0][1, :, :2], third)
    with pytest.raises(Exception, match="new_row"):
        bc.add(dec.new_cache(capacity=8))


@pytest.mark.parametrize("engine", ["int8-dynamic", "int4-weight"])
def test_batched_step_logits_equal_single_row_logits(tiny_bundle, engine):
    """A row's logits must not depend on which other rows share the step (kernels whose numerics change
    with the batch size would make batched answers drift from single-user ones)."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator

    dec = Generator.from_bundle(Bundle.open(tiny_bundle.root), engine=engine, threads=1).decoder
    prompts = [list(range(10, 13)), list(range(20, 27)), list(range(30, 35))]
    assert_batched_steps_equal_alone(dec, prompts, [40, 41, 42], capacity=16, atol=1e-5)


def _spy_prefill_rows(monkeypatch, gen) -> list[tuple[int, int]]:
    """(rows, tokens) of every prefill call (more than one token a row) the fused decoder runs from now on."""
    calls: list[tuple[int, int]] = []
    real = gen.decoder.run_fused

    def spy(ids, *a, **kw):
        if ids.shape[1] > 1:
            calls.append(ids.shape)
        return real(ids, *a, **kw)

    monkeypatch.setattr(gen.decoder, "run_fused", spy)
    return calls


@pytest.mark.parametrize("budget", [0, 64, 100])
def test_requests_that_arrive_together_get_their_single_user_answers(fused_generator, monkeypatch, budget):
    """Fused graphs: requests waiting together share batched calls for their prompts' first prefill span, as many
    prompts per call as `Admission.prefill_batch_tokens` allows (rows x the longest span; 0: ONE call for all four;
    else runs of them in arrival order, a call no larger than the budget unless one prompt alone is), and each
    answer equals its single-user answer."""
    gen = fused_generator
    cfgs = [gen.sampling(max_new_tokens=20 + 3 * i, ignore_eos=True) for i in range(4)]
    alone = [gen.complete(_ids(gen, p), c)[1].token_ids for p, c in zip(PROMPTS, cfgs)]
    prefill_calls = _spy_prefill_rows(monkeypatch, gen)
    s = Scheduler(gen, max_batch=4, max_queue=8)
    s.admission = dataclasses.replace(s.admission, prefill_batch_tokens=budget)
    s.start()
    try:
        with s._cv:  # hold the loop off so all four are waiting when it looks
            reqs = [s.submit(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs)]
        got = [r.answer(timeout=60)[1].token_ids for r in reqs]
    finally:
        s.stop()
    assert got == alone
    lengths = [len(_ids(gen, p)) for p in PROMPTS[:4]]
    assert all(n <= 64 for n in lengths)  # each prompt fits the first span: one call row each
    want, run = [], []  # the runs the budget allows, in arrival order
    for n in lengths:
        if run and (not budget or (len(run) + 1) * max(run + [n]) <= budget):
            run.append(n)
        else:
            want, run = want + ([run] if run else []), [n]
    want.append(run)
    assert [b for b, _ in prefill_calls] == [len(r) for r in want], (prefill_calls, lengths)
    assert [w for _, w in prefill_calls] == [max(r) for r in want]
    assert [b for b, _ in prefill_calls] == {0: [4], 64: [1, 1, 1, 1], 100: [2, 2]}[budget]  # prompts of 37-50


@pytest.mark.parametrize("override, calls", [(0, [4]), (100, [2, 2]), (None, [1, 1, 1, 1])])
def test_prefill_batch_tokens_sets_the_runs(fused_generator, monkeypatch, override, calls):
    """`serve --prefill-batch-tokens` (Admission.prefill_batch_tokens), set through the server's Service as the CLI
    does: 0 puts every prompt that arrives together in one call, N cuts runs at N tokens, unset keeps the default
    (64: 37-50 token chat prompts one at a time)."""
    from edge.serve.service import Service

    gen = fused_generator
    cfgs = [gen.sampling(max_new_tokens=4, ignore_eos=True) for _ in range(4)]
    prefill_calls = _spy_prefill_rows(monkeypatch, gen)
    service = Service(gen, max_users=4, prompt_cache_mb=0, prefill_batch_tokens=override)
    s = service.scheduler.start()
    try:
        with s._cv:
            reqs = [s.submit(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs)]
        for r in reqs:
            r.answer(timeout=60)
    finally:
        s.stop()
    assert [b for b, _ in prefill_calls] == calls
    with pytest.raises(EdgeChatError, match="--prefill-batch-tokens must be >= 0"):
        Service(gen, max_users=4, prompt_cache_mb=0, prefill_batch_tokens=-1)


def test_a_failed_batched_run_among_several_keeps_every_answer(fused_generator, monkeypatch):
    """Runs of two (budget 100): the second run's batched call fails, so its prompts are prefilled one at a time;
    a row that ends on its first token leaves between runs. Every answer is still its single-user answer and the
    scheduler is left idle."""
    gen = fused_generator
    cfgs = [gen.sampling(max_new_tokens=1 if i == 0 else 6 + i, ignore_eos=True) for i in range(4)]
    alone = [gen.complete(_ids(gen, p), c)[1].token_ids for p, c in zip(PROMPTS, cfgs)]
    s = Scheduler(gen, max_batch=4, max_queue=8)
    s.admission = dataclasses.replace(s.admission, prefill_batch_tokens=100)
    real = s.cache.admit_together
    tries: list[int] = []

    def fail_second(prompts):
        tries.append(len(prompts))
        if len(tries) == 2:
            raise RuntimeError("a batched call that fails")
        return real(prompts)

    monkeypatch.setattr(s.cache, "admit_together", fail_second)
    s.start()
    try:
        with s._cv:
            reqs = [s.submit(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs)]
        got = [r.answer(timeout=60)[1].token_ids for r in reqs]
        assert got == alone
        assert tries == [2, 2]
        assert _idle(s)
    finally:
        s.stop()


def test_a_request_gone_before_its_run_is_not_prefilled(fused_generator, monkeypatch):
    """Prompts one after another (the default budget): a request cancelled while the earlier ones are prefilled is
    closed with its reason, not prefilled, and emits no token."""
    gen = fused_generator
    cfg = gen.sampling(max_new_tokens=3, ignore_eos=True)
    prefill_calls = _spy_prefill_rows(monkeypatch, gen)
    s = Scheduler(gen, max_batch=4, max_queue=8)
    real = s.cache.admit
    reqs: list = []

    def admit_then_cancel_the_last(prompt):
        out = real(prompt)
        reqs[-1].cancel()  # while the first prompts are prefilled
        return out

    monkeypatch.setattr(s.cache, "admit", admit_then_cancel_the_last)
    s.start()
    try:
        with s._cv:
            reqs += [s.submit(_ids(gen, p), cfg) for p in PROMPTS[:3]]
        finals = [r.answer(timeout=60)[1] for r in reqs]
    finally:
        s.stop()
    assert [f.finish_reason for f in finals[:2]] == ["length", "length"]
    assert finals[2].finish_reason == "cancelled" and finals[2].token_ids == []
    assert len(prefill_calls) == 2


def test_decoding_rows_step_between_prompt_runs(fused_generator, monkeypatch):
    """Prompts that arrive together, one run each (the default budget): after the first run the rows that are
    decoding take a step before the next run is prefilled (prefill, step, prefill, step, ...), so an admitted
    answer goes on while later prompts are prefilled instead of stalling after its first token; every answer is
    still its single-user answer."""
    gen = fused_generator
    cfgs = [gen.sampling(max_new_tokens=12, ignore_eos=True) for _ in range(4)]
    alone = [gen.complete(_ids(gen, p), c)[1].token_ids for p, c in zip(PROMPTS, cfgs)]
    calls: list[str] = []
    real = gen.decoder.run_fused

    def spy(ids, *a, **kw):
        calls.append("P" if ids.shape[1] > 1 else "S")
        return real(ids, *a, **kw)

    monkeypatch.setattr(gen.decoder, "run_fused", spy)
    s = Scheduler(gen, max_batch=4, max_queue=8).start()
    try:
        with s._cv:
            reqs = [s.submit(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs)]
        got = [r.answer(timeout=60)[1].token_ids for r in reqs]
    finally:
        s.stop()
    assert got == alone
    assert calls[:7] == ["P", "S", "P", "S", "P", "S", "P"], calls[:10]


def test_prompt_runs_and_a_long_prompt_in_the_side_slot_share_the_steps(fused_generator, monkeypatch):
    """A long prompt going into the side slot, a row decoding, and four short prompts that arrive together (runs of
    one, a step between runs): the side slot's spans, the runs and the steps interleave (no run waits for the long
    prompt, the long prompt goes on while the runs are prefilled) and every answer is its single-user answer."""
    import edge.decode.scheduler as batching

    gen = fused_generator
    monkeypatch.setattr(batching, "ADMISSION", batching.Admission(long_prompt=64))
    long_ids = _ids(gen, " ".join(["Tell me about the ocean and the fish that live in it."] * 6))
    assert len(long_ids) > 64 >= max(len(_ids(gen, p)) for p in PROMPTS)
    first_cfg = gen.sampling(max_new_tokens=40, ignore_eos=True)
    cfgs = [gen.sampling(max_new_tokens=10 + i, ignore_eos=True) for i in range(5)]
    want_first = gen.complete(_ids(gen, PROMPTS[5]), first_cfg)[1].token_ids
    want = [gen.complete(long_ids, cfgs[0])[1].token_ids] + [gen.complete(_ids(gen, p), c)[1].token_ids
                                                            for p, c in zip(PROMPTS, cfgs[1:])]
    calls: list[str] = []
    real_fused = gen.decoder.run_fused

    def fused(ids, *a, **kw):
        calls.append(("P", "S")[ids.shape[1] == 1] + str(ids.shape[0]))
        return real_fused(ids, *a, **kw)

    s = Scheduler(gen, max_batch=6, max_queue=8)
    s.admission.interleaved_span = 16
    monkeypatch.setattr(gen.decoder, "run_fused", fused)
    s.start()
    try:
        first = s.submit(_ids(gen, PROMPTS[5]), first_cfg)
        while not calls or calls[-1][0] != "S":
            time.sleep(0.001)
        with s._cv:  # the long prompt and the four short ones are all waiting when the loop looks
            reqs = [s.submit(long_ids, cfgs[0])] + [s.submit(_ids(gen, p), c) for p, c in zip(PROMPTS, cfgs[1:])]
            real_span = s._prefill_next_chunk
            monkeypatch.setattr(s, "_prefill_next_chunk", lambda: calls.append("L") or real_span())
        got = [r.answer(timeout=60)[1].token_ids for r in reqs]
        assert first.answer(timeout=60)[1].token_ids == want_first
    finally:
        s.stop()
    assert got == want
    assert s.prefilling is None and s.cache.side is None and not s.rows
    calls = [c for i, c in enumerate(calls) if not (c == "P1" and i and calls[i - 1] == "L")]  # a span is one call
    runs = [i for i, c in enumerate(calls) if c == "P1"][1:]  # the four short prompts' runs (the first is `first`'s)
    spans = [i for i, c in enumerate(calls) if c == "L"]
    assert len(runs) == 4 and len(spans) == -(-len(long_ids) // 16)
    for a, b in zip(runs, runs[1:]):  # a decode step between two runs
        assert any(c.startswith("S") for c in calls[a + 1:b]), calls
    assert spans[0] < runs[-1] and spans[-1] > runs[0], calls  # the side slot's spans went on during the runs


def test_a_cache_that_does_not_batch_admits_each_prompt_alone(tiny_generator, monkeypatch):
    """A plain graph (its BatchCache prefills prompts one after another anyway): requests that arrive together are
    admitted one at a time, each first token as soon as its own prompt is in, not all or none at the end."""
    gen = tiny_generator
    cfg = gen.sampling(max_new_tokens=3, ignore_eos=True)
    s = Scheduler(gen, max_batch=4, max_queue=8)
    assert not s.cache.batches_first_prefill
    seen: list[str] = []
    real_one, real_all = s.cache.admit, s.cache.admit_together
    monkeypatch.setattr(s.cache, "admit", lambda p: seen.append("admit") or real_one(p))
    monkeypatch.setattr(s.cache, "admit_together", lambda ps: seen.append("together") or real_all(ps))
    s.start()
    try:
        with s._cv:
            reqs = [s.submit(_ids(gen, p), cfg) for p in PROMPTS[:3]]
        for r in reqs:
            r.answer(timeout=60)
    finally:
        s.stop()
    assert seen == ["admit", "admit", "admit"]


@pytest.mark.parametrize("engine", ["int8-dynamic", "int4-weight"])
def test_prompts_prefilled_together_equal_each_prompt_alone(tiny_bundle, engine):
    """admit_together: new prompts' first prefill span in one batched, right-padded call, the rest of each alone:
    every row's logits and K/V equal its prefill alone, bit for bit where the engine is batch invariant on this
    CPU (edge.backends.determinism), else within the batched decode step's tolerance; a failed call admits
    nobody."""
    from edge.backends.determinism import batch_invariance
    from edge.bundle import Bundle
    from edge.decode.generate import Generator

    dec = Generator.from_bundle(Bundle.open(tiny_bundle.root), engine=engine, threads=1).decoder
    exact = batch_invariance(engine, "CPUExecutionProvider").guaranteed
    prompts = [list(range(10, 13)), list(range(20, 90)), list(range(30, 94)), [7], list(range(5, 135))]
    bc = SharedBatchCache(dec, slots=7, capacity=16)
    got = bc.admit_together(prompts)
    assert bc.lengths == [3, 70, 64, 1, 130] and bc.reused == 0
    for i, p in enumerate(prompts):
        alone = dec.new_cache(capacity=256)
        want = dec.prefill(p, alone)[0]
        if exact:
            np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
            for a, b in zip(bc.buffers.arrays, alone.arrays):
                np.testing.assert_array_equal(a[i, :, :len(p)], b[0, :, :len(p)], err_msg=f"row {i}")
        else:
            np.testing.assert_allclose(got[i], want, atol=1e-5, rtol=0, err_msg=f"row {i}")
    steps = bc.step([40, 41, 42, 43, 44])  # and the rows decode on together
    assert steps.shape[0] == 5
    with pytest.raises(Exception, match="do not fit"):
        bc.admit_together([[1], [2], [3]])
    with pytest.raises(Exception, match="out of|bounds|indices"):
        bc.admit_together([[1], [10**9]])  # a token id past the vocabulary: the call fails, nobody is admitted
    assert len(bc) == 5


def test_shared_cache_prefill_is_bitwise_the_single_user_prefill(fused_generator):
    """prefill_rows runs each prompt with the calls Decoder.prefill runs for it alone: the same logits and
    K/V bit for bit (what keeps an answer independent of who else is being served)."""
    dec = fused_generator.decoder
    prompts = [list(range(10, 13)), list(range(20, 57)), list(range(30, 35))]
    together = SharedBatchCache(dec, slots=4, capacity=16)
    first = together.prefill_rows(prompts)
    assert together.lengths == [3, 37, 5]
    for i, p in enumerate(prompts):
        alone = dec.new_cache(capacity=64)
        np.testing.assert_array_equal(first[i], dec.prefill(p, alone)[0])
        np.testing.assert_array_equal(together.buffers.arrays[0][i, :, :len(p)], alone.arrays[0][0, :, :len(p)])
    with pytest.raises(Exception, match="do not fit"):
        together.prefill_rows([[1], [2]])


def test_side_row_follows_growth_and_closing_up_then_joins(fused_generator):
    """A long prompt prefilled a chunk at a time into the last slot, while the active rows decode, grow
    the buffer (re-homing it) and close up after a leaver: it joins with the K/V and logits it would
    have had alone."""
    dec = fused_generator.decoder
    bc = SharedBatchCache(dec, slots=4, capacity=8)
    bc.prefill_rows([list(range(10, 13)), list(range(20, 25))])
    long = list(range(30, 50))
    side = bc.side_row(len(long))
    assert bc.free == 1  # 4 slots: 2 rows + the held side slot
    with pytest.raises(Exception, match="already"):
        bc.side_row(4)
    logits = None
    for i, start in enumerate(range(0, len(long), 6)):
        logits = dec.forward(np.asarray(long[start:start + 6]), bc.side_view())[0]
        bc.step([7] * len(bc))  # the active rows decode between chunks
        if i == 0:
            bc._reserve(64)  # the buffers grow (a new allocation) mid-prefill
        if i == 1:
            bc.remove([0])  # a row leaves: rows close up; the side slot is not theirs to move
    alone = dec.new_cache(capacity=64)
    want = dec.prefill(long, alone)[0]
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
    bc.add_side()
    assert bc.side is None and bc.lengths[-1] == len(long) and len(bc) == 2
    np.testing.assert_array_equal(bc.buffers.arrays[0][1, :, :len(long)], alone.arrays[0][0, :, :len(long)])
    step = bc.step([40, 41])  # and it decodes in the batch as it would alone
    np.testing.assert_allclose(step[1], dec.forward(np.array([[41]]), alone)[0], atol=1e-5, rtol=0)


def test_long_prompt_is_prefilled_between_decode_steps(fused_generator, monkeypatch):
    """Fused graphs: while a long prompt is prefilled (a chunk per step), the answer already streaming
    keeps getting tokens; both answers equal their single-user answers."""
    import edge.decode.scheduler as batching

    gen = fused_generator
    monkeypatch.setattr(batching, "ADMISSION", batching.Admission(long_prompt=32))
    long_ids = _ids(gen, " ".join(["Tell me about the ocean and the fish that live in it."] * 6))
    assert len(long_ids) > 64
    short_cfg = gen.sampling(max_new_tokens=60, ignore_eos=True)
    long_cfg = gen.sampling(max_new_tokens=12, ignore_eos=True)
    want_short = gen.complete(_ids(gen, "Hello!"), short_cfg)[1].token_ids
    want_long = gen.complete(long_ids, long_cfg)[1].token_ids
    s = Scheduler(gen, max_batch=3, max_queue=4)
    s.admission.interleaved_span = 8
    s.start()
    log: list[tuple[str, bool]] = []
    try:
        short = s.submit(_ids(gen, "Hello!"), short_cfg, on_event=lambda ev: log.append(("short", ev.finish_reason)))
        while not log:
            time.sleep(0.001)
        long = s.submit(long_ids, long_cfg, on_event=lambda ev: log.append(("long", ev.finish_reason)))
        assert long.done.wait(60) and short.done.wait(60)
    finally:
        s.stop()
    first_long = next(i for i, (who, _) in enumerate(log) if who == "long")
    during = sum(1 for who, _ in log[1:first_long] if who == "short")
    assert during >= len(long_ids) // 8 - 2  # about one token per chunk, not a freeze
    assert s.prefilling is None and s.cache.side is None


def test_long_prompt_answers_equal_single_user_answers(fused_generator, monkeypatch):
    """Two long prompts (one waits for the side slot) and short ones, cancelled mid-prefill too."""
    import edge.decode.scheduler as batching

    gen = fused_generator
    monkeypatch.setattr(batching, "ADMISSION", batching.Admission(long_prompt=16))
    prompts = [" ".join([p] * 4) for p in PROMPTS[1:4]] + PROMPTS[:2]
    cfgs = [gen.sampling(max_new_tokens=10 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    alone = [gen.complete(_ids(gen, p), c)[1].token_ids for p, c in zip(prompts, cfgs)]
    s = Scheduler(gen, max_batch=3, max_queue=8).start()
    try:
        reqs = [s.submit(_ids(gen, p), c) for p, c in zip(prompts, cfgs)]
        gone = s.submit(_ids(gen, prompts[0]), cfgs[0])
        gone.cancel()
        got = [r.answer(timeout=60)[1].token_ids for r in reqs]
        assert gone.answer(timeout=60)[1].finish_reason == "cancelled"
    finally:
        s.stop()
    assert got == alone


def test_prompt_cache_reuses_prefilled_spans_and_gives_the_same_numbers(fused_generator):
    """A prompt that starts like an earlier one gets that start's K/V copied into its slot up to a prefill
    boundary and prefills only the rest: its logits and K/V equal an uncached prefill's BIT FOR BIT (so the
    answer cannot depend on the cache); only prefilled spans are kept; an entry a later turn extends is
    replaced; the byte bound holds."""
    dec = fused_generator.decoder
    bc = SharedBatchCache(dec, slots=5, capacity=16, prompt_cache_bytes=1 << 23)
    first = list(range(10, 110))  # 100 tokens: prefilled as 0-64, 64-100
    bc.prefill_rows([first])
    bc.step([40]), bc.step([41])
    bc.remember(0, first)
    bc.remove([0])
    assert [len(t) for t, _ in bc.prompts.entries] == [64]  # the spans up to its last boundary, no answer tokens
    prompts = [first[:70] + [160, 161, 162], first + [163, 164], list(range(170, 174)), first[:65], first[:64]]
    got = bc.prefill_rows(prompts)
    assert bc.reused_rows == [64, 64, 0, 64, 0]  # never the last prompt token, always at a boundary
    assert bc.prompts.hits == 3 and bc.prompts.tokens_reused == 3 * 64
    for i, p in enumerate(prompts):
        c = dec.new_cache(capacity=256)
        np.testing.assert_array_equal(got[i], dec.prefill(p, c)[0], err_msg=f"prompt {i}")
        for a, b in zip(bc.buffers.arrays, c.arrays):
            np.testing.assert_array_equal(a[i, :, :len(p)], b[0, :, :len(p)])
    longer = first + [(7 * i) % 300 + 20 for i in range(100)]  # 200 tokens: its entry (128) replaces the 64 one
    bc.remove([0, 1, 2, 3, 4])
    bc.prefill_rows([longer])
    bc.remember(0, longer)
    assert [len(t) for t, _ in bc.prompts.entries] == [128]
    bc.remember(0, first)  # what an entry already holds is not copied again
    assert [len(t) for t, _ in bc.prompts.entries] == [128]
    bc.prompts.max_bytes = bc.prompts.nbytes - 1  # a conversation larger than the whole cache is not kept
    kept = [t.tolist() for t, _ in bc.prompts.entries]
    bc.remember(0, longer + [1] * 10)
    assert [t.tolist() for t, _ in bc.prompts.entries] == kept
    assert SharedBatchCache(dec, slots=2, capacity=8).prompts is None  # off unless given a size


@pytest.mark.parametrize("long", [False, True], ids=["short", "long-prompt-path"])
def test_scheduler_reuses_a_conversation_on_its_next_turn(fused_generator, monkeypatch, long):
    """The scheduler keeps each finished conversation's K/V: the next turn (the same chat plus the answer and
    a new question) prefills only the new tokens, says so in its stats and metrics, and answers exactly as
    a fresh prefill would; also when that turn is long enough to be prefilled in chunks between decode
    steps; a prompt cache of 0 MB turns it off."""
    import edge.decode.scheduler as batching

    gen = fused_generator
    cfg = gen.sampling(max_new_tokens=12, ignore_eos=True)
    turn1 = [{"role": "user", "content": "Hello! Tell me about the ocean, its waves and the fish in it."}]  # > 64 tokens
    if long:  # the second turn goes through the side slot, a chunk at a time
        monkeypatch.setattr(batching, "ADMISSION", batching.Admission(long_prompt=len(gen.tokenizer.encode_chat(turn1)) + 2))
    s = Scheduler(gen, max_batch=2, max_queue=4, metrics=Metrics()).start()
    off = Scheduler(gen, max_batch=2, max_queue=4, prompt_cache_mb=0).start()
    try:
        answer, last = s.submit(gen.tokenizer.encode_chat(turn1), cfg).answer(timeout=60)
        assert last.stats["cached_prompt_tokens"] == 0  # nothing to reuse yet
        turn2 = gen.tokenizer.encode_chat(turn1 + [{"role": "assistant", "content": answer},
                                                   {"role": "user", "content": "And the sky?"}])
        text, last = s.submit(turn2, cfg).answer(timeout=60)
        # the first turn's prompt, up to its last prefill boundary (an answer's decoded K/V are never reused)
        assert last.stats["cached_prompt_tokens"] == boundary_at_or_below(len(gen.tokenizer.encode_chat(turn1))) > 0
        assert s.metrics.cached_prompt_tokens == last.stats["cached_prompt_tokens"]
        want_text, want = gen.complete(turn2, cfg)
        assert last.token_ids == want.token_ids and text == want_text
        assert off.submit(turn2, cfg).answer(timeout=60)[1].stats["cached_prompt_tokens"] == 0
        assert off.cache.prompts is None
    finally:
        s.stop(), off.stop()
    with pytest.raises(Exception, match="prompt cache size must be >= 0"):
        Scheduler(gen, prompt_cache_mb=-1)


def _idle(s: Scheduler, seconds: float = 2.0) -> bool:
    """The last event is emitted just before its row leaves: wait for the scheduler to have no row."""
    deadline = time.monotonic() + seconds
    while s.active and time.monotonic() < deadline:
        time.sleep(0.01)
    return s.active == 0


def test_an_error_in_one_request_fails_only_that_request(any_generator):
    """A request whose sampling options slipped past validation (seed -1 used to kill the scheduler thread)
    fails alone, with the reason; the request beside it gets its full single-user answer; the loop lives."""
    gen = any_generator
    good_cfg = gen.sampling(max_new_tokens=20, ignore_eos=True)
    want = gen.complete(_ids(gen, "Hello!"), good_cfg)[1].token_ids
    bad_cfg = gen.sampling(temperature=0.5)
    object.__setattr__(bad_cfg, "seed", -1)  # past SamplingConfig's own check, as a bug elsewhere could
    s = Scheduler(gen, max_batch=2, max_queue=4, metrics=Metrics()).start()
    try:
        good = s.submit(_ids(gen, "Hello!"), good_cfg)
        bad = s.submit(_ids(gen, "Hi"), bad_cfg)
        _, last = bad.answer(timeout=30)
        assert last.finish_reason == "error" and "non-negative" in last.stats["error"], last.stats
        assert good.answer(timeout=30)[1].token_ids == want
        assert s.alive and s.restarts == 0 and _idle(s)
        assert s.metrics.finished["error"] == 1
    finally:
        s.stop()


def test_a_failing_decode_step_fails_its_rows_and_the_loop_goes_on(fused_generator, monkeypatch):
    gen = fused_generator
    s = Scheduler(gen, max_batch=2, max_queue=4).start()
    try:
        real = s.cache.step
        calls = {"n": 0}

        def broken(tokens):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated ONNX Runtime failure")
            return real(tokens)

        monkeypatch.setattr(s.cache, "step", broken)
        _, last = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=10, ignore_eos=True)).answer(timeout=30)
        assert last.finish_reason == "error" and "simulated" in last.stats["error"]
        _, last = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=10, ignore_eos=True)).answer(timeout=30)
        assert last.finish_reason == "length" and s.alive and _idle(s)
    finally:
        s.stop()


def test_the_supervisor_restarts_a_failed_loop_and_says_so(fused_generator, monkeypatch):
    """A bug that escapes the per-request guards fails the requests in flight, and the loop is restarted with
    a fresh batch cache (restarts, error); waiting requests are then served."""
    gen = fused_generator
    s = Scheduler(gen, max_batch=2, max_queue=4).start()
    try:
        real = s._drop_unwanted
        calls = {"n": 0}

        def buggy():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated bug in the loop")
            real()

        monkeypatch.setattr(s, "_drop_unwanted", buggy)
        _, last = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=30, ignore_eos=True)).answer(timeout=30)
        assert last.finish_reason == "error" and "simulated bug" in last.stats["error"]
        assert s.restarts == 1 and "simulated bug" in s.error and s.alive
        _, last = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=5, ignore_eos=True)).answer(timeout=30)
        assert last.finish_reason == "length" and _idle(s) and len(s.cache) == 0
    finally:
        s.stop()


@pytest.fixture(scope="module")
def wide_fused_generator(tmp_path_factory):
    """A wider tiny model (hidden 256) whose int8 graph gives a prompt's last logits slightly different
    numbers when that last token runs alone (M=1) than inside the prompt's prefill: what made the old prompt
    cache change answers (SmolLM2: 5 of 6 greedy answers) and what the 64-wide model does not show."""
    from conftest import make_tiny_model
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path_factory.mktemp("wide") / "tiny-llama-wide", hidden=256, intermediate=768)
    out = tmp_path_factory.mktemp("bundles") / "wide.bundle"
    build(BuildOptions(output=out, model=str(src), precisions=("int8-dynamic",), max_context=256, eval_samples=2,
                       calibration_samples=2), log=lambda s: None)
    return Generator.from_bundle(Bundle.open(out), engine="int8-dynamic", threads=1)


def test_a_repeated_prompt_from_the_cache_gets_the_uncached_logits_bit_for_bit(wide_fused_generator):
    dec = wide_fused_generator.decoder
    prompt = list(range(10, 110))
    fresh = dec.new_cache(capacity=128)
    want = dec.prefill(prompt, fresh)[0]
    # the hazard is real on this model: the old cache reused all but the last token and ran it alone
    old = dec.new_cache(capacity=128)
    dec.forward(np.asarray(prompt[:-1]), old)
    assert not np.array_equal(dec.forward(np.asarray(prompt[-1:]), old)[0], want)
    bc = SharedBatchCache(dec, slots=3, capacity=128, prompt_cache_bytes=1 << 22)
    bc.prefill_rows([prompt])
    for t in (5, 6, 7):  # the answer's decode steps: never reused
        bc.step([t])
    bc.remember(0, prompt)
    again = bc.prefill_rows([prompt, prompt[:70] + [99, 98, 97, 96, 95]])
    assert bc.reused_rows == [64, 64]
    np.testing.assert_array_equal(again[0], want)
    np.testing.assert_array_equal(again[1], dec.prefill(prompt[:70] + [99, 98, 97, 96, 95],
                                                        dec.new_cache(capacity=128))[0])


def test_a_dead_scheduler_thread_is_started_again_by_the_next_request(fused_generator, monkeypatch):
    """Past the supervisor (a BaseException, which it does not catch): the thread ends; the next submit
    starts it again and is served, and the restart is counted."""
    gen = fused_generator

    class Die(BaseException):
        pass

    s = Scheduler(gen, max_batch=2, max_queue=4)
    real = s._loop
    monkeypatch.setattr(s, "_loop", lambda: (_ for _ in ()).throw(Die()))
    s.start()
    s._thread.join(5)
    assert not s.alive
    monkeypatch.setattr(s, "_loop", real)
    try:
        _, last = s.submit(_ids(gen, "Hello!"), gen.sampling(max_new_tokens=5, ignore_eos=True)).answer(timeout=30)
        assert last.finish_reason == "length" and s.alive and s.restarts == 1
    finally:
        s.stop()
