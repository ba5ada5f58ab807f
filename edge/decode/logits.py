"""What a request may do to one row of logits before the sampler draws, and the logprobs it may ask for.

Per row, in this order (`RowLogits.process`): logit_bias, OpenAI's frequency/presence penalties (counts
of the tokens this answer generated so far), then the grammar mask (response_format, tools), so a
bias or penalty can never bring back a token the grammar forbids. On a thinking model (`think`,
edge.decode.thinking.ThinkState) the grammar applies to the content after the think block, and a spent
reasoning budget forces the close tag, one token per step, over everything else. Logprobs are read from the
raw logits the step produced (as OpenAI and vLLM report them: the model's distribution, before penalties or the
grammar), so they equal a log-softmax of the engine's own logits for that position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge.decode.grammar import Grammar, Matcher
from edge.decode.thinking import ThinkState


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` most likely tokens at that position (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of one logits row (float64 so a sum over 49k tokens loses nothing)."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprob(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """The chosen token's logprob and the `top` best (highest first, ties by id) from one raw logits row."""
    lp = log_softmax(row)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, lp.size)
        cand = np.argpartition(-lp, k - 1)[:k]
        order = cand[np.lexsort((cand, -lp[cand]))]
        best = tuple((int(i), float(lp[i])) for i in order)
    return TokenLogprob(int(token), float(lp[token]), best)


@dataclass
class RowLogits:
    """One answer's logits processors and logprob wish; the scheduler keeps one per row.

    `process(logits)` returns the row the sampler should draw from; `accept(tok, raw)` records the drawn token
    (advancing the grammar) and returns its TokenLogprob when logprobs were asked for."""

    grammar: Grammar | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: off; 0: the chosen token's only; k: also the k most likely
    stop_ids: frozenset[int] = frozenset()  # tokens that end the answer like EOS (request's stop_token_ids)
    counts: dict[int, int] = field(default_factory=dict)
    matcher: Matcher | None = None
    think: ThinkState | None = None  # the think block (reasoning budget; the grammar waits until it closes)

    def __post_init__(self) -> None:
        if self.grammar is not None and self.matcher is None:
            self.matcher = self.grammar.matcher()

    @property
    def active(self) -> bool:
        """Whether `process` changes anything (the sampler's fast path skips it otherwise)."""
        return bool(self.matcher is not None or self.logit_bias or self.frequency_penalty or self.presence_penalty
                    or self.think is not None)

    def process(self, logits: np.ndarray) -> np.ndarray:
        if not self.active:
            return logits
        if not (self.matcher is not None or self.logit_bias or self.frequency_penalty or self.presence_penalty):
            return self._forced(logits)  # a reasoning budget alone: the row as it is until the close is forced
        x = np.array(logits, dtype=np.float32)  # a copy: the raw row stays for logprobs
        if self.logit_bias:
            ids = np.fromiter(self.logit_bias.keys(), dtype=np.int64, count=len(self.logit_bias))
            keep = ids < x.size
            x[ids[keep]] += np.fromiter(self.logit_bias.values(), dtype=np.float32, count=len(ids))[keep]
        if self.counts and (self.frequency_penalty or self.presence_penalty):
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            n = np.fromiter(self.counts.values(), dtype=np.float32, count=len(ids))
            x[ids] -= n * np.float32(self.frequency_penalty) + np.float32(self.presence_penalty)
        think = self.think
        if self.matcher is not None and (think is None or think.phase != "think"):
            masked = self.matcher.mask(x)
            opener = think.may_open if think is not None else None
            if opener is not None and opener < x.size:  # the answer may still open its think block
                masked[opener] = x[opener]
            x = masked
        return self._forced(x)

    def _forced(self, x: np.ndarray) -> np.ndarray:
        """`x`, or, when the reasoning budget is spent, a row where only the forced token is possible."""
        forced = self.think.forced_token() if self.think is not None else None
        if forced is None:
            return x
        only = np.full(x.shape, -np.inf, dtype=np.float32)
        only[forced] = 0.0
        return only

    def accept(self, tok: int, raw: np.ndarray) -> TokenLogprob | None:
        self.counts[tok] = self.counts.get(tok, 0) + 1
        content = self.think.accept(tok) if self.think is not None else True
        if self.matcher is not None and content:
            self.matcher.advance(tok)
        if self.logprobs is None:
            return None
        return token_logprob(raw, tok, self.logprobs)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing may follow (the answer ends as if at EOS)."""
        return self.matcher is not None and self.matcher.done
