"""Next-token choice from logits: greedy, temperature, top-k, top-p, repetition penalty.

Plain numpy on one row of logits; a seeded `numpy.random.Generator` makes
sampling reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge.errors import EdgeChatError


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
        if self.max_new_tokens < 1:
            raise EdgeChatError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise EdgeChatError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EdgeChatError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EdgeChatError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise EdgeChatError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise EdgeChatError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: np.ndarray, seen: np.ndarray | None = None) -> int:
        """Pick one token id from a 1-D logits row. `seen`: ids already in the sequence."""
        cfg = self.cfg
        x = logits.astype(np.float64, copy=True)
        if cfg.repetition_penalty != 1.0 and seen is not None and len(seen):
            idx = np.unique(seen)
            v = x[idx]
            x[idx] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        if cfg.greedy:
            return int(np.argmax(x))
        x /= cfg.temperature
        if cfg.top_k and cfg.top_k < x.size:
            kth = np.partition(x, -cfg.top_k)[-cfg.top_k]
            x[x < kth] = -np.inf
        x -= x.max()
        p = np.exp(x)
        p /= p.sum()
        if cfg.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, cfg.top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(p.size, p=p))
