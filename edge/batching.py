"""Continuous batching: many conversations share one decode step.

Each active request owns a row of one batched KV cache. Rows have different lengths:
- plain graphs (`BatchCache`): rows are kept right-aligned in a [batch, kv_heads, width,
  head_dim] tensor per layer with the unused left columns masked out by `attention_mask`;
  positions are per row; each step's present KV replaces the past (a copy per step).
- fused graphs (`SharedBatchCache`): one [slots, kv_heads, capacity, head_dim] buffer per
  layer, each row left-aligned with its own length (`seqlens_k`); GroupQueryAttention writes
  the new token's K/V in place, so a step copies nothing, and a new request is prefilled
  straight into its row.
New requests that arrive together are prefilled together (fused graphs) or alone (batch 1), and
join the batch between steps. On a fused graph a long prompt is prefilled a chunk at a time into
the last slot, one chunk between decode steps, so the answers already streaming keep streaming
instead of freezing for the whole prefill; it then joins the batch. A finished or cancelled
request leaves at once and its slot is free for the next step; on a fused graph its conversation's
K/V go into the prompt cache (`PromptCache`), and a later prompt that starts the same way (the system
prompt, the chat so far) prefills only the rest. The scheduler thread is
the only caller of the ONNX Runtime session. Consumers get `StreamEvent`s
through a callback, so a slow reader never holds up the others.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from edge.errors import ContextOverflowError, EdgeChatError
from edge.runtime import Decoder, Generator, KVCache, StreamEvent, TextStream, _ort
from edge.sampling import Sampler, SamplingConfig

log = logging.getLogger("edgechat")


class QueueFullError(EdgeChatError):
    """Every slot is busy and the waiting queue is full: the client should retry later."""

    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"the server is busy ({waiting} requests waiting): retry in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class BatchCache:
    """Right-aligned KV rows of different lengths in one tensor per layer (see the module docstring)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.values: list | None = None  # OrtValues [batch, kv_heads, width, head_dim]
        self.lengths: list[int] = []

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def new_row(self, prompt_len: int) -> KVCache:
        """An empty batch-1 cache to prefill a new request into (joins with `add`)."""
        return self.decoder.new_cache()

    def add(self, row: KVCache) -> None:
        if self.values is None:
            self.values, self.lengths = list(row.values), [row.length]
            return
        width = max(self.width, row.length)
        old_pad, new_pad = width - self.width, width - row.length
        merged = []
        for old, new in zip(self.values, row.values):
            a, b = old.numpy(), new.numpy()
            if old_pad:
                a = np.pad(a, ((0, 0), (0, 0), (old_pad, 0), (0, 0)))
            if new_pad:
                b = np.pad(b, ((0, 0), (0, 0), (new_pad, 0), (0, 0)))
            merged.append(self.decoder.to_ortvalue(np.concatenate([a, b], axis=0)))
        self.values = merged
        self.lengths.append(row.length)

    def remove(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self.lengths)) if i not in set(rows)]
        if not keep:
            self.values, self.lengths = None, []
            return
        old_width = self.width
        self.lengths = [self.lengths[i] for i in keep]
        cut = old_width - self.width  # columns that were padding for every remaining row
        assert self.values is not None
        self.values = [self.decoder.to_ortvalue(v.numpy()[keep, :, cut:, :]) for v in self.values]

    def step(self, tokens: list[int]) -> np.ndarray:
        """Feed one token per row; returns next-token logits [batch, vocab]."""
        assert self.values is not None and len(tokens) == len(self.lengths)
        width = self.width
        mask = np.zeros((len(tokens), width + 1), dtype=np.int64)
        for i, n in enumerate(self.lengths):
            mask[i, width - n:] = 1
        positions = np.asarray(self.lengths, dtype=np.int64)[:, None]
        logits, self.values = self.decoder.run(np.asarray(tokens, dtype=np.int64)[:, None], mask, positions, self.values)
        self.lengths = [n + 1 for n in self.lengths]
        return logits[:, -1, :]


class PromptCache:
    """K/V of recent conversations, so a prompt that starts the way an earlier one did prefills only what
    is new: the chat template's system prompt (SmolLM2's is 24 of a short question's ~43 tokens), or the
    conversation so far when a chat sends its next turn (prompt caching, as llama.cpp's server and vLLM
    do). Entries are whole sequences (prompt + answer) copied out of a slot when their request ends; the
    least recently used go first once `max_bytes` is reached."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: list[tuple[np.ndarray, list[np.ndarray]]] = []  # (token ids, K/V per buffer), oldest first
        self.hits = 0  # prompts that reused an entry
        self.tokens_reused = 0  # and the prompt tokens they did not prefill

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, kv in self.entries for a in kv)

    def match(self, ids: list[int]) -> tuple[list[np.ndarray] | None, int]:
        """(K/V of the entry sharing the most leading tokens with `ids`, how many); (None, 0) if none.
        The entry becomes the most recently used."""
        best, best_n = -1, 0
        q = np.asarray(ids, dtype=np.int64)
        for i, (toks, _) in enumerate(self.entries):
            m = min(len(toks), len(q))
            same = toks[:m] == q[:m]
            n = m if same.all() else int(np.argmin(same))
            if n > best_n:
                best, best_n = i, n
        if best < 0:
            return None, 0
        self.entries.append(self.entries.pop(best))
        return self.entries[-1][1], best_n

    def start(self, prompt: list[int]) -> tuple[list[np.ndarray] | None, int]:
        """(K/V, how many of the prompt's first tokens to take from them): at most all but the last, since a
        prefill needs one token to run for the next-token logits."""
        kv, n = self.match(prompt)
        return kv, min(n, len(prompt) - 1)

    def covers(self, ids: list[int]) -> bool:
        """An entry already starts with all of `ids` (a shorter copy would add nothing)."""
        return self.match(ids)[1] == len(ids)

    def put(self, ids: list[int], kv: list[np.ndarray]) -> None:
        toks = np.asarray(ids, dtype=np.int64)
        # an entry this one extends (the same conversation a turn later) or repeats is no longer needed
        self.entries = [(t, a) for t, a in self.entries if not (len(t) <= len(toks) and (toks[:len(t)] == t).all())]
        if sum(a.nbytes for a in kv) > self.max_bytes:
            return
        self.entries.append((toks, kv))
        while self.nbytes > self.max_bytes:
            self.entries.pop(0)


class SharedBatchCache:
    """Fused graphs: rows left-aligned in one in-place buffer per layer (see the module docstring).

    Active rows are kept in slots 0..n-1 (order = the scheduler's row order) so a step binds
    buffer[:n], a view that shares memory with the buffer: nothing is copied per step. A row
    that leaves is closed up by moving the rows after it (one copy of their K/V, once).
    """

    def __init__(self, decoder: Decoder, slots: int, capacity: int = 256, prompt_cache_bytes: int = 0) -> None:
        if decoder.device != "cpu":
            raise EdgeChatError(f"batched serving of a fused graph runs on CPU only (this decoder runs on "
                                f"{decoder.device}): serve a plain engine there (--engine fp32)")
        self.decoder = decoder
        self.slots = slots
        self.buffers = decoder.new_cache(batch=slots, capacity=min(capacity, decoder.dims.max_context))
        self.lengths: list[int] = []
        self._views: tuple[int, list] | None = None  # (n, OrtValues over buffer[:n]) for the current n
        self.side: KVCache | None = None  # a long prompt being prefilled into the last slot (side_row)
        self.prompts = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.reused: list[int] = []  # per row of the last prefill_rows call: prompt tokens taken from the cache

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def _reserve(self, columns: int) -> None:
        if columns > self.buffers.capacity:
            self.decoder.reserve(self.buffers, columns)
            self._views = None

    def _slots(self, lo: int, hi: int) -> tuple[list[np.ndarray], list]:
        """Slots lo..hi-1 of every layer's buffer: numpy views and OrtValues over the same memory."""
        arrays = [a[lo:hi] for a in self.buffers.arrays]
        return arrays, [_ort().OrtValue.ortvalue_from_numpy(a) for a in arrays]

    @property
    def free(self) -> int:
        """Slots a new row may take now (the last one is held while a side row is prefilled there)."""
        return self.slots - len(self.lengths) - (self.side is not None)

    def new_row(self, prompt_len: int) -> KVCache:
        """A batch-1 cache over the next free slot: the prefill writes its K/V in place, `add` admits it.
        The buffer is grown for the prompt first, so the prefill never has to grow (and so re-home) the view."""
        n = len(self.lengths)
        if self.free < 1:
            raise EdgeChatError(f"all {self.slots} batch slots are taken")
        self._reserve(prompt_len + 1)
        arrays, values = self._slots(n, n + 1)
        return KVCache(values, capacity=self.buffers.capacity, arrays=arrays)

    def prefill_rows(self, prompts: list[list[int]]) -> np.ndarray:
        """Prefill new requests into the next free slots, in order; they join the batch at once. Returns
        each row's next-token logits [len(prompts), vocab].

        Without cached prefixes: ONE right-padded call (each row's seqlens_k is its own length, so padding
        is never attended). When the prompt cache holds the start of some prompt, its K/V are copied into
        the slot and only the rest runs; ONNX Runtime's CPU GroupQueryAttention takes a past only at batch
        1 for more than one new token, so such a group is prefilled one row at a time (a group of several
        only when the cache holds at least half of its prompt tokens)."""
        n, k = len(self.lengths), len(prompts)
        if k > self.free:
            raise EdgeChatError(f"{k} new rows do not fit: {self.free} of {self.slots} batch slots are free")
        found = [self.prompts.start(p) for p in prompts] if self.prompts is not None else []
        self.reused = [c for _, c in found] or [0] * k
        if k > 1 and 2 * sum(self.reused) < sum(len(p) for p in prompts):
            # a few shared tokens do not pay for giving up the one batched call (measured with 8 SmolLM2
            # prompts of ~43 tokens, 24-33 cached: one at a time 210 ms TTFT p50 against 331 ms batched)
            self.reused = [0] * k
        if any(self.reused):
            return np.stack([self._prefill_one(n + j, p, kv, c) for j, (p, (kv, _), c)
                             in enumerate(zip(prompts, found, self.reused))])
        lens = [len(p) for p in prompts]
        width = max(lens)
        self._reserve(width + 1)
        ids = np.zeros((k, width), dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        last = np.asarray(lens, dtype=np.int64) - 1
        logits = self.decoder.run_fused(ids, last.astype(np.int32), width, self._slots(n, n + k)[1], last[:, None])
        self.lengths.extend(lens)
        self._views = None
        return logits[:, 0]

    def _prefill_one(self, slot: int, prompt: list[int], kv: list[np.ndarray] | None, cached: int) -> np.ndarray:
        """One prompt into `slot` (the next free one), its first `cached` tokens' K/V copied from `kv`."""
        self._reserve(len(prompt) + 1)
        self._copy_prefix(slot, kv, cached)
        ids = np.asarray([prompt[cached:]], dtype=np.int64)
        logits = self.decoder.run_fused(ids, np.asarray([len(prompt) - 1], np.int32), len(prompt),
                                        self._slots(slot, slot + 1)[1], np.asarray([[ids.shape[1] - 1]], np.int64))
        self.lengths.append(len(prompt))
        self._views = None
        return logits[0, 0]

    def _copy_prefix(self, slot: int, kv: list[np.ndarray] | None, n: int) -> None:
        """The first n cached tokens' K/V (a prompt cache entry) into `slot`."""
        if n > 0 and kv is not None and self.prompts is not None:
            for a, src in zip(self.buffers.arrays, kv):
                a[slot, :, :n] = src[:, :n]
            self.prompts.hits += 1
            self.prompts.tokens_reused += n

    def reuse_side(self, prompt: list[int]) -> int:
        """The side row's prompt, like prefill_rows': its longest cached start copied into the last slot;
        returns how many tokens are there now (the chunked prefill goes on from there)."""
        row = self.side_view()
        if self.prompts is None:
            return 0
        kv, row.length = self.prompts.start(prompt)
        self._copy_prefix(self.slots - 1, kv, row.length)
        return row.length

    def remember(self, row: int, ids: list[int]) -> None:
        """Keep row's K/V for the tokens `ids` it holds in the prompt cache (call before it leaves)."""
        m = min(len(ids), self.lengths[row])
        if self.prompts is None or m < 2 or m * sum(a[0, :, :1].nbytes for a in self.buffers.arrays) > self.prompts.max_bytes:
            return  # nothing to keep, or more than the whole cache may hold: no copy made
        if not self.prompts.covers(ids[:m]):
            self.prompts.put(ids[:m], [a[row, :, :m].copy() for a in self.buffers.arrays])

    def add(self, row: KVCache) -> None:
        n = len(self.lengths)
        if row.arrays is None or not np.may_share_memory(row.arrays[0], self.buffers.arrays[0][n]):
            raise EdgeChatError("SharedBatchCache.add takes the cache its new_row() returned")
        self.lengths.append(row.length)
        self._views = None

    def side_row(self, prompt_len: int) -> KVCache:
        """A batch-1 cache over the LAST slot for a long prompt that is prefilled a chunk at a time between
        decode steps. Rows 0..n-1 never reach that slot while it is held (`free` counts it), so closing up
        after a leaver does not move it; `side_view` re-points it if the buffers grow; `add_side` admits it."""
        if self.side is not None:
            raise EdgeChatError("a long prompt is already being prefilled into the last slot")
        if self.free < 1:
            raise EdgeChatError(f"all {self.slots} batch slots are taken")
        self._reserve(prompt_len + 1)
        arrays, values = self._slots(self.slots - 1, self.slots)
        self.side = KVCache(values, capacity=self.buffers.capacity, arrays=arrays)
        return self.side

    def side_view(self) -> KVCache:
        """The side row over the current buffers (a decode step may have grown, i.e. re-homed, them)."""
        row = self.side
        assert row is not None
        if not np.may_share_memory(row.arrays[0], self.buffers.arrays[0]):
            row.arrays, row.values = self._slots(self.slots - 1, self.slots)
            row.capacity = self.buffers.capacity
        return row

    def add_side(self) -> None:
        """The side row's prompt is in: move it next to the active rows (one copy of its K/V unless it is
        there already) and make it a row of the batch."""
        row, n = self.side_view(), len(self.lengths)
        if n != self.slots - 1:
            for a in self.buffers.arrays:
                a[n, :, : row.length] = a[self.slots - 1, :, : row.length]
        self.side = None
        self.lengths.append(row.length)
        self._views = None

    def drop_side(self) -> None:
        self.side = None

    def remove(self, rows: list[int]) -> None:
        gone = set(rows)
        keep = [i for i in range(len(self.lengths)) if i not in gone]
        for dst, src in enumerate(keep):  # close the gaps: only the rows after a leaver move, each up to its length
            if dst != src:
                w = self.lengths[src]
                for a in self.buffers.arrays:
                    a[dst, :, :w] = a[src, :, :w]
        self.lengths = [self.lengths[i] for i in keep]
        self._views = None

    def step(self, tokens: list[int]) -> np.ndarray:
        """Feed one token per row; returns next-token logits [batch, vocab]."""
        n = len(self.lengths)
        assert n and len(tokens) == n
        self._reserve(self.width + 1)
        if self._views is None or self._views[0] != n:
            self._views = (n, self._slots(0, n)[1])
        seqlens_k = np.asarray(self.lengths, dtype=np.int32)  # after this step, minus one
        logits = self.decoder.run_fused(np.asarray(tokens, dtype=np.int64)[:, None], seqlens_k, self.width + 1,
                                        self._views[1], np.zeros((n, 1), np.int64))
        self.lengths = [x + 1 for x in self.lengths]
        return logits[:, 0]


def batch_cache(decoder: Decoder, slots: int, prompt_cache_bytes: int = 0) -> BatchCache | SharedBatchCache:
    """The batch cache the decoder's graph calls for (a prompt cache on fused graphs only)."""
    return SharedBatchCache(decoder, slots, prompt_cache_bytes=prompt_cache_bytes) if decoder.io.fused \
        else BatchCache(decoder)


_ids = itertools.count(1)
BATCHED_PREFILL_MAX_PROMPT = 512  # longer prompts are prefilled alone, in chunks (between decode steps: fused graphs)
# Tokens of a long prompt prefilled between two decode steps. SmolLM2-135M int8, 2-core EPYC: a 128-token
# chunk takes 73-126 ms (past 0-1400), 1536 tokens 1.20 s in chunks of 128 vs 1.22 s in 512s, so the others
# stream a token every ~0.1-0.14 s instead of freezing for the whole prefill.
INTERLEAVED_PREFILL_CHUNK = 128
PROMPT_CACHE_MB = 64  # K/V kept of recent conversations (fused graphs): SmolLM2-135M takes 45 KB a token, ~1,450 tokens
BATCHED_PREFILL_TOKENS = 1024  # padded tokens per batched prefill call (bounds its activations; and a graph
# written before logit_positions returns [rows, width, vocab] logits)


@dataclass
class Request:
    """One answer being generated. `cancel()` frees its slot before the next step."""

    prompt_ids: list[int]
    cfg: SamplingConfig
    on_event: Callable[[StreamEvent], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    _queue: "queue.Queue[StreamEvent]" = field(default_factory=queue.Queue, repr=False)

    def emit(self, ev: StreamEvent) -> None:
        (self.on_event or self._queue.put)(ev)
        if ev.finish_reason:
            self.done.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Blocking iterator over this request's events (only when no `on_event` callback was given)."""
        while True:
            ev = self._queue.get(timeout=timeout)
            yield ev
            if ev.finish_reason:
                return

    def answer(self, timeout: float | None = None) -> tuple[str, StreamEvent]:
        """Wait for the whole answer: its text and the last event (finish_reason, stats)."""
        parts, last = [], None
        for ev in self.events(timeout):
            parts.append(ev.text)
            last = ev
        assert last is not None
        return "".join(parts), last


@dataclass
class _Row:
    req: Request
    sampler: Sampler
    text: TextStream
    seen: list[int]
    last: int = -1

    @property
    def n(self) -> int:
        return len(self.text.ids)


@dataclass
class _Prefilling:
    """A long prompt going into the side slot, `done` tokens so far (`cached` of them from the prompt cache)."""
    req: Request
    row: _Row
    done: int = 0
    cached: int = 0


class Scheduler:
    """Admits requests into up to `max_batch` rows and runs batched decode steps on one thread."""

    def __init__(self, gen: Generator, max_batch: int = 8, max_queue: int = 32, metrics=None,
                 prompt_cache_mb: float = PROMPT_CACHE_MB) -> None:
        if max_batch < 1 or max_queue < 0:
            raise EdgeChatError(f"max_batch must be >= 1 and max_queue >= 0 (got {max_batch}, {max_queue})")
        self.gen = gen
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.pending: deque[Request] = deque()
        self.rows: list[_Row] = []
        if prompt_cache_mb < 0:
            raise EdgeChatError(f"the prompt cache size must be >= 0 MB (0 turns it off), got {prompt_cache_mb}")
        self.cache = batch_cache(gen.decoder, max_batch, int(prompt_cache_mb * 2**20))
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step_s = 0.05  # running mean of one decode step, for Retry-After
        self.prefills_together = 0  # batched prefill calls (fused graphs), read by the tests
        self.prefilling: _Prefilling | None = None  # a long prompt prefilled between decode steps (fused graphs)
        self.prefill_chunk = INTERLEAVED_PREFILL_CHUNK
        self.error: str | None = None

    # -- client side -----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], cfg: SamplingConfig,
               on_event: Callable[[StreamEvent], None] | None = None) -> Request:
        if not prompt_ids:
            raise EdgeChatError("the prompt is empty")
        if len(prompt_ids) >= self.gen.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.gen.max_context}: shorten it")
        if self._stop.is_set() or self._thread is None:
            raise EdgeChatError("the scheduler is not running")
        req = Request(list(prompt_ids), cfg, on_event)
        with self._cv:
            if len(self.pending) >= self.max_queue and len(self.rows) + len(self.pending) >= self.max_batch:
                raise QueueFullError(len(self.pending), self.retry_after())
            self.pending.append(req)
            self._cv.notify()
        return req

    def retry_after(self) -> float:
        """Rough seconds until a slot frees: a typical answer's remaining steps."""
        return max(1.0, round(self.step_s * 64))

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="edgechat-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything in flight and wait for the loop to end."""
        self._stop.set()
        with self._cv:
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- scheduler thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                if not self.rows and self.prefilling is None:
                    with self._cv:
                        if not self.pending and not self._stop.is_set():
                            self._cv.wait(0.5)
                    continue
                self._drop_cancelled()
                if self.rows:
                    self._step()
                if self.prefilling is not None:
                    self._prefill_next_chunk()
        except Exception as e:  # a broken graph: fail everything in flight, loudly, and stop taking work
            self.error = f"{type(e).__name__}: {e}"
            log.exception("scheduler stopped")
            raise
        finally:
            self._stop.set()
            with self._cv:
                waiting, self.pending = list(self.pending), deque()
            for r in waiting:
                self._emit_final(r, TextStream(self.gen.tokenizer, r.cfg, len(r.prompt_ids), self.gen.max_context),
                                 "cancelled" if self.error is None else "error")
            if self.prefilling is not None:
                self._emit_final(self.prefilling.req, self.prefilling.row.text,
                                 "cancelled" if self.error is None else "error")
                self.prefilling = None
            self._finish(list(range(len(self.rows))), "cancelled" if self.error is None else "error")

    def _free(self) -> int:
        return self.max_batch - len(self.rows) - (self.prefilling is not None)

    def _long(self, req: Request) -> bool:
        """Prefilled between decode steps: a long prompt on a fused graph."""
        return isinstance(self.cache, SharedBatchCache) and len(req.prompt_ids) > BATCHED_PREFILL_MAX_PROMPT

    def _admit(self) -> None:
        while self._free() > 0 and not self._stop.is_set():
            batch = self._take(self._free())
            if not batch:
                return
            longs = [b for b in batch if self._long(b[0])]
            together = [b for b in batch if len(b[0].prompt_ids) <= BATCHED_PREFILL_MAX_PROMPT] \
                if isinstance(self.cache, SharedBatchCache) else []
            if together:
                self._prefill_together(together)
            joined = {id(req) for req, _ in together + longs}
            for req, row in batch:
                if id(req) not in joined:
                    self._prefill_alone(req, row)
            for req, row in longs:  # _take hands out at most one, and only while none is in progress
                self._start_prefill(req, row)

    def _take(self, free: int) -> list[tuple[Request, _Row]]:
        """Up to `free` waiting requests (cancelled ones are closed here), oldest first. A long prompt
        waits at the head of the queue while another is being prefilled (one side slot)."""
        out = []
        while len(out) < free:
            with self._cv:
                if not self.pending:
                    break
                if self._long(self.pending[0]) and (self.prefilling is not None or
                                                    any(self._long(r) for r, _ in out)):
                    break
                req = self.pending.popleft()
            text = TextStream(self.gen.tokenizer, req.cfg, len(req.prompt_ids), self.gen.max_context)
            text.t0 = req.submitted  # TTFT counts the time spent waiting in the queue
            if req.cancelled.is_set():
                self._emit_final(req, text, "cancelled")
                continue
            out.append((req, _Row(req, Sampler(req.cfg), text, list(req.prompt_ids))))
        return out

    def _prefill_alone(self, req: Request, row: _Row) -> None:
        cache = self.cache.new_row(len(req.prompt_ids))
        try:
            logits = self.gen.decoder.prefill(req.prompt_ids, cache)[0]
        except EdgeChatError as e:
            self._emit_final(req, row.text, "error", str(e))
            return
        if self._accept(row, logits, cache.length):
            self.rows.append(row)
            self.cache.add(cache)
        if self.metrics is not None:
            self.metrics.observe_prompt(len(req.prompt_ids))

    def _start_prefill(self, req: Request, row: _Row) -> None:
        try:
            self.cache.side_row(len(req.prompt_ids))
        except EdgeChatError as e:
            self._emit_final(req, row.text, "error", str(e))
            return
        cached = self.cache.reuse_side(req.prompt_ids)  # a long chat's next turn: only the new part runs
        row.text.cached_tokens = cached
        self.prefilling = _Prefilling(req, row, done=cached, cached=cached)

    def _prefill_next_chunk(self) -> None:
        """One chunk of the long prompt into the side slot; on the last one it joins the batch."""
        p = self.prefilling
        assert p is not None and isinstance(self.cache, SharedBatchCache)
        if p.req.cancelled.is_set():
            self.cache.drop_side()
            self.prefilling = None
            self._emit_final(p.req, p.row.text, "cancelled")
            return
        ids = p.req.prompt_ids
        chunk = np.asarray(ids[p.done: p.done + self.prefill_chunk], dtype=np.int64)
        try:
            logits = self.gen.decoder.forward(chunk, self.cache.side_view())[0]
        except EdgeChatError as e:
            self.cache.drop_side()
            self.prefilling = None
            self._emit_final(p.req, p.row.text, "error", str(e))
            return
        p.done += len(chunk)
        if p.done < len(ids):
            return
        self.prefilling = None
        if self._accept(p.row, logits, len(ids)):
            self.cache.add_side()
            self.rows.append(p.row)
        else:
            self.cache.drop_side()
        if self.metrics is not None:
            self.metrics.observe_prompt(len(ids), cached=p.cached)

    def _prefill_together(self, batch: list[tuple[Request, _Row]]) -> None:
        """Fused graphs: requests that arrived together are prefilled in one padded call (a prompt's
        compute is then shared, not queued behind the others'), or from their cached starts
        (SharedBatchCache.prefill_rows decides); each then joins the batch."""
        while batch:  # groups whose padded size keeps the all-position logits bounded
            group, width = [], 0
            for b in batch:
                w = max(width, len(b[0].prompt_ids))
                if group and w * (len(group) + 1) > BATCHED_PREFILL_TOKENS:
                    break
                group.append(b)
                width = w
            batch = batch[len(group):]
            self.prefills_together += 1
            try:
                logits = self.cache.prefill_rows([req.prompt_ids for req, _ in group])
            except EdgeChatError as e:
                for req, row in group:
                    self._emit_final(req, row.text, "error", str(e))
                continue
            first = len(self.rows)
            self.rows.extend(row for _, row in group)
            for (_, row), c in zip(group, self.cache.reused):
                row.text.cached_tokens = c
            done = [first + j for j, (req, row) in enumerate(group)
                    if not self._accept(row, logits[j], len(req.prompt_ids))]
            if done:
                self._leave(done)
            if self.metrics is not None:
                for (req, _), c in zip(group, self.cache.reused):
                    self.metrics.observe_prompt(len(req.prompt_ids), cached=c)

    def _accept(self, row: _Row, logits: np.ndarray, length: int) -> bool:
        """Sample the row's next token and emit it; False when the answer is finished (and closed)."""
        cfg = row.req.cfg
        tok = row.sampler(logits, np.asarray(row.seen) if cfg.repetition_penalty != 1.0 else None)
        if tok in self.gen.tokenizer.eos_ids and not cfg.ignore_eos:
            self._emit_final(row.req, row.text, "stop")
            return False
        ev = row.text.push(tok)
        if ev is not None:
            row.req.emit(ev)
        row.seen.append(tok)
        row.last = tok
        if row.text.stopped or row.n >= cfg.max_new_tokens or length + 1 >= self.gen.max_context:
            self._emit_final(row.req, row.text, "stop" if row.text.stopped else "length")
            return False
        if row.req.cancelled.is_set():
            self._emit_final(row.req, row.text, "cancelled")
            return False
        return True

    def _drop_cancelled(self) -> None:
        gone = [i for i, r in enumerate(self.rows) if r.req.cancelled.is_set()]
        if gone:
            self._finish(gone, "cancelled")

    def _step(self) -> None:
        t = time.perf_counter()
        logits = self.cache.step([r.last for r in self.rows])
        self.step_s = 0.9 * self.step_s + 0.1 * (time.perf_counter() - t)
        if self.metrics is not None:
            self.metrics.observe_step(len(self.rows))
        finished = [i for i, r in enumerate(self.rows) if not self._accept(r, logits[i], self.cache.lengths[i])]
        if finished:
            self._leave(finished)

    def _finish(self, rows: list[int], reason: str) -> None:
        for i in rows:
            r = self.rows[i]
            self._emit_final(r.req, r.text, reason)
        if rows and self.rows:
            self._leave(rows)

    def _leave(self, rows: list[int]) -> None:
        """Rows whose answers ended leave the batch; a fused graph's prompt cache keeps their conversations."""
        if isinstance(self.cache, SharedBatchCache):
            for i in rows:
                self.cache.remember(i, self.rows[i].seen)
        self.cache.remove(rows)
        self.rows = [r for i, r in enumerate(self.rows) if i not in set(rows)]

    def _emit_final(self, req: Request, text: TextStream, reason: str, error: str | None = None) -> None:
        if req.done.is_set():
            return
        events = text.finish(reason=reason)
        if error or (reason == "error" and self.error):
            events[-1].stats["error"] = error or self.error
        for ev in events:
            req.emit(ev)
        if self.metrics is not None:
            self.metrics.observe_finish(events[-1].finish_reason, events[-1].stats)
