"""Speculative decoding: guess k tokens cheaply, let the target check them all in one call.

At batch 1 a decode step is bound by reading the weights, not by arithmetic, so the target scoring
k + 1 positions in one call costs little more than scoring one. A drafter proposes k tokens; the scheduler
(edge.decode.scheduler, the one decode loop) runs [pending] + draft in one call, keeps the longest prefix of the
draft the target agrees with, plus one token of the target's own (the correction, or a bonus when all k agree),
and rolls the rejected tokens' K/V back (for the fused in-place cache that is just the row's length). This
module only proposes: what to draft (`lookup_draft`, `ModelDrafter`), how many (`AdaptiveK`) and whether
drafting pays right now (`Pacer`), put together in `RowSpeculator`, the scheduler's proposer.

Greedy: a drafted token is kept only if it is what the target would have picked there, so the output is
the target's greedy output (computed in wider calls: the test suite checks it is token for token the same).
Sampled: speculative sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft token x with
probability min(1, p(x) / q(x)), on rejection draw from max(p - q, 0) renormalised, so every emitted
token is distributed exactly as the target's p (`accept_sampled`). Our drafts are point masses (q(x) = 1:
prompt lookup, a greedy draft model), for which keeping x when the row's own sampler picks it is that rule.

Draft-free drafter: prompt lookup (n-gram): the last n tokens seen before, earlier in the prompt or the
answer, are followed by what followed them then. It costs no model and helps when answers quote their
input (summaries, code edits, extraction); on free prose it rarely drafts and then costs nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge.errors import EdgeChatError
from edge.decode.sampling import SamplingConfig

log = logging.getLogger("edgechat")


class Drafter(Protocol):
    def __call__(self, seq: list[int], k: int) -> list[int]:
        """Up to k guesses for the tokens after `seq` (may be fewer, or none)."""
        ...


class DraftRow(Protocol):
    """What a proposer reads of the row it drafts for (the scheduler's row): the tokens so far, prompt included."""

    seen: list[int]


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
    """Forget a decoder cache past `length` tokens (a draft model's own cache, ModelDrafter). The fused in-place buffers are only read up to the cache length,
    so the stale columns are overwritten by the next call; a plain graph's past tensors are cut."""
    if length >= cache.length:
        return
    if not decoder.io.fused:
        cache.values = [decoder.to_device(v.numpy()[:, :, :length]) for v in cache.values]
    cache.length = length


@dataclass
class SpecStats:
    calls: int = 0  # target calls that checked a draft
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"target_calls": self.calls, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance}


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
                 clock=time.perf_counter, always: bool = False) -> None:
        self.explore, self.max_interval, self.smoothing, self.clock = explore, max_interval, smoothing, clock
        self.always = always  # speculate at every step it may, timed or not (a measurement of the draft itself)
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
        if self.always:
            return True
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
    """The scheduler's proposer (edge.decode.scheduler.Proposer): while exactly one row without a seed or logits
    processors decodes on a cache that verifies drafts, and nothing is being prefilled (the scheduler decides
    that, `Scheduler._draftable`), draft k tokens (prompt lookup, or a draft model: ModelDrafter) when speculating
    has been measured to pay (Pacer); the scheduler checks them and reports back (`checked`). With a second
    user, a long prompt waiting, or logits processors (grammar, logprobs) it proposes nothing. `fixed` drafts
    k tokens at every step, for a measurement of the draft (the build's acceptance, the benchmark)."""

    def __init__(self, drafter: Drafter = lookup_draft, policy: AdaptiveK | None = None,
                 pacer: Pacer | None = None) -> None:
        self.drafter = drafter
        self.policy = policy or AdaptiveK()
        self.pacer = pacer or Pacer()
        self.stats = SpecStats()
        self.plain_steps = 0  # lone-row steps the pacer left plain
        self._drafted_for = None  # the row whose previous step was speculative (its draft model is in step)
        self._drafting = (0.0, 0.0, 0.0)  # the open proposal: (drafting began, ended, the draft model's catch-up)

    @classmethod
    def fixed(cls, drafter: Drafter, k: int) -> "RowSpeculator":
        """Draft exactly k tokens (fewer only at the answer's or the context's end) at every step that may
        speculate, paying or not: what a measurement of the draft itself needs."""
        return cls(drafter, AdaptiveK(k_max=k, k_min=k), Pacer(always=True))

    def interrupted(self) -> None:
        """The scheduler did other work between steps (edge.decode.scheduler)."""
        self.pacer.interrupted()

    def propose(self, row: DraftRow | None, room: int) -> list[int]:
        """Draft tokens to follow `row.seen` (at most `room`), or [] for a plain step; `row` None: this step
        cannot speculate (it is not timed, and a draft model falls behind while others share the steps)."""
        if row is None:
            self.pacer.record(None)
            self._drafted_for = None
            return []
        if not self.pacer.speculate():
            self.pacer.record(row, "plain")
            self.plain_steps += 1
            self._drafted_for = None
            return []
        k = min(self.policy.k, room)
        clock = self.pacer.clock
        self.pacer.record(row, "spec")
        t0 = clock()
        try:
            draft = self.drafter(row.seen, k)[:k] if k > 0 else []
        except Exception:  # a failing draft model must not fail the answer: decode on without it
            log.exception("the drafter failed; speculative decoding is off for this process")
            self.drafter = _no_draft
            self.pacer.record(None)
            return []
        catch_up = 0.0
        if self._drafted_for is not row:  # a draft model fed what plain steps (or the prompt) added since
            catch_up = getattr(self.drafter, "last_prefill_s", 0.0)
            self.pacer.discount(catch_up)
        self._drafted_for = row
        if draft:  # else a plain step, timed as speculation's cost (drafting found nothing)
            self._drafting = (t0, clock(), catch_up)
        return draft

    def checked(self, drafted: int, accepted: int) -> None:
        """The scheduler checked the draft just proposed and kept `accepted` of its `drafted` tokens: k and the
        pacer learn from it (what one more checked position and one drafted token cost, in plain steps)."""
        t0, t1, catch_up = self._drafting
        plain = self.pacer.per_token["plain"]
        if plain and drafted:
            self.policy.costs(((self.pacer.clock() - t1) / plain - 1) / drafted, (t1 - t0 - catch_up) / plain / drafted)
        self.stats.calls += 1
        self.pacer.emitted(accepted + 1)
        self.policy.update(drafted, accepted)
        self.stats.drafted += drafted
        self.stats.accepted += accepted
