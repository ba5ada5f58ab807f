"""What a client hands the decode loop (edge.decode.scheduler) and what it may be refused: a `Request` (one
answer: its prompt, sampling config, events, deadline, cancel flag), the admission policy's numbers
(`Admission`), and the errors of admission (`QueueFullError`) and of a stepped job (`JobGone`)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from edge.backends.decoder import PREFILL_BOUNDARY_FIRST
from edge.decode.sampling import SamplingConfig
from edge.decode.text_stream import StreamEvent
from edge.errors import EdgeChatError

if TYPE_CHECKING:
    from edge.decode.logits import RowLogits  # a row's logits processors (grammar, penalties) and logprobs

log = logging.getLogger("edgechat")


class QueueFullError(EdgeChatError):
    """Every slot is busy and the waiting queue is full: the client should retry later."""

    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"the server is busy ({waiting} requests waiting): retry in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class JobGone(EdgeChatError):
    """A stepped job (Scheduler.call_steps) stopped because its client left or its time ran out."""

    def __init__(self, why: str) -> None:
        super().__init__(f"stopped: {why}")
        self.why = why


_ids = itertools.count(1)


def next_id() -> int:
    """A fresh id for a request or a group of requests (one client request's rows)."""
    return next(_ids)


@dataclass
class Admission:
    """Who gets in when: every number the scheduler's admission policy uses, in one place.

    - A prompt longer than `long_prompt` tokens is prefilled a span at a time between decode steps (one
      such prompt at a time, in a side row), so the users already streaming do not freeze for its whole
      prefill; shorter prompts are prefilled at once when a row is free.
    - `interleaved_span`: tokens of a long prompt prefilled between two steps; None = the decoder's own
      `prefill_span` (up to the next prefill boundary, <= 128 tokens, on a fused graph), so the prompt runs
      the calls it would run alone. Benchmarks set it to compare "all at once".
    - `prefill_batch_tokens`: prompts that arrive together share batched first-prefill calls of at most this many
      tokens (rows x the longest first span; `serve --prefill-batch-tokens`), 0 = no limit (all in one call), on
      a cache that batches them (the fused graph's on CPU; the others prefill each prompt alone). 64, one first
      span: ONNX Runtime's CPU kernels cost about the same per prompt token from a few dozen rows a call, so a
      larger call saves nothing and makes every user in it wait for all the others' prompts (8 chat prompts
      together, with a decode step between runs: TTFT p50 353 ms in one call, 123 ms in runs, the second chunk
      412 -> 150 ms, same tokens/s; docs/speed.md).
    - A request is refused (429, Retry-After) when `max_queue` are already waiting and every row is taken;
      Retry-After is `retry_steps` decode steps at the running mean step time (a typical answer's rest).
    """

    long_prompt: int = 512
    interleaved_span: int | None = None
    prefill_batch_tokens: int = PREFILL_BOUNDARY_FIRST
    max_queue: int = 32
    retry_steps: int = 64


ADMISSION = Admission()  # the defaults every Scheduler starts from (its max_queue is the constructor's)


@dataclass
class Request:
    """One answer being generated. `cancel()` frees its slot before the next step; so does passing `deadline`
    (time.perf_counter seconds), which ends it with finish_reason "timeout"."""

    prompt_ids: list[int]
    cfg: SamplingConfig
    on_event: Callable[[StreamEvent], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    deadline: float | None = None
    logits: "RowLogits | None" = None  # this answer's logits processors and logprobs wish (edge.decode.logits)
    group: int = 0  # the rows of one client request share a group: admission takes turns between groups
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    _queue: "queue.Queue[StreamEvent]" = field(default_factory=queue.Queue, repr=False)

    def emit(self, ev: StreamEvent) -> None:
        try:
            (self.on_event or self._queue.put)(ev)
        except Exception as e:  # its consumer is gone (e.g. the server's event loop closed): stop serving it
            log.warning("request %d: could not hand over an event (%s: %s); cancelling it", self.id,
                        type(e).__name__, e)
            self.cancelled.set()
        if ev.finish_reason:
            self.done.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def gone(self) -> str | None:
        """Why this request is no longer wanted ("cancelled", "timeout"), or None."""
        if self.cancelled.is_set():
            return "cancelled"
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return "timeout"
        return None

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
