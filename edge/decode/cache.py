"""The KV caches behind the decode loop (edge.decode.scheduler): many rows of different lengths in one batch.

Every kind does the same things for the scheduler, which never asks which one it has: `admit` a
prompt as a new row (prefilled alone, batch 1, the calls `Decoder.prefill` runs), `step` every row by
one token, `remove` rows that finished, prefill one long prompt a span at a time in a side row between
steps (`side_row` ... `add_side`), and `remember` a finished prompt for the prompt cache. A cache says
once whether it can check a draft (`can_verify`: speculative decoding's `verify` + `rollback` of a lone
row); only the fused in-place cache on CPU can (a rejected draft costs it nothing but a length), and
everything that asks where drafts can be checked (the scheduler, edge-chat, the build) reads that flag.

- plain graphs (`BatchCache`): rows are kept right-aligned in a [batch, kv_heads, width,
  head_dim] tensor per layer with the unused left columns masked out by `attention_mask`;
  positions are per row; each step's present KV replaces the past (a copy per step).
- fused graphs (`SharedBatchCache`): one [slots, kv_heads, capacity, head_dim] buffer per
  layer, each row left-aligned with its own length (`seqlens_k`); GroupQueryAttention writes
  the new token's K/V in place, so a step copies nothing, and a new request is prefilled
  straight into its row. Finished prompts' K/V go into a `PromptCache`, and a later prompt that
  starts the same way (the system prompt, the chat so far) prefills only the rest, from a fixed
  prefill boundary (edge.backends.decoder.next_boundary) so its numbers equal an uncached prefill's.
"""

from __future__ import annotations

import numpy as np

from typing import Protocol

from edge.errors import EdgeChatError
from edge.backends.decoder import Decoder, KVCache, boundary_at_or_below, next_boundary

class RowCache(Protocol):
    """What the scheduler asks of a batch cache (every kind below implements it)."""

    lengths: list[int]  # tokens cached per row, in the scheduler's row order
    reused: int  # prompt tokens the last admitted row took from the prompt cache
    can_verify: bool  # `verify` and `rollback` work here (speculative decoding checks drafts on this cache)

    def __len__(self) -> int: ...
    def admit(self, prompt: list[int]) -> np.ndarray: ...
    # admit_together runs one batched call (True) or the prompts one after another (False: the scheduler then
    # admits each alone, so each user's first token does not wait for the others' prompts)
    batches_first_prefill: bool
    def admit_together(self, prompts: list[list[int]]) -> np.ndarray: ...
    def cached_start(self, prompt: list[int]) -> int: ...
    def step(self, tokens: list[int]) -> np.ndarray: ...
    def remove(self, rows: list[int]) -> None: ...
    def remember(self, row: int, ids: list[int]) -> None: ...
    def side_row(self, prompt_len: int) -> KVCache: ...
    def reuse_side(self, prompt: list[int]) -> int: ...
    def side_view(self) -> KVCache: ...
    def add_side(self) -> None: ...
    def drop_side(self) -> None: ...
    def fresh(self) -> "RowCache": ...
    def verify(self, tokens: list[int]) -> np.ndarray: ...
    def rollback(self, length: int) -> None: ...


class _NoVerify:
    """A cache that cannot check drafts: its `verify` and `rollback` refuse, saying why (`can_verify` is False,
    so the scheduler never calls them). Its `admit_together` admits the prompts one at a time, all or none."""

    can_verify = False
    batches_first_prefill = False

    def admit_together(self, prompts: list[list[int]]) -> np.ndarray:
        n = len(self)
        try:
            return np.stack([self.admit(p) for p in prompts])  # type: ignore[attr-defined]
        except BaseException:
            self.remove(list(range(n, len(self))))  # type: ignore[attr-defined]
            raise

    def cached_start(self, prompt: list[int]) -> int:
        return 0

    def verify(self, tokens: list[int]) -> np.ndarray:
        raise EdgeChatError(f"{type(self).__name__} cannot verify drafts (speculative steps run on a fused graph on "
                            "CPU: int8-dynamic or int4-weight)")

    def rollback(self, length: int) -> None:
        self.verify([])


PROMPT_CACHE_MB = 64  # K/V kept of recent conversations (fused graphs): SmolLM2-135M takes 45 KB a token, ~1,450 tokens


class BatchCache(_NoVerify):
    """Right-aligned KV rows of different lengths in one tensor per layer (see the module docstring)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.values: list | None = None  # backend values [batch, kv_heads, width, head_dim]
        self.lengths: list[int] = []
        self.side: KVCache | None = None  # a long prompt being prefilled apart (side_row)
        self.reused = 0  # prompt tokens the last admitted row took from a prompt cache (plain graphs keep none)

    def fresh(self) -> "BatchCache":
        """An empty cache of the same kind (after a failure: this one may be half-updated)."""
        return BatchCache(self.decoder)

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def admit(self, prompt: list[int]) -> np.ndarray:
        """Prefill `prompt` alone (batch 1) and add it as the last row; returns its next-token logits [vocab]."""
        row = self.decoder.new_cache()
        logits = self.decoder.prefill(prompt, row)[0]
        self.add(row)
        return logits

    def side_row(self, prompt_len: int) -> KVCache:
        """A batch-1 cache for a long prompt prefilled a span at a time between steps; `add_side` admits it."""
        if self.side is not None:
            raise EdgeChatError("a long prompt is already being prefilled")
        self.side = self.decoder.new_cache()
        return self.side

    def reuse_side(self, prompt: list[int]) -> int:
        return 0  # no prompt cache on plain graphs

    def side_view(self) -> KVCache:
        assert self.side is not None
        return self.side

    def add_side(self) -> None:
        assert self.side is not None
        self.add(self.side)
        self.side = None

    def drop_side(self) -> None:
        self.side = None

    def remember(self, row: int, ids: list[int]) -> None:
        """Plain graphs keep no prompt cache (their rows are re-laid out every time one joins)."""

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
            merged.append(self.decoder.to_device(np.concatenate([a, b], axis=0)))
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
        self.values = [self.decoder.to_device(v.numpy()[keep, :, cut:, :]) for v in self.values]

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

    def match(self, ids: list[int], touch: bool = True) -> tuple[list[np.ndarray] | None, int]:
        """(K/V of the entry sharing the most leading tokens with `ids`, how many); (None, 0) if none.
        The entry becomes the most recently used (unless `touch` is False: a look that takes nothing)."""
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
        if not touch:
            return self.entries[best][1], best_n
        self.entries.append(self.entries.pop(best))
        return self.entries[-1][1], best_n

    def start(self, prompt: list[int], touch: bool = True) -> tuple[list[np.ndarray] | None, int]:
        """(K/V, how many of the prompt's first tokens to take from them): the last prefill boundary within the
        shared start (so the rest runs the calls an uncached prefill would, see edge.backends.decoder.next_boundary),
        and never the prompt's last token, since a prefill needs one token to run for the next-token logits."""
        kv, n = self.match(prompt, touch)
        return kv, boundary_at_or_below(min(n, len(prompt) - 1))

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

    can_verify = True  # a rejected draft is forgotten by setting the row's length back (see rollback)
    batches_first_prefill = True

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
        self.reused = 0  # prompt tokens the last admitted row took from the prompt cache

    def fresh(self) -> "SharedBatchCache":
        """An empty cache of the same kind that keeps the prompt cache (its copies are still valid)."""
        new = SharedBatchCache(self.decoder, self.slots)
        new.prompts = self.prompts
        return new

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
        return arrays, [self.decoder.share(a) for a in arrays]

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

    def admit(self, prompt: list[int]) -> np.ndarray:
        """Prefill `prompt` into the next free slot and make it the last row; returns its next-token logits.

        The prompt runs the calls `Decoder.prefill` runs for it alone (spans between fixed prefill
        boundaries, batch 1), after the K/V of its longest cached start up to such a boundary are copied
        into its slot: the same prompt gets the same logits, bit for bit, whatever the cache held and
        whoever arrived with it (one padded call for a group would be faster but gives a row numbers that
        depend on the longest prompt beside it). `reused` says how many tokens it took from the cache."""
        n = len(self.lengths)
        if self.free < 1:
            raise EdgeChatError(f"all {self.slots} batch slots are taken")
        kv, self.reused = self.prompts.start(prompt) if self.prompts is not None else (None, 0)
        try:
            return self._prefill_one(n, prompt, kv, self.reused)
        except BaseException:
            self.truncate(n)  # a failed prefill leaves no half-admitted row behind
            raise

    def prefill_rows(self, prompts: list[list[int]]) -> np.ndarray:
        """Admit several prompts as the scheduler admits requests that arrive together, all or none (tests and
        benchmarks): the ones the prompt cache has nothing for together (`admit_together`), the others one at a
        time; their next-token logits [len(prompts), vocab] in the order given; `reused_rows` says how many tokens
        each took from the prompt cache."""
        n, k = len(self.lengths), len(prompts)
        if k > self.free:
            raise EdgeChatError(f"{k} new rows do not fit: {self.free} of {self.slots} batch slots are free")
        fresh = [i for i, p in enumerate(prompts) if self.cached_start(p) == 0] if k > 1 else []
        rest = [i for i in range(k) if i not in fresh]
        out: dict[int, np.ndarray] = {}
        reused = {i: 0 for i in fresh}
        try:
            for i in rest:
                out[i] = self.admit(prompts[i])
                reused[i] = self.reused
            if fresh:
                out.update(zip(fresh, self.admit_together([prompts[i] for i in fresh])))
        except BaseException:
            self.truncate(n)
            raise
        order = rest + fresh  # the rows' order in the cache: put it back in the order given
        if order != list(range(k)):
            self._permute(n, order)
        self.reused_rows = [reused[i] for i in range(k)]
        return np.stack([out[i] for i in range(k)])

    def _permute(self, n: int, order: list[int]) -> None:
        """Rows n.. hold prompts[order[0]], prompts[order[1]], ...: move them so row n + i holds prompts[i]."""
        slot_of = {p: n + j for j, p in enumerate(order)}
        lengths = self.lengths[:n] + [self.lengths[slot_of[i]] for i in range(len(order))]
        for a in self.buffers.arrays:
            a[n:n + len(order)] = a[[slot_of[i] for i in range(len(order))]]
        self.lengths = lengths
        self._views = None

    def cached_start(self, prompt: list[int]) -> int:
        """How many of the prompt's first tokens `admit` would take from the prompt cache (0: none)."""
        if self.prompts is None:
            return 0
        return self.prompts.start(prompt, touch=False)[1]

    def admit_together(self, prompts: list[list[int]]) -> np.ndarray:
        """Prefill new prompts (none taking anything from the prompt cache) as rows n.., all or none: their first
        prefill span (up to the first boundary, edge.backends.decoder.next_boundary) in ONE call of batch k, each
        row padded to the longest (ONNX Runtime's GroupQueryAttention runs several tokens per row in a batch only
        with no past: a first call), then the rest of each prompt as `admit` runs it. A short chat
        prompt fits the first span whole, so k users arriving together wait for one call instead of k in a row
        (the scheduler sizes k by Admission.prefill_batch_tokens: on CPU a larger call saves nothing per token).
        Each row's logits and K/V equal its prefill alone where the engine's kernels are batch invariant
        (edge.backends.determinism; tests/test_batching.py checks it per engine)."""
        n, k = len(self.lengths), len(prompts)
        if k > self.free:
            raise EdgeChatError(f"{k} new rows do not fit: {self.free} of {self.slots} batch slots are free")
        first = np.asarray([min(len(p), next_boundary(0)) for p in prompts], np.int64)
        span = int(first.max())
        # a shorter row is padded after its end with its last token, and the call runs every row as `span` tokens
        # long: causal attention keeps the padding out of the row's own positions, and the padding's K/V, past the
        # row's length, are never read (the next call writes over them). Not GroupQueryAttention's right padding
        # by seqlens_k: graphs that rotate Q/K outside the op (Qwen3's norms, partial rotary) would place a
        # padded row's tokens at negative positions.
        ids = np.empty((k, span), np.int64)
        for i, p in enumerate(prompts):
            ids[i, :first[i]] = p[:first[i]]
            ids[i, first[i]:] = p[first[i] - 1]
        self._reserve(max(max(len(p) for p in prompts), span) + 1)
        try:
            logits = self.decoder.run_fused(ids, np.full(k, span - 1, np.int32), span, self._slots(n, n + k)[1],
                                            (first - 1)[:, None])[:, 0]
            for i, p in enumerate(prompts):
                if len(p) > first[i]:  # the rest of a prompt longer than the first span: alone, as admit runs it
                    arrays, values = self._slots(n + i, n + i + 1)
                    row = KVCache(values, length=int(first[i]), capacity=self.buffers.capacity, arrays=arrays)
                    logits[i] = self.decoder.prefill(p[first[i]:], row)[0]
                self.lengths.append(len(p))
        except BaseException:
            self.truncate(n)
            raise
        self._views = None
        self.reused = 0
        return logits

    def _prefill_one(self, slot: int, prompt: list[int], kv: list[np.ndarray] | None, cached: int) -> np.ndarray:
        """One prompt into `slot` (the next free one), its first `cached` tokens' K/V copied from `kv`."""
        self._reserve(len(prompt) + 1)
        self._copy_prefix(slot, kv, cached)
        arrays, values = self._slots(slot, slot + 1)
        row = KVCache(values, length=cached, capacity=self.buffers.capacity, arrays=arrays)
        logits = self.decoder.prefill(prompt[cached:], row)
        self.lengths.append(len(prompt))
        self._views = None
        return logits[0]

    def truncate(self, n: int) -> None:
        """Forget rows n.. (after a failed prefill: their slots are free again)."""
        self.lengths = self.lengths[:n]
        self._views = None

    def _copy_prefix(self, slot: int, kv: list[np.ndarray] | None, n: int) -> None:
        """The first n cached tokens' K/V (a prompt cache entry) into `slot`."""
        if n > 0 and kv is not None and self.prompts is not None:
            for a, src in zip(self.buffers.arrays, kv):
                a[slot, :, :n] = src[:, :n]
            self.prompts.hits += 1
            self.prompts.tokens_reused += n

    def reuse_side(self, prompt: list[int]) -> int:
        """The side row's prompt, like admit's: its longest cached start copied into the last slot;
        returns how many tokens are there now (the chunked prefill goes on from there)."""
        row = self.side_view()
        if self.prompts is None:
            return 0
        kv, row.length = self.prompts.start(prompt)
        self._copy_prefix(self.slots - 1, kv, row.length)
        return row.length

    def remember(self, row: int, ids: list[int]) -> None:
        """Keep the K/V of row's prompt `ids` in the prompt cache, up to its last prefill boundary (call before
        it leaves). Only prefilled spans are kept: an answer's K/V come from decode steps, whose numbers
        differ from a prefill of the same tokens, so reusing them would make the next turn's answer depend
        on the cache."""
        m = boundary_at_or_below(min(len(ids), self.lengths[row]))
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

    def verify(self, tokens: list[int]) -> np.ndarray:
        """One row only (speculative decoding, edge.decode.speculative): feed several tokens in one call; returns the
        logits at each [len(tokens), vocab]. `rollback` then forgets what the target did not accept."""
        assert len(self.lengths) == 1 and tokens
        n, past = len(tokens), self.lengths[0]
        self._reserve(past + n)
        if self._views is None or self._views[0] != 1:
            self._views = (1, self._slots(0, 1)[1])
        logits = self.decoder.run_fused(np.asarray([tokens], dtype=np.int64), np.asarray([past + n - 1], np.int32),
                                        past + n, self._views[1])
        self.lengths[0] = past + n
        return logits[0]

    def rollback(self, length: int) -> None:
        """Row 0 keeps its first `length` tokens: the in-place buffer is read only up to the row's length, and
        the next call overwrites the stale columns."""
        self.lengths[0] = min(self.lengths[0], length)

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


class OneRowCache(_NoVerify):
    """One row, any graph, any device: a single user's answer on a fused graph whose K/V live on a GPU, where
    `SharedBatchCache` cannot go (it moves rows through numpy views of host memory). The row is a plain
    `Decoder.new_cache`, prefilled by `Decoder.prefill` and stepped by `Decoder.forward`: the calls a batch
    cache makes for one row. No prompt cache."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.row: KVCache | None = None
        self.side: KVCache | None = None
        self.lengths: list[int] = []
        self.reused = 0

    def fresh(self) -> "OneRowCache":
        return OneRowCache(self.decoder)

    def __len__(self) -> int:
        return len(self.lengths)

    def _new(self, prompt_len: int) -> KVCache:
        if self.row is not None or self.side is not None:
            raise EdgeChatError("this cache holds one row, and it is taken")
        return self.decoder.new_cache(capacity=max(prompt_len + 1, ONE_ROW_CAPACITY))

    def admit(self, prompt: list[int]) -> np.ndarray:
        row = self._new(len(prompt))
        logits = self.decoder.prefill(prompt, row)[0]
        self.row, self.lengths = row, [row.length]
        return logits

    def step(self, tokens: list[int]) -> np.ndarray:
        assert self.row is not None and len(tokens) == 1
        logits = self.decoder.forward(np.asarray([tokens], dtype=np.int64), self.row)
        self.lengths = [self.row.length]
        return logits

    def remove(self, rows: list[int]) -> None:
        if 0 in rows:
            self.row, self.lengths = None, []

    def remember(self, row: int, ids: list[int]) -> None:
        """No prompt cache here."""

    def side_row(self, prompt_len: int) -> KVCache:
        self.side = self._new(prompt_len)
        return self.side

    def reuse_side(self, prompt: list[int]) -> int:
        return 0

    def side_view(self) -> KVCache:
        assert self.side is not None
        return self.side

    def add_side(self) -> None:
        assert self.side is not None
        self.row, self.side, self.lengths = self.side, None, [self.side.length]

    def drop_side(self) -> None:
        self.side = None


ONE_ROW_CAPACITY = 256  # columns a OneRowCache allocates up front (as SharedBatchCache's default); it grows by doubling


def cache_kind(fused: bool, device: str = "cpu", slots: int = 1) -> type:
    """Which batch cache a graph calls for: a fused graph on a GPU serves one row at a time (`OneRowCache`;
    batching it there is refused by SharedBatchCache), on CPU shares one in-place buffer; a plain graph's
    rows are re-laid out per join (`BatchCache`)."""
    if fused and device != "cpu" and slots == 1:
        return OneRowCache
    return SharedBatchCache if fused else BatchCache


def can_verify(decoder: Decoder) -> bool:
    """Whether the scheduler's cache for this decoder checks drafts (its `can_verify`): asked before loading
    a draft model (edge-chat), read from the cache the decoder would get, never restated."""
    return cache_kind(decoder.io.fused, decoder.device).can_verify


def batch_cache(decoder: Decoder, slots: int, prompt_cache_bytes: int = 0) -> RowCache:
    """The batch cache the decoder's graph calls for (`cache_kind`; a prompt cache on fused graphs only)."""
    kind = cache_kind(decoder.io.fused, decoder.device, slots)
    if kind is SharedBatchCache:
        return SharedBatchCache(decoder, slots, prompt_cache_bytes=prompt_cache_bytes)
    return kind(decoder)
