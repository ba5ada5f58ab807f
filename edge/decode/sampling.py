"""Next-token choice from logits: greedy, temperature, top-k, top-p, repetition penalty.

Plain numpy on one row of logits; a seeded `numpy.random.Generator` makes
sampling reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from edge.errors import EdgeChatError


MAX_SEED = 2**63 - 1  # OpenAI's seed is an int64; numpy's generator takes any non-negative integer
# Below this temperature sampling is greedy: 1/T in float32 overflows to inf at T < ~2.9e-39 (and inf x 0 is
# NaN, which always drew the last token id), and well before that, at T = 1e-5, a logit 0.001 below the top one
# is already e^-100 times as likely, i.e. never drawn. So such a temperature is greedy, by rule.
MIN_TEMPERATURE = 1e-5
# repetition_penalty divides (or multiplies) a seen token's logit: below this, logits overflow float32 to inf
# (1e-38 made EOS, seen in the prompt, always win: an empty answer). 0.01 already makes a seen token 100x as
# strong, more than any use asks.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks), as llama.cpp/vLLM's ignore_eos

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise EdgeChatError(f"{name} must be a finite number, got {v!r}")
        for name in ("max_new_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise EdgeChatError(f"{name} must be an integer, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise EdgeChatError(f"seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}")
        if self.max_new_tokens < 1:
            raise EdgeChatError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise EdgeChatError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EdgeChatError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EdgeChatError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise EdgeChatError(f"repetition_penalty must be >= {MIN_REPETITION_PENALTY} (1: off), got "
                                f"{self.repetition_penalty}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise EdgeChatError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        """Temperature 0, any temperature under MIN_TEMPERATURE (which samples the top token anyway, and whose
        1/T overflows float32), or top_k 1."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


class Sampler:
    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: np.ndarray, seen: np.ndarray | None = None) -> int:
        """Pick one token id from a 1-D logits row. `seen`: ids already in the sequence.

        Runs once per sequence per decode step, so it avoids sorting the vocabulary: top-k and top-p
        look only at the highest logits (np.argpartition, widened until they hold the top-p mass), and
        the draw is one uniform number against a cumulative sum."""
        cfg = self.cfg
        x = np.asarray(logits, dtype=np.float32)
        if cfg.repetition_penalty != 1.0 and seen is not None and len(seen):
            x = x.copy()
            idx = np.unique(seen)
            v = x[idx]
            x[idx] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        if cfg.greedy:
            return int(np.argmax(x))
        z = (x - x.max()) * np.float32(1.0 / cfg.temperature)
        k = cfg.top_k if 0 < cfg.top_k < z.size else 0
        if not k and cfg.top_p >= 1.0:
            return _draw(np.cumsum(np.exp(z), dtype=np.float64), self.rng)
        p = np.exp(z)
        cand = _top(z, k) if k else None
        total = float(p[cand].sum(dtype=np.float64)) if k else float(p.sum(dtype=np.float64))
        n = k or min(z.size, 256)
        while True:
            cand = cand if k else _top(z, n)
            order = cand[np.lexsort((cand, -z[cand]))]  # highest first, ties by id: same pick on any machine
            cum = np.cumsum(p[order], dtype=np.float64)
            if cfg.top_p >= 1.0 or cum[-1] >= cfg.top_p * total or n >= z.size:
                break
            n = min(z.size, n * 8)
        if cfg.top_p < 1.0:
            cum = cum[: int(np.searchsorted(cum, cfg.top_p * total)) + 1]
        return int(order[min(_draw(cum, self.rng), len(order) - 1)])


def _top(z: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest entries (unordered), without a full sort."""
    return np.arange(z.size) if n >= z.size else np.argpartition(z, -n)[-n:]


def _draw(cum: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF sample from unnormalised cumulative weights."""
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(cum) - 1)
