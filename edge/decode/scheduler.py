"""The decode loop: every answer, one user's or many users', is generated here.

Continuous batching: many conversations share one decode step. Each active request owns a row of one
batched KV cache (edge.decode.cache). A single-user generation (the CLI, the REPL, the export's evaluation)
is this same loop with one row, run in the caller's thread (`Scheduler.generate`); the server runs it
on its own thread. New requests join the batch between steps; requests that arrive together share batched
calls for their prompts' first prefill span (a short chat prompt's whole prefill), as many per call as
`Admission.prefill_batch_tokens` allows (chat prompts one after another: a larger call is no cheaper per token),
each row computing what its prefill alone computes (the calls are fixed by position, so an answer does not depend on who arrived with it or
on what the prompt cache held, where the engine is batch invariant: edge.backends.determinism). On a fused graph a long prompt is prefilled a span at a time into the last slot, one span
between decode steps, so the answers already streaming keep streaming instead of freezing for the
whole prefill; it then joins the batch. A finished, cancelled or timed-out request leaves at once and
its slot is free for the next step; on a fused graph its prompt's K/V go into the prompt cache.

Speculative decoding is a kind of step, not a loop of its own: a proposer (`speculator`, e.g.
edge.decode.speculative.RowSpeculator) only proposes draft tokens for a lone row; the scheduler checks them
in one call (`RowCache.verify`), takes each token through `_accept` as a plain step would, and rolls the
cache back past the first token the target did not agree with. `steps` counts every decode step, plain or
speculative: the build's draft acceptance and the evaluate stage's speed are measured through this loop.

One request cannot stop the others: an error while serving a request fails that request (its
consumer gets a final event with finish_reason "error"), and a supervisor restarts the loop if it
ever fails as a whole (counted in `restarts`, reported by /health). The scheduler thread is the only
caller of the ONNX Runtime session. Consumers get `StreamEvent`s through a callback, so a slow
reader never holds up the others.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import numpy as np

from edge.decode.admission import Admitting, _Prefilling, _Row, _why
from edge.decode.cache import PROMPT_CACHE_MB, batch_cache
from edge.errors import ContextOverflowError, EdgeChatError
from edge.decode.sampling import SamplingConfig
from edge.decode.text_stream import StreamEvent, TextStream
from edge.decode.requests import ADMISSION, Admission, JobGone, QueueFullError, Request, next_id  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from edge.backends.decoder import Decoder
    from edge.decode.tokenizer import ChatTokenizer
    from edge.decode.logits import RowLogits  # a row's logits processors (grammar, penalties) and logprobs

log = logging.getLogger("edgechat")


class Proposer(Protocol):
    """What proposes drafts for the scheduler's speculative step (edge.decode.speculative.RowSpeculator)."""

    def propose(self, row: "_Row | None", room: int) -> list[int]:
        """Up to `room` draft tokens to follow the lone row's `seen` tokens (`row` None: no row can be drafted
        for this step, e.g. a second user); [] for a plain step."""
        ...

    def checked(self, drafted: int, accepted: int) -> None:
        """The scheduler checked the proposed draft: `accepted` of its `drafted` tokens were kept."""
        ...

    def interrupted(self) -> None:
        """The scheduler did other work between steps (admitted a request, ran a call)."""
        ...


class Model(Protocol):
    """What the loop reads of the model it serves: its decoder, tokenizer and context. The Generator (which
    owns a Scheduler) is one; the loop needs nothing else of it."""

    decoder: "Decoder"
    tokenizer: "ChatTokenizer"
    max_context: int


class Scheduler(Admitting):
    """Admits requests into up to `max_batch` rows and runs batched decode steps on one thread."""

    def __init__(self, gen: Model, max_batch: int = 8, max_queue: int = 32, metrics=None,
                 prompt_cache_mb: float = PROMPT_CACHE_MB) -> None:
        if max_batch < 1 or max_queue < 0:
            raise EdgeChatError(f"max_batch must be >= 1 and max_queue >= 0 (got {max_batch}, {max_queue})")
        if prompt_cache_mb < 0:
            raise EdgeChatError(f"the prompt cache size must be >= 0 MB (0 turns it off), got {prompt_cache_mb}")
        self.gen = gen
        limit = gen.decoder.max_batch
        if limit is not None and max_batch > limit:
            log.warning("serving at most %d users at once: engine %s decodes at most %d sequences per step "
                        "(rebuild it with --max-batch %d for more)", limit, gen.decoder.name, limit, max_batch)
            max_batch = limit
        self.max_batch = max_batch
        self.admission = dataclasses.replace(ADMISSION, max_queue=max_queue)
        self.metrics = metrics
        self.pending: deque[Request] = deque()
        self.rows: list[_Row] = []
        self.prompt_cache_bytes = int(prompt_cache_mb * 2**20)
        self.cache = batch_cache(gen.decoder, max_batch, self.prompt_cache_bytes)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step_s = 0.05  # running mean of one decode step, for Retry-After
        self.prefilling: _Prefilling | None = None  # a long prompt prefilled between decode steps (Admitting)
        self.error: str | None = None  # the last failure of the loop as a whole (it was restarted)
        self.restarts = 0
        self._calls: deque = deque()  # (fn, Future): run on the scheduler thread between steps (see call)
        self._jobs: deque = deque()  # (steps, gone, Future): one step each between decode steps (see call_steps)
        self.speculator: Proposer | None = None  # drafts for speculative steps while one row decodes alone
        self.steps = 0  # decode steps run (plain or speculative), prefills not counted
        self.speculate_greedy = True  # the server turns it off: served greedy answers must not depend on timing

    # -- client side -----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], cfg: SamplingConfig,
               on_event: Callable[[StreamEvent], None] | None = None, timeout_s: float | None = None,
               logits: "RowLogits | None" = None) -> Request:
        """Queue a request; `timeout_s` ends it (finish_reason "timeout", slot freed) that long after now;
        `logits` (edge.decode.logits.RowLogits) processes its row's logits before sampling and records logprobs."""
        req = self._request(prompt_ids, cfg, on_event, timeout_s, logits)
        if self._stop.is_set() or self._thread is None:
            raise EdgeChatError("the scheduler is not running")
        if not self._thread.is_alive():  # died past its supervisor (it should not): start it again
            self._restart_thread("the scheduler thread had stopped")
        with self._cv:
            if len(self.pending) >= self.admission.max_queue and len(self.rows) + len(self.pending) >= self.max_batch:
                raise QueueFullError(len(self.pending), self.retry_after())
            self.pending.append(req)
            self._cv.notify()
        return req

    def submit_group(self, rows: list[tuple[list[int], SamplingConfig, "RowLogits | None"]],
                     on_event: Callable[[int, StreamEvent], None], timeout_s: float | None = None) -> list[Request]:
        """Queue the rows of one client request (its n answers) all or none: they count as len(rows) places in
        the queue, so a request with n=16 is refused (429) where a one-row request would still get in, and
        admission then takes turns between requests (see _take) instead of serving one request's rows first.
        A request may hold at most `max_rows_per_request` rows (EdgeChatError: a 400)."""
        if len(rows) > self.max_rows_per_request:
            raise EdgeChatError(f"this request asks for {len(rows)} answers; this server takes at most "
                                f"{self.max_rows_per_request} per request (--max-users and --max-queue): ask for fewer")
        group = next_id()
        reqs = [self._request(p, cfg, (lambda ev, i=i: on_event(i, ev)), timeout_s, lg)
                for i, (p, cfg, lg) in enumerate(rows)]
        for r in reqs:
            r.group = group
        if self._stop.is_set() or self._thread is None:
            raise EdgeChatError("the scheduler is not running")
        if not self._thread.is_alive():
            self._restart_thread("the scheduler thread had stopped")
        with self._cv:
            free = self.max_batch - len(self.rows) - len(self.pending)
            if len(reqs) > free and len(self.pending) + len(reqs) > self.admission.max_queue + max(free, 0):
                raise QueueFullError(len(self.pending), self.retry_after())
            self.pending.extend(reqs)
            self._cv.notify()
        return reqs

    @property
    def max_rows_per_request(self) -> int:
        """Rows one request may queue: all the slots, or half the queue if that is more, so one request never
        holds every queue place."""
        return max(self.max_batch, self.admission.max_queue // 2)

    def _request(self, prompt_ids: list[int], cfg: SamplingConfig, on_event: Callable[[StreamEvent], None] | None,
                 timeout_s: float | None = None, logits: "RowLogits | None" = None) -> Request:
        if not prompt_ids:
            raise EdgeChatError("the prompt is empty")
        if len(prompt_ids) >= self.gen.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.gen.max_context}: shorten it")
        req = Request(list(prompt_ids), cfg, on_event, logits=logits)
        if timeout_s is not None:
            req.deadline = req.submitted + timeout_s
        return req

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, cancel: threading.Event | None = None,
                 logits: "RowLogits | None" = None) -> Iterator[StreamEvent]:
        """One request run to its end in the caller's thread, on a scheduler that was not `start`ed: the
        single-user path, through the same admission, steps and sampling as a served request. Setting
        `cancel` (or closing the iterator) ends it; a failure raises instead of ending with "error"."""
        if self._thread is not None:
            raise EdgeChatError("generate() runs requests in the caller's thread: use submit() on a started scheduler")
        events: list[StreamEvent] = []
        req = self._request(prompt_ids, cfg, events.append, logits=logits)
        if cancel is not None:
            req.cancelled = cancel
        self.pending.append(req)
        try:
            while not req.done.is_set():
                self._admit()
                self._drop_unwanted()
                if self.rows:
                    self._step()
                if self.prefilling is not None:
                    self._prefill_next_chunk()
                for ev in events:
                    if ev.finish_reason == "error":
                        raise EdgeChatError(f"generation failed: {ev.stats.get('error', 'unknown error')}")
                    yield ev
                events.clear()
        finally:
            if not req.done.is_set():  # the consumer stopped early: leave nothing behind in the cache
                self._fail_in_flight("cancelled")
                self.pending.clear()
                self._reset()

    @property
    def _fail_level(self) -> int:
        """A request's failure is logged with its traceback when served; `generate` raises it to its caller instead
        (the CLIs print one line), so there it is a debug record."""
        return logging.ERROR if self._thread is not None else logging.DEBUG

    def retry_after(self) -> float:
        """Rough seconds until a slot frees: a typical answer's remaining steps."""
        return max(1.0, round(self.step_s * self.admission.retry_steps))

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    @property
    def active(self) -> int:
        return len(self.rows) + (self.prefilling is not None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._supervise, name="edgechat-scheduler", daemon=True)
        self._thread.start()
        return self

    def _restart_thread(self, why: str) -> None:
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self.restarts += 1
            self.error = why
            log.error("restarting the scheduler: %s", why)
            self._reset()
            self.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything in flight and wait for the loop to end."""
        self._stop.set()
        with self._cv:
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- scheduler thread -------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Run the loop; if it fails as a whole, fail what was in flight, start over with a fresh batch cache
        (the waiting requests stay queued) and run it again, until stop()."""
        try:
            while not self._stop.is_set():
                try:
                    self._loop()
                except Exception as e:
                    self.restarts += 1
                    self.error = _why(e)
                    log.exception("the scheduler loop failed (restart %d); failing the requests in flight", self.restarts)
                    self._fail_in_flight("error", self.error)
                    self._reset()
                    self._stop.wait(min(1.0, 0.01 * 2 ** min(self.restarts, 7)))  # a loop that keeps failing backs off
        finally:
            with self._cv:
                waiting, self.pending = list(self.pending), deque()
            for r in waiting:
                self._emit_final(r, self._text(r), "cancelled")
            while self._calls:
                self._calls.popleft()[1].cancel()
            while self._jobs:
                self._jobs.popleft()[2].cancel()
            self._fail_in_flight("cancelled")

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the scheduler thread between steps (it is the decoder's only caller): e.g. scoring a
        prompt for /v1/completions' echo. The future holds its result or its exception."""
        fut: Future = Future()
        with self._cv:
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def call_steps(self, steps: Iterator[object], gone: Callable[[], str | None] = lambda: None) -> Future:
        """Run a long job on the scheduler thread one bounded step at a time, one step between two decode steps
        (scoring a long prompt for echo + logprobs: a chunk of the prompt per step), so the answers streaming
        meanwhile keep streaming. `steps` yields after each chunk and returns its result (StopIteration's value);
        `gone()` (a hang-up, a timeout) says why to stop it: the future then raises JobGone."""
        fut: Future = Future()
        with self._cv:
            self._jobs.append((steps, gone, fut))
            self._cv.notify()
        return fut

    def _run_job_step(self) -> bool:
        """One step of the oldest job (jobs take turns); True when one ran."""
        if not self._jobs:
            return False
        steps, gone, fut = self._jobs.popleft()
        if fut.cancelled():
            return True
        why = gone()
        if why:
            fut.set_exception(JobGone(why))
            return True
        try:
            next(steps)
        except StopIteration as done:
            fut.set_result(done.value)
            return True
        except BaseException as e:  # the caller gets it; the loop goes on
            fut.set_exception(e)
            return True
        self._jobs.append((steps, gone, fut))
        return True

    def _run_calls(self) -> bool:
        """Run the queued calls; True when any ran."""
        ran = bool(self._calls)
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller gets it; the loop goes on
                    fut.set_exception(e)
        return ran

    def _loop(self) -> None:
        while not self._stop.is_set():
            ran = self._run_calls()
            ran = self._run_job_step() or ran
            took = self._admit()
            if (ran or took) and self.speculator is not None:
                self.speculator.interrupted()  # this step's time is not a lone row's step
            if not self.rows and self.prefilling is None:
                with self._cv:
                    if not self.pending and not self._calls and not self._jobs and not self._stop.is_set():
                        self._cv.wait(0.5)
                continue
            self._drop_unwanted()
            if self.rows:
                self._step()
            if self.prefilling is not None:
                self._prefill_next_chunk()

    def _fail_in_flight(self, reason: str, error: str | None = None) -> None:
        if self.prefilling is not None:
            self._emit_final(self.prefilling.req, self.prefilling.row.text, reason, error)
            self.prefilling = None
        for r in self.rows:
            self._emit_final(r.req, r.text, reason, error)
        self.rows = []

    def _reset(self) -> None:
        """A fresh batch cache (the old one may be half-updated); the prompt cache's copies stay valid."""
        self.rows, self.prefilling = [], None
        self.cache = self.cache.fresh()

    def _text(self, req: Request) -> TextStream:
        text = TextStream(self.gen.tokenizer, req.cfg, len(req.prompt_ids), self.gen.max_context)
        text.t0 = req.submitted  # TTFT counts the time spent waiting in the queue
        return text

    def _accept(self, row: _Row, logits: np.ndarray, length: int) -> bool:
        """Sample the row's next token and emit it; False when the answer is finished (and closed). An error
        here (in the logits processors, the sampler, the detokenizer, the consumer) fails this row only."""
        cfg = row.req.cfg
        lg = row.logits
        try:
            x = lg.process(logits) if lg is not None else logits
            tok = row.sampler(x, np.asarray(row.seen) if cfg.repetition_penalty != 1.0 else None)
            if (tok in self.gen.tokenizer.eos_ids and not cfg.ignore_eos) or (lg is not None and tok in lg.stop_ids):
                self._emit_final(row.req, row.text, "stop", lps=row.lps)
                return False
            if lg is not None:
                lp = lg.accept(tok, logits)
                if lp is not None:
                    row.lps.append(lp)
            ev = row.text.push(tok)
            if ev is not None:
                ev.logprobs, row.lps = row.lps, []
                row.req.emit(ev)
        except Exception as e:
            log.log(self._fail_level, "request %d failed", row.req.id, exc_info=True)
            self._emit_final(row.req, row.text, "error", _why(e))
            return False
        row.seen.append(tok)
        row.last = tok
        if row.text.stopped or (lg is not None and lg.finished):
            self._emit_final(row.req, row.text, "stop", lps=row.lps)
            return False
        if row.n >= cfg.max_new_tokens or length + 1 >= self.gen.max_context:
            self._emit_final(row.req, row.text, "length", lps=row.lps)
            return False
        why = row.req.gone()
        if why:
            self._emit_final(row.req, row.text, why)
            return False
        return True

    def _drop_unwanted(self) -> None:
        """Rows whose client left or whose time ran out leave before the next step."""
        gone = [(i, r.req.gone()) for i, r in enumerate(self.rows)]
        gone = [(i, why) for i, why in gone if why]
        if gone:
            for i, why in gone:
                self._emit_final(self.rows[i].req, self.rows[i].text, why)
            self._leave([i for i, _ in gone])

    def _draftable(self) -> _Row | None:
        """The row a draft may be proposed for: the only one, nothing being prefilled beside it, on a cache that
        verifies drafts, with no logits processors (grammar, logprobs) and no seed (a verify call's logits differ
        in the last bits from a single step's on quantized engines, and a seeded answer must not depend on
        whether the pacer, timing this machine, chose to draft). With `speculate_greedy` off (the server) a
        greedy row is not drafted for either: the same greedy request asked twice must give the same answer
        (issue 45 row 12)."""
        if len(self.rows) != 1 or self.prefilling is not None or not self.cache.can_verify:
            return None
        row = self.rows[0]
        if row.logits is not None or row.req.cfg.seed is not None:
            return None
        return None if row.req.cfg.greedy and not self.speculate_greedy else row

    def _step(self) -> None:
        self.steps += 1
        if self.speculator is not None:
            row = self._draftable()
            room = 0 if row is None else min(row.req.cfg.max_new_tokens - row.n,
                                             self.gen.max_context - self.cache.lengths[0] - 2)
            draft = self.speculator.propose(row, room)[:max(room, 0)]
            if row is not None and draft:
                self._speculative_step(row, draft)
                return
        t = time.perf_counter()
        try:
            logits = self.cache.step([r.last for r in self.rows])
        except Exception as e:  # the step itself failed: its rows cannot go on; the rest of the queue can
            self._step_failed(e)
            return
        self.step_s = 0.9 * self.step_s + 0.1 * (time.perf_counter() - t)
        if self.metrics is not None:
            self.metrics.observe_step(len(self.rows))
        finished = [i for i, r in enumerate(self.rows) if not self._accept(r, logits[i], self.cache.lengths[i])]
        if finished:
            self._leave(finished)

    def _speculative_step(self, row: _Row, draft: list[int]) -> None:
        """One target call checks the lone row's last token and the draft after it. Each position's token is
        taken by `_accept` (the row's own sampler: a draft token is kept when it is the pick, which for a
        point-mass draft is speculative sampling, so sampled tokens follow the sampler's distribution exactly;
        EOS, stop strings and limits end the answer as a plain step would); the cache then forgets everything
        after the first token that was not the draft's (a correction, or the bonus when all were kept)."""
        base = self.cache.lengths[0]
        try:
            logits = self.cache.verify([row.last] + draft)
        except Exception as e:
            self._step_failed(e)
            return
        for i in range(len(draft) + 1):
            if not self._accept(row, logits[i], base + i + 1):  # the answer ended at this token
                self.cache.rollback(base + i + 1)
                self._leave([0])
                break
            if i == len(draft) or row.last != draft[i]:
                self.cache.rollback(base + i + 1)
                break
        assert self.speculator is not None
        self.speculator.checked(len(draft), i)

    def _step_failed(self, e: Exception) -> None:
        """A decode step itself failed: its rows cannot go on (each ends with "error"); the rest of the queue can."""
        log.log(self._fail_level, "a decode step failed; failing its %d rows", len(self.rows), exc_info=True)
        for r in self.rows:
            self._emit_final(r.req, r.text, "error", _why(e))
        self.rows = []
        self.cache.remove(list(range(len(self.cache))))

    def _leave(self, rows: list[int]) -> None:
        """Rows whose answers ended leave the batch; a fused graph's prompt cache keeps their prompts' K/V."""
        for i in rows:
            self.cache.remember(i, self.rows[i].req.prompt_ids)
        self.cache.remove(rows)
        gone = set(rows)
        self.rows = [r for i, r in enumerate(self.rows) if i not in gone]

    def _emit_final(self, req: Request, text: TextStream, reason: str, error: str | None = None,
                    lps: list | None = None) -> None:
        if req.done.is_set():
            return
        events = text.finish(reason=reason)
        if lps:
            events[0].logprobs = list(lps)
        if error:
            events[-1].stats["error"] = error
        for ev in events:
            req.emit(ev)
        if self.metrics is not None:
            self.metrics.observe_finish(events[-1].finish_reason, events[-1].stats)
