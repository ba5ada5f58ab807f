"""Who gets into the decode loop's batch, and how: the scheduler's admission (edge.decode.scheduler).

Waiting requests are taken oldest first (one client's n answers take turns with other clients'), closed if they
went away while waiting, and prefilled into free rows between decode steps: prompts that arrive together in runs
that share one batched first call each (`Admission.prefill_batch_tokens`, on a cache that batches them), a prompt
the prompt cache has a start for from that start, a long prompt a span at a time into the side slot (one at a
time) while the others keep decoding. A prefilled row takes its first token at once (`Scheduler._accept`).

`Admitting` is the Scheduler's admission half, kept here so each file reads in one sitting; it uses the
scheduler's state (`rows`, `pending`, `cache`, `admission`, `prefilling`, `metrics`, `gen`, `max_batch`, `_cv`)
and its `_accept`, `_leave`, `_emit_final` and `_text`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edge.backends.decoder import next_boundary
from edge.decode.requests import Request
from edge.decode.sampling import Sampler
from edge.decode.text_stream import TextStream

if TYPE_CHECKING:
    from edge.decode.logits import RowLogits  # a row's logits processors (grammar, penalties) and logprobs

log = logging.getLogger("edgechat")


@dataclass
class _Row:
    req: Request
    sampler: Sampler
    text: TextStream
    seen: list[int]
    last: int = -1
    logits: "RowLogits | None" = None
    lps: list = field(default_factory=list)  # logprobs of tokens not yet handed over in an event

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


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class Admitting:
    """The Scheduler's admission (see the module docstring)."""

    def _free(self) -> int:
        return self.max_batch - len(self.rows) - (self.prefilling is not None)

    def _long(self, req: Request) -> bool:
        """Prefilled between decode steps (see Admission)."""
        return len(req.prompt_ids) > self.admission.long_prompt

    def _admit(self) -> bool:
        """Start waiting requests while rows are free; True when any was taken. Returns after one run of prompts
        that arrived together when rows are decoding, so they step before the next run (see `_prefill_group`)."""
        took = False
        while self._free() > 0 and not self._stop.is_set():
            batch = self._take(self._free())
            if not batch:
                return took
            took = True
            for req, row in batch:
                if self._long(req):  # _take hands out at most one, and only while none is in progress
                    self._start_prefill(req, row)
            later = self._prefill_group([(req, row) for req, row in batch if not self._long(req)])
            if later:
                with self._cv:  # back to the head of the queue, in their order: taken again after the step
                    self.pending.extendleft(reversed([req for req, _ in later]))
                return took
        return took

    def _prefill_group(self, group: list[tuple[Request, _Row]]) -> list[tuple[Request, _Row]]:
        """Short prompts taken together: those the prompt cache has something for are prefilled one at a time from
        their cached start; the others in consecutive runs that share one batched first call each
        (`cache.admit_together`: users who arrive together wait for one call, not for each other's prefill in
        turn), a run as large as `Admission.prefill_batch_tokens` allows (rows x the longest first span: by default
        one span's worth, so chat prompts go one after another). Only the first run is prefilled while rows are
        decoding: the others are returned, to wait at the head of the queue for one decode step, so each admitted
        answer goes on (its first token, then the next) while later prompts are prefilled, the way chunked
        prefill mixes prefills and steps. A request gone meanwhile is closed, not prefilled. A failed batched
        call is retried one prompt at a time, so a failure stays with the request that causes it."""
        fresh = [g for g in group if self.cache.cached_start(g[0].prompt_ids) == 0] if len(group) > 1 else []
        for req, row in group:
            if not any(req is r for r, _ in fresh):
                self._prefill(req, row)
        runs = self._call_groups(fresh)
        for i, run in enumerate(runs):
            if i and self.rows:  # someone is decoding: it steps first
                return [g for later in runs[i:] for g in later]
            run = [(req, row) for req, row in run if not self._closed_if_gone(req, row.text)]
            if len(run) == 1:
                self._prefill(*run[0])
            elif run:
                self._prefill_together(run)
        return []

    def _closed_if_gone(self, req: Request, text: TextStream) -> bool:
        """A request cancelled or timed out while it waited gets its final event here, and is not prefilled."""
        why = req.gone()
        if why:
            self._emit_final(req, text, why)
        return bool(why)

    def _call_groups(self, fresh: list[tuple[Request, _Row]]) -> list[list[tuple[Request, _Row]]]:
        """`fresh` in arrival order, cut into runs whose batched first call (rows x the longest first span)
        stays within `Admission.prefill_batch_tokens` (0: no limit; a prompt alone may exceed it). One prompt a run
        on a cache whose `admit_together` is not one call (it would only make each user wait for the others)."""
        budget = self.admission.prefill_batch_tokens if self.cache.batches_first_prefill else 1
        groups: list[list[tuple[Request, _Row]]] = []
        widest = 0
        for g in fresh:
            span = min(len(g[0].prompt_ids), next_boundary(0))
            if groups and (not budget or (len(groups[-1]) + 1) * max(widest, span) <= budget):
                groups[-1].append(g)
                widest = max(widest, span)
            else:
                groups.append([g])
                widest = span
        return groups

    def _prefill_together(self, together: list[tuple[Request, _Row]]) -> None:
        """One batched first call for `together` (see `_prefill_group`); each row joins and takes its first token."""
        try:
            logits = self.cache.admit_together([req.prompt_ids for req, _ in together])
        except Exception:
            log.debug("a batched prefill of %d prompts failed; prefilling them one at a time", len(together),
                      exc_info=True)
            for req, row in together:
                self._prefill(req, row)
            return
        start = len(self.rows)
        for _, row in together:
            row.text.cached_tokens = 0
            self.rows.append(row)
        finished = [start + i for i, (req, row) in enumerate(together)
                    if not self._accept(row, logits[i], len(req.prompt_ids))]
        if self.metrics is not None:
            for req, _ in together:
                self.metrics.observe_prompt(len(req.prompt_ids), cached=0)
        if finished:
            self._leave(finished)

    def _take(self, free: int) -> list[tuple[Request, _Row]]:
        """Up to `free` waiting requests (cancelled ones are closed here), oldest first. A long prompt
        waits at the head of the queue while another is being prefilled (one side slot)."""
        out = []
        while len(out) < free:
            with self._cv:
                if not self.pending:
                    break
                pick = self._next_pending(out)
                head = self.pending[pick]
                if self._long(head) and (self.prefilling is not None or any(self._long(r) for r, _ in out)):
                    break
                req = head
                del self.pending[pick]
            text = self._text(req)
            if self._closed_if_gone(req, text):
                continue
            try:
                sampler = Sampler(req.cfg)
            except Exception as e:  # a sampling option the request's validation missed: fail this one only
                self._emit_final(req, text, "error", f"cannot sample with these options: {_why(e)}")
                continue
            out.append((req, _Row(req, sampler, text, list(req.prompt_ids), logits=req.logits)))
        return out

    def _next_pending(self, taken: list[tuple[Request, _Row]]) -> int:
        """Which waiting request goes next: the oldest of the request group with the fewest rows running (or
        just taken), so one client's n answers take turns with other clients instead of going first."""
        running: dict[int, int] = {}
        for r in self.rows:
            running[r.req.group] = running.get(r.req.group, 0) + 1
        for r, _ in taken:
            running[r.group] = running.get(r.group, 0) + 1
        best, best_n = 0, None
        for i, r in enumerate(self.pending):
            n = running.get(r.group, 0) if r.group else 0
            if best_n is None or n < best_n:
                best, best_n = i, n
                if n == 0:
                    break
        return best

    def _prefill(self, req: Request, row: _Row) -> None:
        """Prefill the prompt into a new row (after its cached start, if the cache has one); it joins the batch."""
        try:
            logits = self.cache.admit(req.prompt_ids)
        except Exception as e:
            self._emit_final(req, row.text, "error", _why(e))
            return
        self._joined(row, logits, self.cache.reused)

    def _joined(self, row: _Row, logits: np.ndarray, cached: int) -> None:
        """A prefilled row is the batch's last: take its first token (it leaves again if that ends it)."""
        row.text.cached_tokens = cached
        self.rows.append(row)
        if not self._accept(row, logits, len(row.req.prompt_ids)):
            self._leave([len(self.rows) - 1])
        if self.metrics is not None:
            self.metrics.observe_prompt(len(row.req.prompt_ids), cached=cached)

    def _start_prefill(self, req: Request, row: _Row) -> None:
        try:
            self.cache.side_row(len(req.prompt_ids))
            cached = self.cache.reuse_side(req.prompt_ids)  # a long chat's next turn: only the new part runs
        except Exception as e:
            self.cache.drop_side()
            self._emit_final(req, row.text, "error", _why(e))
            return
        row.text.cached_tokens = cached
        self.prefilling = _Prefilling(req, row, done=cached, cached=cached)

    def _prefill_next_chunk(self) -> None:
        """One span of the long prompt into the side slot; on the last one it joins the batch."""
        p = self.prefilling
        assert p is not None
        why = p.req.gone()
        if why:
            self.cache.drop_side()
            self.prefilling = None
            self._emit_final(p.req, p.row.text, why)
            return
        ids = p.req.prompt_ids
        end = p.done + (self.admission.interleaved_span or self.gen.decoder.prefill_span(p.done))
        chunk = np.asarray(ids[p.done: end], dtype=np.int64)
        try:
            logits = self.gen.decoder.forward(chunk, self.cache.side_view())[0]
        except Exception as e:
            self.cache.drop_side()
            self.prefilling = None
            self._emit_final(p.req, p.row.text, "error", _why(e))
            return
        p.done += len(chunk)
        if p.done < len(ids):
            return
        self.prefilling = None
        self.cache.add_side()
        self._joined(p.row, logits, p.cached)
