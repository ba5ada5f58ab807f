"""Speculative decoding: guess k tokens cheaply, let the target check them all in one call.

At batch 1 a decode step is bound by reading the weights, not by arithmetic, so the target scoring
k + 1 positions in one call costs little more than scoring one. A drafter proposes k tokens; the target
runs [pending] + draft and returns logits at every position; we keep the longest prefix of the draft the
target agrees with, plus one token of the target's own (the correction, or a bonus when all k agree).
The rejected tokens' K/V is rolled back (for the fused in-place cache that is just the cache length).

Greedy: a drafted token is kept only if it is what the target would have picked there, so the output is
the target's greedy output (computed in wider calls: the test suite checks it is token for token the same).
Sampled: speculative sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft token x with
probability min(1, p(x) / q(x)), on rejection draw from max(p - q, 0) renormalised, so every emitted
token is distributed exactly as the target's p. A prompt-lookup draft is a point mass (q(x) = 1).

Draft-free drafter: prompt lookup (n-gram): the last n tokens seen before, earlier in the prompt or the
answer, are followed by what followed them then. It costs no model and helps when answers quote their
input (summaries, code edits, extraction); on free prose it rarely drafts and then costs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

from edge.errors import EdgeChatError
from edge.decode.sampling import SamplingConfig

log = logging.getLogger("edgechat")


class Drafter(Protocol):
    def __call__(self, seq: list[int], k: int) -> list[int]:
        """Up to k guesses for the tokens after `seq` (may be fewer, or none)."""
        ...


def lookup_draft(seq: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of seq's last n tokens
    (longest n first). Numpy, so a long prompt costs a few vectorised compares, not a Python scan."""
    a = np.asarray(seq, dtype=np.int64)
    for n in range(max_ngram, min_ngram - 1, -1):
        if k < 1 or len(a) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(a[:-1], n)  # every n-gram except the tail itself
        hits = np.flatnonzero((windows == a[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start:start + k].tolist()
    return []


def _no_draft(seq: list[int], k: int) -> list[int]:
    return []


class ModelDrafter:
    """A smaller model with the target's tokenizer drafts greedily (llama.cpp's draft model; `--draft`).

    It keeps its own KV cache of the tokens it has fed. Each call rolls that cache back to what the new
    sequence shares with it (the target rejected the rest, or another answer began) and feeds only the new
    tokens, so a draft of k costs a short catch-up plus k - 1 single-token steps of the small model. Greedy
    drafts make the draft distribution a point mass, which speculative sampling accepts as it accepts
    prompt lookup's. Called from one thread (the scheduler's), like the target."""

    def __init__(self, decoder, target_vocab: int) -> None:
        self.decoder = decoder
        self.vocab = min(target_vocab, decoder.dims.vocab_size)  # ids the target has (padded heads differ)
        self.cache = None
        self.fed: list[int] = []  # the tokens in self.cache, in order
        self.last_prefill_s = 0.0  # the latest call's catch-up (RowSpeculator leaves it out of its timing)

    def __call__(self, seq: list[int], k: int) -> list[int]:
        k = min(k, self.decoder.dims.max_context - len(seq))
        if k < 1 or not seq:
            return []
        # how much of the cache the new sequence shares; at least its last token is fed again
        n = min(len(self.fed), len(seq) - 1)
        differ = np.flatnonzero(np.asarray(self.fed[:n]) != np.asarray(seq[:n]))
        keep = int(differ[0]) if differ.size else n
        if self.cache is None:
            self.cache = self.decoder.new_cache(capacity=len(seq) + k)
        rollback(self.decoder, self.cache, keep)
        self.fed = self.fed[:keep]  # true even if a call below fails: the next call starts from here
        t = time.perf_counter()
        logits = self.decoder.prefill(seq[keep:], self.cache)
        self.last_prefill_s = time.perf_counter() - t
        self.fed = list(seq)
        draft: list[int] = []
        while True:
            draft.append(int(np.argmax(logits[0, :self.vocab])))
            if len(draft) == k:
                return draft
            logits = self.decoder.forward(np.array([[draft[-1]]]), self.cache)
            self.fed.append(draft[-1])


def same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """A draft must spell every id as the target does; raises EdgeChatError naming the first difference."""
    a = target_tokenizer.tok.get_vocab(with_added_tokens=True)
    b = draft_tokenizer.tok.get_vocab(with_added_tokens=True)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:1]
        raise EdgeChatError(
            f"the draft bundle's tokenizer differs from the target's ({len(b)} tokens against {len(a)}; "
            f"first difference: {diff[0][0]!r} = id {diff[0][1]}): a draft must share the target's "
            "tokenizer (e.g. a smaller model of the same family, or one built from the target)")


class AdaptiveK:
    """Pick k from the running acceptance rate and what drafting and checking cost.

    With per-token acceptance rate a, a draft of k yields (1 - a^(k+1)) / (1 - a) tokens per verify call.
    The call of k + 1 tokens costs about 1 + step_cost * k single steps (weights are read once; the extra
    positions cost compute), and drafting k tokens draft_cost * k more (0 for prompt lookup; a draft
    model's step over the target's, measured by RowSpeculator). k maximises tokens per cost, so it grows
    while drafts are accepted and cheap, and falls to 1 when they are not."""

    def __init__(self, k_max: int = 8, k_min: int = 1, step_cost: float = 0.1, rate: float = 0.5,
                 smoothing: float = 0.3, draft_cost: float = 0.0) -> None:
        self.k_max, self.k_min, self.step_cost, self.rate, self.smoothing = k_max, k_min, step_cost, rate, smoothing
        self.draft_cost = draft_cost

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rate += self.smoothing * (accepted / drafted - self.rate)

    MIN_STEP_COST = 0.05  # a verified position is never free: without a floor k would go to k_max at any rate

    def costs(self, step_cost: float, draft_cost: float) -> None:
        """Measured costs of one more verified position and of one drafted token, in plain steps. (A plain
        step's time includes the scheduler's own work per token, so the measured step cost runs low.)"""
        self.step_cost += self.smoothing * (max(step_cost, self.MIN_STEP_COST) - self.step_cost)
        self.draft_cost += self.smoothing * (max(draft_cost, 0.0) - self.draft_cost)

    @property
    def k(self) -> int:
        a = min(self.rate, 0.999)
        per_k = self.step_cost + self.draft_cost
        gain = [(1 - a ** (k + 1)) / (1 - a) / (1 + per_k * k) for k in range(self.k_min, self.k_max + 1)]
        return self.k_min + int(np.argmax(gain))


def target_probs(logits: np.ndarray, cfg: SamplingConfig, seen: np.ndarray | None = None) -> np.ndarray:
    """The distribution `edge.decode.sampling.Sampler` draws from, as a dense vector (temperature, top-k, top-p,
    repetition penalty), for accept/reject. Ties at the top-p cut are ordered by id, as the Sampler does."""
    x = np.asarray(logits, dtype=np.float32).copy()
    if cfg.repetition_penalty != 1.0 and seen is not None and len(seen):
        idx = np.unique(seen)
        v = x[idx]
        x[idx] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
    p = np.exp((x - x.max()) * np.float32(1.0 / cfg.temperature)).astype(np.float64)
    if (0 < cfg.top_k < p.size) or cfg.top_p < 1.0:
        order = np.lexsort((np.arange(p.size), -x))  # highest first, ties by id
        keep = order[:cfg.top_k] if 0 < cfg.top_k < p.size else order
        if cfg.top_p < 1.0:
            cum = np.cumsum(p[keep])
            keep = keep[: int(np.searchsorted(cum, cfg.top_p * cum[-1])) + 1]
        mask = np.zeros(p.size, bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
    return p / p.sum()


def accept_sampled(p: np.ndarray, draft: list[int], rng: np.random.Generator,
                   q: np.ndarray | None = None) -> list[int]:
    """Speculative sampling. p: [len(draft) + 1, vocab] target distributions at each drafted position and
    one past; q: the drafter's distributions [len(draft), vocab], None for a point-mass draft. Returns the
    accepted draft tokens plus one token drawn from the target (residual on rejection, p at the end)."""
    out: list[int] = []
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else float(q[i, x])
        if rng.random() * qx < p[i, x]:  # accept with probability min(1, p/q)
            out.append(x)
            continue
        resid = p[i].copy()
        if q is None:
            resid[x] = 0.0
        else:
            resid = np.maximum(resid - q[i], 0.0)
        out.append(int(rng.choice(resid.size, p=resid / resid.sum())))
        return out
    out.append(int(rng.choice(p.shape[1], p=p[len(draft)])))
    return out


def rollback(decoder, cache, length: int) -> None:
    """Forget the cache past `length` tokens. The fused in-place buffers are only read up to the cache length,
    so the stale columns are overwritten by the next call; a plain graph's past tensors are cut."""
    if length >= cache.length:
        return
    if not decoder.io.fused:
        cache.values = [decoder.to_device(v.numpy()[:, :, :length]) for v in cache.values]
    cache.length = length


@dataclass
class SpecStats:
    calls: int = 0  # target calls after the prefill
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"target_calls": self.calls, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance}


def speculative_tokens(decoder, prompt_ids: list[int], cfg: SamplingConfig, eos_ids: set[int] | list[int],
                       max_context: int, drafter: Drafter = lookup_draft, policy: AdaptiveK | None = None,
                       stats: SpecStats | None = None, cancel: threading.Event | None = None) -> Iterator[int]:
    """Token ids after the prompt, as `Generator.tokens` yields them (same stop rules: EOS not yielded,
    max_new_tokens, end of context), each target call checking a draft."""
    from edge.decode.sampling import Sampler

    policy = policy or AdaptiveK()
    stats = stats if stats is not None else SpecStats()
    sampler = Sampler(cfg)  # greedy picks (with repetition penalty) exactly as the plain loop does
    rng = np.random.default_rng(cfg.seed)
    eos = set(eos_ids)
    budget = min(cfg.max_new_tokens, max_context - len(prompt_ids))  # the plain loop's limits
    cache = decoder.new_cache(capacity=len(prompt_ids) + cfg.max_new_tokens + policy.k_max + 1)
    seq = list(prompt_ids)
    logits = decoder.prefill(prompt_ids, cache)[0]
    pending = pick(sampler, cfg, logits[None], [], seq, rng)[0]
    emitted = 0
    while True:
        if pending in eos and not cfg.ignore_eos:
            return
        yield pending
        seq.append(pending)
        emitted += 1
        if emitted >= budget or (cancel is not None and cancel.is_set()):
            return
        k = min(policy.k, budget - emitted, max_context - cache.length - 1)
        draft = drafter(seq, k)[:k] if k > 0 else []
        base = cache.length
        out = decoder.forward(np.array([[pending] + draft]), cache, last_only=not draft)
        stats.calls += 1
        rows = out[0] if draft else out
        new = pick(sampler, cfg, rows, draft, seq, rng)
        if draft:
            policy.update(len(draft), len(new) - 1)
            stats.drafted += len(draft)
            stats.accepted += len(new) - 1
            rollback(decoder, cache, base + len(new))  # pending + the accepted drafts
        for tok in new[:-1]:  # accepted drafts: emitted like any token (EOS and limits checked)
            if tok in eos and not cfg.ignore_eos:
                return
            yield tok
            seq.append(tok)
            emitted += 1
            if emitted >= budget or (cancel is not None and cancel.is_set()):
                return
        pending = new[-1]


def pick(sampler, cfg: SamplingConfig, rows: np.ndarray, draft: list[int], seq: list[int],
         rng: np.random.Generator) -> list[int]:
    """Check a draft against the target's logits rows ([len(draft) + 1, vocab]): the kept drafts + one token."""
    penal = cfg.repetition_penalty != 1.0
    if cfg.greedy:
        out: list[int] = []
        for i in range(len(draft) + 1):
            seen = np.asarray(seq + out) if penal else None
            t = sampler(rows[i], seen)
            out.append(t)
            if i == len(draft) or t != draft[i]:
                return out
        return out
    p = np.stack([target_probs(rows[i], cfg, np.asarray(seq + draft[:i]) if penal else None)
                  for i in range(len(draft) + 1)])
    return accept_sampled(p, draft, rng)


@dataclass
class _Timing:
    """One step of a lone row being timed by the Pacer."""
    row: object
    mode: str  # "spec" | "plain"
    start: float
    tokens: int = 1  # what the step emitted (a speculative step: the accepted drafts + one)
    trying: bool = False  # a try of the slower mode: its time replaces that mode's average


class Pacer:
    """Speculate only while it pays, measured: the seconds per emitted token of speculative steps (draft +
    verify) and of plain steps, each a running average of the time from one step of the same row to the
    next (a step in which the scheduler did other work is not timed). The faster mode is used, and the
    other is tried after `explore` steps, then after twice as many each time it is still slower (up to
    `max_interval`; a new answer starts again at `explore`); a try's time replaces that mode's average.
    So a draft that does not pay (a slow draft model, prose that prompt lookup cannot guess) costs a few
    tries per answer, not 2x, and one that starts paying takes over at its next try."""

    def __init__(self, explore: int = 16, max_interval: int = 256, smoothing: float = 0.2,
                 clock=time.perf_counter) -> None:
        self.explore, self.max_interval, self.smoothing, self.clock = explore, max_interval, smoothing, clock
        self.per_token: dict[str, float | None] = {"spec": None, "plain": None}
        self._last: _Timing | None = None  # the step being timed
        self._row = None  # the row of the latest timed step (a new one resets the wait between tries)
        self._faster: bool | None = None
        self._trying = False
        self._interval, self._since = explore, 0

    def record(self, row, mode: str | None = None) -> None:
        """Call as each step begins: closes the previous step's timing if it was the same row's (an answer
        that ended, or a step with other rows, is not timed), then starts this one's (mode None: none)."""
        now = self.clock()
        last = self._last
        if last is not None and last.row is row:
            sec, old = (now - last.start) / last.tokens, self.per_token[last.mode]
            self.per_token[last.mode] = sec if old is None or last.trying else old + self.smoothing * (sec - old)
        elif row is None or mode is None:
            self._discard()
        if mode and row is not self._row:
            self._row, self._interval, self._since = row, self.explore, 0
        self._last = _Timing(row, mode, now, trying=self._trying) if mode else None
        self._trying = False

    def interrupted(self) -> None:
        """The scheduler did other work (admitted a request, ran a call): the open step is not timed."""
        self._discard()
        self._last = None

    def _discard(self) -> None:
        """The open step goes untimed; if it was a try, its doubling of the wait is taken back."""
        if self._last is not None and self._last.trying:
            self._interval = max(self.explore, self._interval // 2)

    def emitted(self, tokens: int) -> None:
        """How many tokens the step being timed gave (a speculative step: the accepted drafts + one)."""
        if self._last is not None:
            self._last.tokens = tokens

    def discount(self, seconds: float) -> None:
        """Leave `seconds` of the open step out of its time (a draft model catching up after plain steps:
        the cost of switching modes, paid once per try, not per speculative step)."""
        if self._last is not None:
            self._last.start += seconds

    def speculate(self) -> bool:
        spec, plain = self.per_token["spec"], self.per_token["plain"]
        if spec is None or plain is None:  # measure both first: speculate, then one plain step
            return spec is None
        faster = spec <= plain
        if faster != self._faster:  # the ranking changed: look at the other mode again soon
            self._faster, self._interval, self._since = faster, self.explore, 0
        self._since += 1
        if self._since < self._interval:
            return faster
        # one step of the slower mode; each try that leaves the ranking as it was doubles the wait for the next
        self._since, self._interval, self._trying = 0, min(2 * self._interval, self.max_interval), True
        return not faster


class RowSpeculator:
    """The scheduler's speculative step (edge.decode.scheduler): while exactly one greedy row is decoding on a fused
    cache and nothing is being prefilled, draft (prompt lookup, or a draft model: ModelDrafter) and let one
    target call check the draft, when speculating has been measured to pay (Pacer).
    Each checked token goes through the scheduler's own `_accept` (EOS, stop strings, limits, events), so an
    answer ends exactly as a plain step would end it. With a second user, a long prompt waiting, or logits
    processors (grammar, logprobs) it steps no differently from the plain loop. Sampled rows speculate too
    (speculative sampling, see `step`). A row with a seed never does: a verify call's logits differ in the
    last bits from a single step's on quantized engines, and a seeded answer must not depend on whether the
    pacer, timing this machine, chose to draft."""

    def __init__(self, drafter: Drafter = lookup_draft, policy: AdaptiveK | None = None,
                 pacer: Pacer | None = None) -> None:
        self.drafter = drafter
        self.policy = policy or AdaptiveK()
        self.pacer = pacer or Pacer()
        self.stats = SpecStats()
        self.plain_steps = 0  # lone-row steps the pacer left plain
        self._drafted_for = None  # the row whose previous step was speculative (its draft model is in step)

    def interrupted(self) -> None:
        """The scheduler did other work between steps (edge.decode.scheduler)."""
        self.pacer.interrupted()

    def step(self, sched) -> bool:
        """One speculative step of the scheduler's single row; False (nothing done) when it does not apply."""
        row = sched.rows[0] if len(sched.rows) == 1 else None
        if row is None or sched.prefilling is not None or not hasattr(sched.cache, "verify") \
                or row.logits is not None or row.req.cfg.seed is not None:
            self.pacer.record(None)
            self._drafted_for = None  # a draft model falls behind while others share the steps
            return False
        if not self.pacer.speculate():
            self.pacer.record(row, "plain")
            self.plain_steps += 1
            self._drafted_for = None
            return False
        cfg = row.req.cfg
        base = sched.cache.lengths[0]
        k = min(self.policy.k, cfg.max_new_tokens - row.n, sched.gen.max_context - base - 2)
        clock = self.pacer.clock
        self.pacer.record(row, "spec")
        t0 = clock()
        try:
            draft = self.drafter(row.seen, k)[:k] if k > 0 else []
        except Exception:  # a failing draft model must not fail the answer: decode on without it
            log.exception("the drafter failed; speculative decoding is off for this process")
            self.drafter = _no_draft
            self.pacer.record(None)
            return False
        catch_up = 0.0
        if self._drafted_for is not row:  # a draft model fed what plain steps (or the prompt) added since
            catch_up = getattr(self.drafter, "last_prefill_s", 0.0)
            self.pacer.discount(catch_up)
        self._drafted_for = row
        if not draft:  # nothing to check: a plain step (timed as speculation's cost: drafting found nothing)
            return False
        t1 = clock()
        logits = sched.cache.verify([row.last] + draft)
        plain = self.pacer.per_token["plain"]
        if plain:  # what one more checked position and one drafted token cost, in plain steps: k follows them
            n = len(draft)
            self.policy.costs(((clock() - t1) / plain - 1) / n, (t1 - t0 - catch_up) / plain / n)
        self.stats.calls += 1
        # The row's own sampler picks each position's token and a draft token is kept when it is the pick: for a
        # point-mass draft this is speculative sampling (x kept with probability p(x); otherwise the pick is
        # distributed as p without x), so sampled tokens follow exactly the sampler's distribution.
        for i in range(len(draft) + 1):
            if not sched._accept(row, logits[i], base + i + 1):  # the answer ended at this token
                sched.cache.rollback(base + i + 1)
                sched._leave([0])
                break
            if i == len(draft) or row.last != draft[i]:  # the target's own token: a correction or the bonus
                sched.cache.rollback(base + i + 1)
                break
        self.pacer.emitted(i + 1)
        self.policy.update(len(draft), i)
        self.stats.drafted += len(draft)
        self.stats.accepted += i
        return True
