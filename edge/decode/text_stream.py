"""One answer's token ids in, text events out: incremental detokenizing, stop strings, finish reason, stats.

The decode loop (edge.decode.scheduler) feeds every row's tokens through a `TextStream`, so every answer ends
the same way whoever asked for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from edge.decode.sampling import SamplingConfig
from edge.decode.tokenizer import ChatTokenizer


@dataclass
class StreamEvent:
    """A piece of generated text; the last event carries finish_reason and stats."""

    text: str
    finish_reason: str | None = None  # stop | length | cancelled | timeout | error
    token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    logprobs: list | None = None  # edge.decode.logits.TokenLogprob of the tokens this event hands over, when asked for


class TextStream:
    """One answer's token ids in, StreamEvents out: incremental text, stop strings, finish reason, stats."""

    def __init__(self, tokenizer: ChatTokenizer, cfg: SamplingConfig, prompt_len: int, max_context: int) -> None:
        self.cfg = cfg
        self.prompt_len = prompt_len
        self.max_context = max_context
        self.detok = tokenizer.streamer()
        self.held = ""  # text that might be the start of a stop string
        self.ids: list[int] = []
        self.stopped = False  # a stop string was hit
        self.stop_hit: str | None = None  # which one (Anthropic's answer names it: stop_sequence)
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prompt cache (not prefilled)

    def push(self, tok: int) -> StreamEvent | None:
        self.ids.append(tok)
        if self.first is None:
            self.first = time.perf_counter()
        self.held += self.detok.push(tok)
        out, self.held, self.stop_hit = _split_stop(self.held, self.cfg.stop)
        self.stopped = self.stop_hit is not None
        return StreamEvent(out, token_ids=[tok]) if out else None

    def finish(self, reason: str) -> list[StreamEvent]:
        """Flush held text and close with `reason` (stop, length, cancelled, timeout, error; EOS is stop);
        a stop string already hit, or found in the flushed text, makes it "stop"."""
        events = []
        if self.stopped:
            reason = "stop"
        else:
            self.held += self.detok.flush()
            out, _, self.stop_hit = _split_stop(self.held, self.cfg.stop, final=True)
            if self.stop_hit is not None:
                reason = "stop"
            if out:
                events.append(StreamEvent(out))
        events.append(StreamEvent("", finish_reason=reason, token_ids=self.ids, stats=self.stats()))
        return events

    def stats(self) -> dict:
        t1 = time.perf_counter()
        n = len(self.ids)
        first = self.first or t1
        decode_s = t1 - first
        return {"prompt_tokens": self.prompt_len, "cached_prompt_tokens": self.cached_tokens,
                "completion_tokens": n, "ttft_s": first - self.t0,
                "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, "total_s": t1 - self.t0,
                "stop_sequence": self.stop_hit}


def _split_stop(text: str, stops: tuple[str, ...], final: bool = False) -> tuple[str, str, str | None]:
    """Return (safe to emit, held back, the stop string hit: the earliest in the text, or None)."""
    if not stops:
        return text, "", None
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        pos, hit = min(hits, key=lambda h: h[0])
        return text[:pos], "", hit
    if final:
        return text, "", None
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return (text[:-keep], text[-keep:], None) if keep else (text, "", None)
