"""What every backend's decoder is: the one interface the caches and the scheduler talk to.

A decoder runs one model graph (an ONNX Runtime session, a TensorRT engine). It knows two graph
shapes, named by its I/O contract (`edge.io_contract.DecoderIO`):

- plain: the past K/V go in, the present K/V (past + new) come out; a mask and positions per row.
  `run` is the one call. Each step's present becomes the next past.
- fused: one [batch, kv_heads, capacity, head_dim] buffer per layer is bound as both past and present
  and written in place after each row's own length (`seqlens_k`). `run_fused` is the one call.

Backends implement `new_cache`, `run` / `run_fused`, `reserve` and `to_device`; `forward` and
`prefill` are written once here on top of them, so every backend prefills a prompt with the same calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from edge.bundle import EngineEntry, ModelDims
from edge.errors import ContextOverflowError
from edge.io_contract import DecoderIO

# Fused graphs prefill in calls that start and end at fixed absolute positions (64, then every 128), and the
# prompt cache reuses K/V only up to one of them: a prompt whose start came from the cache then runs exactly the
# calls (same kernels, same past) it would have run without it, so its answer does not depend on what was asked
# before. The first span is 64 so a short chat prompt (SmolLM2's system prompt and a question: ~43 tokens) is one
# call, and users who arrive together may share it (SharedBatchCache.admit_together); it was 16 (16, 32, 64, 128),
# which made such a prompt three calls, each paying a read of every weight (docs/speed.md). 128 after that so a
# long prompt does not pay a weight read per handful of tokens.
PREFILL_BOUNDARY_FIRST, PREFILL_BOUNDARY_STEP = 64, 128


def next_boundary(pos: int) -> int:
    """The first prefill boundary after `pos` (see PREFILL_BOUNDARY_STEP)."""
    if pos < PREFILL_BOUNDARY_STEP:
        b = PREFILL_BOUNDARY_FIRST
        while b <= pos:
            b *= 2
        return min(b, PREFILL_BOUNDARY_STEP)
    return (pos // PREFILL_BOUNDARY_STEP + 1) * PREFILL_BOUNDARY_STEP


def boundary_at_or_below(n: int) -> int:
    """The last prefill boundary <= n (0 if none): how much of a cached start a prompt may reuse."""
    if n >= PREFILL_BOUNDARY_STEP:
        return n // PREFILL_BOUNDARY_STEP * PREFILL_BOUNDARY_STEP
    b = 0
    while next_boundary(b) <= n:
        b = next_boundary(b)
    return b


@dataclass
class KVCache:
    """Per-layer past key/values as backend values (OrtValues, device arrays), plus the length they cover.

    Plain graphs: each step's present outputs become the next past (`values` is replaced).
    Fused graphs: `values` are fixed [batch, kv_heads, capacity, head_dim] buffers that the
    graph writes in place; `arrays` holds the numpy memory behind them on CPU.
    """

    values: list  # one per past input, in DecoderIO.past_names order
    length: int = 0
    capacity: int = 0  # fused: columns the buffers hold; 0 = grows with each step (plain)
    arrays: list | None = None  # fused on CPU: the numpy arrays the values share memory with


class Decoder(ABC):
    """One decoder graph on one backend. See the module docstring for what a backend implements."""

    engine: EngineEntry | None = None  # the manifest entry, when loaded from a bundle
    max_batch: int | None = None  # most sequences one decode step takes (None: any; a TensorRT engine: its profile's)
    device: str = "cpu"  # where the K/V live: cpu | cuda
    providers: list[str]

    def __init__(self, dims: ModelDims, io: DecoderIO, name: str) -> None:
        self.dims = dims
        self.io = io
        self.name = name
        self.past_names = io.past_names(dims.num_layers)
        self.present_names = io.present_names(dims.num_layers)
        self.prefill_chunk = io.prefill_chunk  # most prompt tokens one plain-graph call takes

    # -- what a backend implements ------------------------------------------------------------------
    @abstractmethod
    def new_cache(self, batch: int = 1, capacity: int | None = None) -> KVCache:
        """An empty cache (fused graphs: `capacity` columns allocated up front)."""

    @abstractmethod
    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list) -> tuple[np.ndarray, list]:
        """One plain-graph call: (logits [batch, seq, vocab], present values to pass as the next past)."""

    def run_fused(self, ids: np.ndarray, seqlens_k: np.ndarray, total: int, buffers: list,
                  at: np.ndarray | None = None) -> np.ndarray:
        """One fused-graph call: logits [batch, k, vocab] at input positions `at` (None: all)."""
        raise NotImplementedError(f"{type(self).__name__} runs plain graphs only")

    def reserve(self, cache: KVCache, columns: int) -> None:
        """Fused graphs: make the buffers hold at least `columns` tokens. Plain caches grow by themselves."""

    @abstractmethod
    def to_device(self, array: np.ndarray):
        """A host array of K/V as this backend's value type (the batch cache merges rows on the host)."""

    # -- written once for every backend ---------------------------------------------------------------
    def forward(self, ids: np.ndarray, cache: KVCache, last_only: bool = True) -> np.ndarray:
        """Run `ids` [batch, seq] after the cached past; returns logits (last position, or all)."""
        if ids.ndim == 1:
            ids = ids[None, :]
        batch, seq = ids.shape
        past = cache.length
        if past + seq > self.dims.max_context:
            raise ContextOverflowError(f"{past + seq} tokens exceed the model's context of {self.dims.max_context}")
        if self.io.fused:
            self.reserve(cache, past + seq)
            at = np.full((batch, 1), seq - 1, np.int64) if last_only else None
            logits = self.run_fused(ids, np.full(batch, past + seq - 1, np.int32), past + seq, cache.values, at)
        else:
            mask = np.ones((batch, past + seq), dtype=np.int64)
            positions = np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq))
            logits, cache.values = self.run(ids, mask, positions, cache.values)
        cache.length = past + seq
        return logits[:, -1, :] if last_only else logits

    def prefill_span(self, done: int) -> int:
        """How many prompt tokens the next prefill call takes when `done` are in the cache: up to the next
        prefill boundary on a fused graph (see `next_boundary`), `prefill_chunk` on a plain one."""
        return next_boundary(done) - done if self.io.fused else self.prefill_chunk

    def prefill(self, ids: list[int] | np.ndarray, cache: KVCache, last_only: bool = True) -> np.ndarray:
        """Run `ids` after what `cache` holds, one `prefill_span` per call, so the same prompt always runs
        the same calls (whether its start was computed here or copied from the prompt cache, and whether it
        is answered or scored); returns the last position's logits [1, vocab], or every position's
        [1, len(ids), vocab] (`last_only` False: scoring a prompt)."""
        ids = np.asarray(ids, dtype=np.int64)
        parts = []
        start = 0
        while start < len(ids):
            end = start + self.prefill_span(cache.length)
            parts.append(self.forward(ids[start:end], cache, last_only=last_only))
            start = end
        assert parts, "empty prompt"
        return parts[-1] if last_only else np.concatenate(parts, axis=1)
