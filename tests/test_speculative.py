"""Speculative decoding (edge.decode.speculative proposes, edge.decode.scheduler checks): greedy output is the
plain greedy output token for token, sampled output is distributed as the target's, and a draft model's
rollback leaves its cache as a fresh prefill would."""

from __future__ import annotations

import numpy as np
import pytest

from edge.decode.generate import Generator
from edge.decode.sampling import SamplingConfig
from edge.decode.speculative import (AdaptiveK, Pacer, RowSpeculator, SpecStats, accept_sampled, lookup_draft, rollback,
                                     target_probs)

PROMPTS = [[{"role": "user", "content": "What is the capital of Japan? The capital of Japan is"}],
           [{"role": "user", "content": "Hello! How are you doing today? Hello! How are you"}]]


def plain(gen: Generator, ids: list[int], cfg: SamplingConfig) -> list[int]:
    return list(gen.stream(ids, cfg, speculator=None))[-1].token_ids


def spec(gen: Generator, ids: list[int], cfg: SamplingConfig, drafter=lookup_draft, k: int | None = None,
         stats: SpecStats | None = None) -> list[int]:
    """The answer through the scheduler's loop with a proposer that drafts at every step it may: exactly k
    tokens (`RowSpeculator.fixed`), or k adapted to the acceptance (k None); `stats` counts them."""
    speculator = RowSpeculator.fixed(drafter, k) if k else RowSpeculator(drafter, pacer=Pacer(always=True))
    if stats is not None:
        speculator.stats = stats
    return list(gen.stream(ids, cfg, speculator=speculator))[-1].token_ids


def oracle(answer: list[int], prompt_len: int, wrong_every: int):
    """A drafter that knows the plain answer but gets every `wrong_every`-th guess wrong: exercises long
    accepted runs and rejections at every draft position."""
    calls = [0]

    def draft(seq: list[int], k: int) -> list[int]:
        at = len(seq) - prompt_len
        guess = answer[at:at + k]
        calls[0] += 1
        if guess and calls[0] % wrong_every == 0:
            j = calls[0] % len(guess)
            guess[j] = (guess[j] + 1) % 300
        return guess

    return draft


def test_lookup_draft_finds_latest_ngram():
    assert lookup_draft([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6], 3) == [7, 9, 5]  # latest "5 6" is followed by 7 9 5
    assert lookup_draft([1, 2, 3, 1, 2], 2) == [3, 1]
    assert lookup_draft([1, 2, 3], 4) == []  # nothing repeats
    assert lookup_draft([4, 4], 3) == [4]


def test_adaptive_k_follows_acceptance():
    pol = AdaptiveK(k_max=8)
    for _ in range(20):
        pol.update(pol.k, pol.k)
    assert pol.k == 8
    for _ in range(20):
        pol.update(pol.k, 0)
    assert pol.k == 1


@pytest.mark.parametrize("engine", ["int8-dynamic", "int4-weight"])  # the fused in-place caches that check drafts
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_identical_for_every_k(tiny_bundle, engine, k):
    gen = Generator.from_bundle(tiny_bundle, engine=engine, threads=1)
    cfg = SamplingConfig(max_new_tokens=40, ignore_eos=True)
    for msgs in PROMPTS:
        ids = gen.tokenizer.encode_chat(msgs)
        want = plain(gen, ids, cfg)
        stats = SpecStats()
        got = spec(gen, ids, cfg, drafter=oracle(want, len(ids), wrong_every=3), k=k, stats=stats)
        assert got == want, f"{engine} k={k}"
        assert stats.accepted > 0 and stats.accepted < stats.drafted  # both paths ran
        assert spec(gen, ids, cfg, k=k) == want  # prompt lookup


def test_a_plain_graph_never_drafts(tiny_generator):
    """The plain graph's cache cannot check drafts (`can_verify` False): a proposer that would draft at every
    step is never asked for a draft there, and the answer is the plain one."""
    from edge.decode.cache import BatchCache, can_verify

    gen = tiny_generator
    assert not gen.decoder.io.fused and not can_verify(gen.decoder) and not BatchCache.can_verify
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(max_new_tokens=20, ignore_eos=True)
    want = plain(gen, ids, cfg)
    stats = SpecStats()
    assert spec(gen, ids, cfg, drafter=oracle(want, len(ids), wrong_every=3), k=4, stats=stats) == want
    assert stats.calls == stats.drafted == 0
    with pytest.raises(Exception, match="cannot verify drafts"):
        gen.scheduler.cache.verify([1, 2])


def test_greedy_identical_with_eos_and_penalty(fused_generator):
    gen = fused_generator
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    for cfg in (SamplingConfig(max_new_tokens=60), SamplingConfig(max_new_tokens=30, repetition_penalty=1.3)):
        want = plain(gen, ids, cfg)
        assert spec(gen, ids, cfg, drafter=oracle(want, len(ids), 2), k=4) == want
        assert spec(gen, ids, cfg) == want


def test_context_end_same_as_plain(tiny_bundle):
    gen = Generator.from_bundle(tiny_bundle, engine="int8-dynamic", threads=1)
    ids = gen.tokenizer.encode_chat(PROMPTS[0])
    ids = (ids * 20)[: gen.max_context - 7]  # 7 tokens of room: the answer ends at the context, as plain's does
    cfg = SamplingConfig(max_new_tokens=50, ignore_eos=True)
    want = plain(gen, ids, cfg)
    assert len(want) == 7
    assert spec(gen, ids, cfg, drafter=oracle(want, len(ids), 5), k=8) == want


@pytest.mark.parametrize("engine", ["int8-dynamic", "fp32"])  # a draft model's own cache: fused or plain
def test_rollback_equals_fresh_prefill(tiny_bundle, engine):
    gen = Generator.from_bundle(tiny_bundle, engine=engine, threads=1)
    d = gen.decoder
    ids = gen.tokenizer.encode_chat(PROMPTS[0])
    cache = d.new_cache(capacity=len(ids) + 16)
    d.prefill(ids, cache)
    fed = [17, 42, 99, 123, 7]
    d.forward(np.array([fed]), cache, last_only=False)  # verify 5 tokens, keep 2
    rollback(d, cache, len(ids) + 2)
    fresh = d.new_cache(capacity=len(ids) + 16)
    d.prefill(ids + fed[:2], fresh)
    n = len(ids) + 2
    assert cache.length == fresh.length == n

    def kv(c):
        return [(a if c.arrays is not None else v.numpy())[:, :, :n] for a, v in
                zip(c.arrays or [None] * len(c.values), c.values)]

    for a, b in zip(kv(cache), kv(fresh)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    step = np.array([[55]])  # and the next step reads only what was kept
    np.testing.assert_allclose(d.forward(step, cache), d.forward(step, fresh), atol=1e-4, rtol=0)


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, draws: int) -> tuple[float, float]:
    """Pearson's statistic over bins expecting >= 5 draws (the rest pooled), and its 0.1% critical value
    (Wilson-Hilferty approximation; no scipy on the device)."""
    exp = probs * draws
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # one-sided 99.9%
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_accept_sampled_matches_target(fused_generator):
    """Point-mass drafts (prompt lookup) and a draft model's q: the first emitted token follows p exactly."""
    gen = fused_generator
    ids = gen.tokenizer.encode_chat(PROMPTS[0])
    cache = gen.decoder.new_cache(capacity=len(ids) + 4)
    logits = gen.decoder.prefill(ids, cache)[0]
    cfg = SamplingConfig(temperature=1.0, top_k=20, seed=0)
    p0 = target_probs(logits, cfg)
    p = np.stack([p0, np.roll(p0, 3)])
    rng = np.random.default_rng(1234)
    q = (0.5 * rng.dirichlet(np.full(p0.size, 0.3)) + 0.5 * np.roll(p0, 1))[None]  # overlaps p, not equal
    likely = int(np.argmax(p0))
    draws = 20000
    for name, draw in (("lookup, likely", lambda: ([likely], None)),
                       ("lookup, 4th", lambda: ([int(np.argsort(p0)[-4])], None)),
                       ("draft model", lambda: ([int(rng.choice(p0.size, p=q[0]))], q))):  # x ~ q, as the theorem needs
        counts = np.bincount([accept_sampled(p, d, rng, qq)[0] for d, qq in (draw() for _ in range(draws))],
                             minlength=p0.size)
        stat, crit = chi_square_ok(counts, p0, draws)
        assert stat < crit, f"{name}: chi-square {stat:.1f} >= {crit:.1f}"
    # and the test can fail: a sampler that always keeps the draft is far off
    counts = np.bincount([likely] * 20000, minlength=p0.size)
    assert chi_square_ok(counts, p0, 20000)[0] > chi_square_ok(counts, p0, 20000)[1]


@pytest.mark.parametrize("engine", ["int8-dynamic", "int4-weight"])
def test_scheduler_speculative_step_same_answer(tiny_bundle, engine):
    """Generator.stream with the scheduler's speculative step (one greedy row): same tokens, text and finish
    reason as without it, EOS and max_new_tokens included, and the drafts were really checked."""
    gen = Generator.from_bundle(tiny_bundle, engine=engine, threads=1)
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    for cfg in (SamplingConfig(max_new_tokens=80), SamplingConfig(max_new_tokens=33, ignore_eos=True),
                SamplingConfig(max_new_tokens=40, repetition_penalty=1.2)):
        gen.speculative = False
        plain_events = list(gen.stream(ids, cfg))
        gen.speculative = True
        spec_events = list(gen.stream(ids, cfg))
        assert spec_events[-1].token_ids == plain_events[-1].token_ids
        assert "".join(e.text for e in spec_events) == "".join(e.text for e in plain_events)
        assert spec_events[-1].finish_reason == plain_events[-1].finish_reason
    assert gen.speculator.stats.calls > 0 and gen.speculator.stats.drafted > 0


def test_scheduler_speculation_stays_off_for_a_seeded_answer(fused_generator):
    """A seeded answer (sampled or greedy) must be the same whether or not the pacer (timing this machine)
    drafts: never drafted. The same answer without a seed is."""
    gen = fused_generator
    gen.speculative = True
    try:
        ids = gen.tokenizer.encode_chat(PROMPTS[1])
        for cfg in (SamplingConfig(max_new_tokens=30, temperature=0.8, seed=1), SamplingConfig(max_new_tokens=30, seed=1)):
            list(gen.stream(ids, cfg))
            assert gen.speculator.stats.calls == 0
        list(gen.stream(ids, SamplingConfig(max_new_tokens=30, ignore_eos=True)))
        assert gen.speculator.stats.calls > 0
    finally:
        gen.speculative = False


def test_scheduler_speculative_sampling_matches_the_target(fused_generator, monkeypatch):
    """An unseeded sampled answer through the scheduler's speculative step (edge-chat's path): its second token, decided by accept/reject of a fixed draft token, follows the exact
    marginal sum_t1 p(t1) p(t2 | t1) (chi-square over many answers; the generators are seeded here only so the
    test is repeatable)."""
    from edge.decode import sampling

    gen = fused_generator
    d = gen.decoder
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=2, ignore_eos=True)
    p1 = target_probs(d.prefill(ids, d.new_cache(capacity=len(ids) + 4))[0], cfg)
    marginal = np.zeros_like(p1)
    for t1 in np.flatnonzero(p1):
        marginal += p1[t1] * target_probs(d.prefill(ids + [int(t1)], d.new_cache(capacity=len(ids) + 4))[0], cfg)
    common = int(np.argmax(marginal))
    seeds = iter(range(10**6))
    init = sampling.Sampler.__init__

    def seeded(self, c):
        init(self, c)
        self.rng = np.random.default_rng(next(seeds))

    monkeypatch.setattr(sampling.Sampler, "__init__", seeded)
    gen.drafter, gen.speculative = (lambda seq, k: [common]), True
    try:
        seconds, calls = [], 0
        for _ in range(1500):
            seconds.append(list(gen.stream(ids, cfg))[-1].token_ids[1])
            calls += gen.speculator.stats.calls
    finally:
        gen.drafter, gen.speculative = None, False
    assert calls == 1500  # every second token was a checked draft
    counts = np.bincount(seconds, minlength=p1.size)
    assert 0 < counts[common] < 1500  # kept and replaced both happened
    stat, crit = chi_square_ok(counts, marginal, 1500)
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f}"


def test_cli_speculative_flag_same_answer(tiny_bundle):
    from conftest import run_cli

    args = ["edge.cli", "run", str(tiny_bundle.root), "Hello! How are you doing today? Hello! How are you",
            "--engine", "int8-dynamic", "--max-new-tokens", "40", "--threads", "1"]
    plain, fast = run_cli(*args), run_cli(*args, "--speculative")
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout


def test_served_single_user_speculates_and_answers_the_same(fused_generator):
    """A started scheduler (the server's) with the speculator: one user's greedy answer is the plain one."""
    from edge.decode.scheduler import Scheduler
    from edge.decode.speculative import RowSpeculator

    gen = fused_generator
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(max_new_tokens=50, ignore_eos=True)
    want = plain(gen, ids, cfg)
    sched = Scheduler(gen, max_batch=4).start()
    sched.speculator = spec = RowSpeculator()
    try:
        assert sched.submit(ids, cfg).answer(timeout=60)[1].token_ids == want
        assert spec.stats.calls > 0
    finally:
        sched.stop()


# -- a draft model (ModelDrafter, --draft) --------------------------------------------------------------

@pytest.fixture(scope="module")
def drafts(tiny_bundle, long_bundle):
    """Two drafts for the tiny int8 target, both with its tokenizer: its own int4 engine (a fused cache,
    agrees often) and another random model (a plain growing cache, 4k context, agrees rarely)."""
    return {"int4-self": Generator.from_bundle(tiny_bundle, engine="int4-weight", threads=1),
            "other-model": Generator.from_bundle(long_bundle, engine="fp32", threads=1)}


@pytest.mark.parametrize("which", ["int4-self", "other-model"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_draft_model_greedy_identical(fused_generator, drafts, which, k):
    from edge.decode.speculative import ModelDrafter

    gen, draft = fused_generator, drafts[which]
    drafter = ModelDrafter(draft.decoder, gen.decoder.dims.vocab_size)  # one drafter across prompts: its cache follows
    cfg = SamplingConfig(max_new_tokens=40, ignore_eos=True)
    stats = SpecStats()
    for msgs in PROMPTS:
        ids = gen.tokenizer.encode_chat(msgs)
        assert spec(gen, ids, cfg, drafter=drafter, k=k, stats=stats) == plain(gen, ids, cfg), which
    assert stats.drafted > 0  # long accepted runs (its own int4 engine) and rejections (another model) both ran
    assert stats.accepted > 0 if which == "int4-self" else stats.accepted < stats.drafted


@pytest.mark.parametrize("which", ["int4-self", "other-model"])
def test_draft_model_cache_follows_the_sequence(fused_generator, drafts, which):
    """A drafter that rolls its cache back and feeds only what is new drafts what a fresh one drafts from
    scratch, whether the sequence grew, was cut back (rejected drafts) or is another answer altogether."""
    from edge.decode.speculative import ModelDrafter

    d = drafts[which].decoder
    vocab = fused_generator.decoder.dims.vocab_size
    a = fused_generator.tokenizer.encode_chat(PROMPTS[0])
    b = fused_generator.tokenizer.encode_chat(PROMPTS[1])
    kept = ModelDrafter(d, vocab)
    for seq, k in [(a, 4), (a + [17, 42], 3), (a + [17], 5), (a + [17, 99, 5, 6], 8), (b, 2), (a[:3], 6), (b + b, 4)]:
        got = kept(seq, k)
        assert got == ModelDrafter(d, vocab)(seq, k), seq
        assert len(got) == k and all(0 <= t < vocab for t in got)
        assert kept.fed == seq + got[:-1] and kept.cache.length == len(kept.fed)
    assert kept([], 4) == [] and kept(a, 0) == []


def test_draft_model_in_the_scheduler_and_the_cli(tiny_bundle, long_bundle, drafts):
    """Generator.use_draft: the scheduler's speculative step drafts with the model; same answer as without.
    The CLI's --draft gives the same text; a draft with another vocabulary is refused, saying why."""
    from conftest import run_cli
    from edge.errors import EdgeChatError
    from edge.decode.speculative import ModelDrafter, same_vocabulary

    gen = Generator.from_bundle(tiny_bundle, engine="int8-dynamic", threads=1)
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(max_new_tokens=40, ignore_eos=True)
    want = list(gen.stream(ids, cfg))
    gen.use_draft(drafts["int4-self"])
    assert gen.speculative and isinstance(gen.drafter, ModelDrafter)
    got = list(gen.stream(ids, cfg))
    assert got[-1].token_ids == want[-1].token_ids and "".join(e.text for e in got) == "".join(e.text for e in want)
    assert gen.speculator.stats.accepted > 0

    other = Generator.from_bundle(tiny_bundle, engine="int4-weight", threads=1)
    other.tokenizer.tok.add_tokens(["<extra-token>"])
    with pytest.raises(EdgeChatError, match="tokenizer differs.*'<extra-token>' = id"):
        same_vocabulary(gen.tokenizer, other.tokenizer)

    args = ["edge.cli", "-v", "run", str(tiny_bundle.root), "What is the capital of Japan?", "--engine",
            "int8-dynamic", "--max-new-tokens", "30", "--threads", "1", "--temperature", "0"]
    plain_run = run_cli(*args)
    drafted = run_cli(*args, "--draft", str(long_bundle.root))
    assert plain_run.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain_run.stdout and "drafting with" in drafted.stderr
    lone = run_cli(*args, "--draft-engine", "int4-weight")
    assert lone.returncode != 0 and "give --draft too" in lone.stderr
    for bad, says in [(["--draft", str(tiny_bundle.root) + "-nope"], "--draft: bundle folder"),
                      (["--draft", str(tiny_bundle.root), "--draft-engine", "nope"], "--draft-engine: the draft bundle has no engine named 'nope'"),
                      (["--draft", str(tiny_bundle.root), "--draft-engine", "int8-dynamic"], "the target itself"),
                      (["--draft", str(long_bundle.root), "--engine", "fp32"], "cannot verify drafts")]:
        r = run_cli(*args, *bad)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)


def test_a_failing_drafter_turns_itself_off(fused_generator):
    """A draft model that raises (a bad engine, an id it does not have) costs the answer nothing."""
    from edge.decode.scheduler import Scheduler
    from edge.decode.speculative import RowSpeculator

    def broken(seq: list[int], k: int) -> list[int]:
        raise RuntimeError("draft engine failed")

    gen = fused_generator
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(max_new_tokens=30, ignore_eos=True)
    want = plain(gen, ids, cfg)
    sched = Scheduler(gen, max_batch=2).start()
    sched.speculator = spec = RowSpeculator(broken)
    try:
        assert sched.submit(ids, cfg).answer(timeout=60)[1].token_ids == want
        assert sched.submit(ids, cfg).answer(timeout=60)[1].token_ids == want
        assert spec.drafter is not broken and sched.restarts == 0
    finally:
        sched.stop()


def test_pacer_uses_the_faster_mode_and_keeps_measuring():
    """Pacer on a fake clock, default settings: it measures both modes, keeps the faster per emitted
    token, tries the slower ever more rarely while it stays slower, and switches at the first try after
    the slower one got faster; a new answer tries again soon; what is not a lone row's step is not timed."""
    from edge.decode.speculative import Pacer

    now = [0.0]
    pacer = Pacer(clock=lambda: now[0])

    def run(row, n: int, spec_s: float, spec_tokens: int, plain_s: float) -> list[bool]:
        modes = []
        for _ in range(n):
            speculate = pacer.speculate()
            modes.append(speculate)
            pacer.record(row, "spec" if speculate else "plain")
            if speculate:
                pacer.emitted(spec_tokens)
            now[0] += spec_s if speculate else plain_s
        return modes

    answer = object()
    # speculation costs 3 s for 2 tokens against 1 s plain: after measuring, plain; tries after 16, 32, 64 ...
    modes = run(answer, 300, spec_s=3.0, spec_tokens=2, plain_s=1.0)
    tries = [i for i, m in enumerate(modes) if m][2:]  # the first two steps measure speculation
    assert tries[0] <= 20 and [b - a for a, b in zip(tries, tries[1:])] == [32, 64, 128]
    assert pacer.per_token == {"spec": 1.5, "plain": 1.0}
    # speculation gets good (4 tokens per 3 s): its next try measures it, and it takes over for good
    modes = run(answer, 600, spec_s=3.0, spec_tokens=4, plain_s=1.0)
    first = modes.index(True)
    assert first <= 256 and modes[first + 2:].count(False) <= len(modes[first + 2:]) // 16 + 1
    # a new answer, speculation slow again: tried within `explore` steps, not after the old answer's wait
    later = object()
    run(later, 40, spec_s=30.0, spec_tokens=1, plain_s=1.0)
    assert pacer.per_token["spec"] == 30.0  # a try's time replaces the average
    # a step of another row, the scheduler's other work, and a drafter's catch-up are not timed
    before = dict(pacer.per_token)
    pacer.record(object(), "plain")
    now[0] += 100.0
    pacer.record(None)
    now[0] += 100.0
    pacer.record(later, "plain")
    pacer.interrupted()
    now[0] += 100.0
    pacer.record(later, "plain")
    assert pacer.per_token == before
    pacer._trying = True  # a try, so the next sample replaces the average: 1 s once 99 s of catch-up are left out
    pacer.record(later, "spec")
    pacer.discount(99.0)
    now[0] += 100.0
    pacer.record(later, "plain")
    assert pacer.per_token["spec"] == 1.0


@pytest.mark.parametrize("slow", [True, False])
def test_speculation_backs_off_when_drafting_costs_more_than_it_gives(fused_generator, slow):
    """Through the scheduler: a draft that is slow and always wrong ends up mostly plain steps; one that is
    cheap and always right keeps speculating. The answer is the plain one either way. The pacer reads a clock
    that moves one unit per reading (a plain step costs 1, a checked draft about 4 whatever its length) plus
    what the drafter costs: the same decisions on any machine (the wall clock made this test flaky: a
    millisecond hiccup in a tiny model's step flipped the ranking)."""
    from edge.decode.scheduler import Scheduler
    from edge.decode.speculative import Pacer, RowSpeculator

    gen = fused_generator
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(max_new_tokens=120, ignore_eos=True)
    want = plain(gen, ids, cfg)
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    def drafter(seq: list[int], k: int) -> list[int]:
        if slow:
            now[0] += 30.0  # a draft that costs ~30 plain steps
            return [(t + 1) % 300 for t in want[len(seq) - len(ids):][:k]] or [1]
        return want[len(seq) - len(ids):][:k]

    sched = Scheduler(gen, max_batch=1).start()
    sched.speculator = spec = RowSpeculator(drafter, pacer=Pacer(clock=clock))
    try:
        assert sched.submit(ids, cfg).answer(timeout=60)[1].token_ids == want
    finally:
        sched.stop()
    if slow:
        assert spec.plain_steps > 4 * spec.stats.calls, (spec.plain_steps, spec.stats.as_dict())
    else:
        assert spec.plain_steps <= 6 and spec.stats.accepted > 80, (spec.plain_steps, spec.stats.as_dict())


def test_served_with_a_draft_answers_as_without(tiny_bundle, long_bundle, fused_generator):
    """`edge-chat serve --draft`: says it drafts, and a greedy API answer is the plain one, token for token."""
    import httpx

    from conftest import ServerProcess

    gen = fused_generator
    msgs = PROMPTS[1]
    want = gen.tokenizer.decode(plain(gen, gen.tokenizer.encode_chat(msgs), SamplingConfig(max_new_tokens=40)))
    server = ServerProcess(tiny_bundle.root, "--engine", "int8-dynamic", "--draft", str(long_bundle.root), "--no-ui")
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": msgs, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    finally:
        code, out = server.stop()
    assert code == 0 and "draft       tiny-llama-4k fp32 drafts" in out and "Traceback" not in out, out


def test_adaptive_k_shrinks_as_drafting_costs_more():
    pol = AdaptiveK(k_max=8, rate=0.8)
    cheap = pol.k
    pol.smoothing = 1.0
    pol.costs(step_cost=0.1, draft_cost=0.4)  # a draft model's step at 0.4 of the target's
    assert 1 <= pol.k < cheap
    pol.costs(step_cost=0.1, draft_cost=5.0)
    assert pol.k == 1
    pol.costs(step_cost=-1.0, draft_cost=-1.0)  # timing noise below zero: a floor for checking, 0 for drafting
    assert pol.step_cost == AdaptiveK.MIN_STEP_COST and pol.draft_cost == 0 and pol.k == 8
    pol.rate = 0.05  # drafts nobody accepts: the floor keeps k at 1
    assert pol.k == 1


def test_pacer_takes_back_the_longer_wait_of_a_try_it_could_not_time():
    """A try of the slower mode that the scheduler interrupted (a request was admitted) measured nothing:
    the next try comes after the same wait again, not after twice as long."""
    from edge.decode.speculative import Pacer

    def tries(interrupt_second: bool) -> list[int]:
        now, row, out = [0.0], object(), []
        pacer = Pacer(explore=4, clock=lambda: now[0])
        for i in range(60):
            speculate = pacer.speculate()
            pacer.record(row, "spec" if speculate else "plain")
            if speculate:
                pacer.emitted(2)
                if i > 1:  # the first two steps measure speculation
                    out.append(i)
                    if interrupt_second and len(out) == 2:
                        pacer.interrupted()
            now[0] += 3.0 if speculate else 1.0
        return out

    assert tries(False) == [7, 15, 31]
    assert tries(True) == [7, 15, 23, 39]


def test_a_failing_verify_call_fails_only_its_answer(fused_generator, monkeypatch):
    """A speculative step whose verify call raises ends that answer with "error", as a failed plain step does:
    the loop goes on without a restart, and the next answer (drafts checked again) is the plain one."""
    from edge.decode.cache import SharedBatchCache
    from edge.decode.scheduler import Scheduler

    gen = fused_generator
    ids = gen.tokenizer.encode_chat(PROMPTS[1])
    cfg = SamplingConfig(max_new_tokens=20, ignore_eos=True)
    want = plain(gen, ids, cfg)
    real, fails = SharedBatchCache.verify, [RuntimeError("verify call failed")]

    def verify(self, tokens: list[int]) -> np.ndarray:
        if fails:
            raise fails.pop()
        return real(self, tokens)

    monkeypatch.setattr(SharedBatchCache, "verify", verify)
    sched = Scheduler(gen, max_batch=2).start()
    sched.speculator = spec = RowSpeculator.fixed(lambda seq, k: [1] * k, 2)  # drafts at every step
    try:
        failed = sched.submit(ids, cfg).answer(timeout=60)[1]
        assert failed.finish_reason == "error" and "verify call failed" in failed.stats["error"]
        assert sched.submit(ids, cfg).answer(timeout=60)[1].token_ids == want
        assert sched.restarts == 0 and spec.stats.calls > 0
    finally:
        sched.stop()
