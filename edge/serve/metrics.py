"""Serving metrics in the Prometheus text format (no client library needed on the device).

Counters and histograms are updated from the scheduler thread and the HTTP
handlers; `render()` writes the exposition text for `GET /metrics`.
"""

from __future__ import annotations

import threading
from collections import defaultdict

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKS_BUCKETS = (1, 5, 10, 20, 40, 80, 160, 320, 640)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6g}", f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished: dict[str, int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.completion_tokens = 0
        self.steps = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tok_s = Histogram(TOKS_BUCKETS)
        self.batch = Histogram(BATCH_BUCKETS)
        self.peak_batch = 0
        self.http_errors: dict[int, int] = defaultdict(int)

    def http_error(self, status: int) -> None:
        """An error response (or, on a stream already answered 200, an error event) with this status."""
        with self._lock:
            self.http_errors[status] += 1

    def observe_prompt(self, n: int, cached: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += n
            self.cached_prompt_tokens += cached

    def observe_step(self, batch: int) -> None:
        with self._lock:
            self.steps += 1
            self.batch.observe(batch)
            self.peak_batch = max(self.peak_batch, batch)

    def observe_finish(self, reason: str | None, stats: dict) -> None:
        with self._lock:
            self.finished[reason or "unknown"] += 1
            n = stats.get("completion_tokens", 0)
            self.completion_tokens += n
            if n:
                self.ttft.observe(stats.get("ttft_s", 0.0))
            if n > 1:
                self.tok_s.observe(stats.get("decode_tok_s", 0.0))

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def render(self, active: int, queued: int, max_batch: int, restarts: int = 0) -> str:
        with self._lock:
            out = ["# HELP edgechat_requests_total Finished requests by finish reason.",
                   "# TYPE edgechat_requests_total counter"]
            out += [f'edgechat_requests_total{{finish="{k}"}} {v}' for k, v in sorted(self.finished.items())]
            out += ["# HELP edgechat_requests_rejected_total Requests refused before generation, by reason.",
                    "# TYPE edgechat_requests_rejected_total counter"]
            out += [f'edgechat_requests_rejected_total{{reason="{k}"}} {v}' for k, v in sorted(self.rejected.items())]
            out += ["# HELP edgechat_http_errors_total Error responses (and error events on streams) by HTTP status.",
                    "# TYPE edgechat_http_errors_total counter"]
            out += [f'edgechat_http_errors_total{{status="{k}"}} {v}' for k, v in sorted(self.http_errors.items())]
            out += ["# HELP edgechat_scheduler_restarts_total Times the scheduler loop failed and was restarted.",
                    "# TYPE edgechat_scheduler_restarts_total counter", f"edgechat_scheduler_restarts_total {restarts}"]
            out += ["# TYPE edgechat_prompt_tokens_total counter", f"edgechat_prompt_tokens_total {self.prompt_tokens}",
                    "# HELP edgechat_prompt_tokens_cached_total Prompt tokens taken from the prompt cache, not prefilled.",
                    "# TYPE edgechat_prompt_tokens_cached_total counter",
                    f"edgechat_prompt_tokens_cached_total {self.cached_prompt_tokens}",
                    "# TYPE edgechat_completion_tokens_total counter",
                    f"edgechat_completion_tokens_total {self.completion_tokens}",
                    "# TYPE edgechat_decode_steps_total counter", f"edgechat_decode_steps_total {self.steps}",
                    "# HELP edgechat_ttft_seconds Time from request to first token (queue wait included).",
                    "# TYPE edgechat_ttft_seconds histogram", *self.ttft.lines("edgechat_ttft_seconds"),
                    "# HELP edgechat_decode_tokens_per_second Per-request decode speed.",
                    "# TYPE edgechat_decode_tokens_per_second histogram",
                    *self.tok_s.lines("edgechat_decode_tokens_per_second"),
                    "# HELP edgechat_batch_size Sequences per decode step.",
                    "# TYPE edgechat_batch_size histogram", *self.batch.lines("edgechat_batch_size"),
                    "# TYPE edgechat_active_requests gauge", f"edgechat_active_requests {active}",
                    "# TYPE edgechat_queue_depth gauge", f"edgechat_queue_depth {queued}",
                    "# TYPE edgechat_max_batch gauge", f"edgechat_max_batch {max_batch}"]
        return "\n".join(out) + "\n"
