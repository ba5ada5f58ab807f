"""A multi-turn conversation that always fits the context window.

When history grows past the context, the oldest user/assistant turns are
dropped (the system prompt is kept) and the caller is told how many.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

from edge.errors import ContextOverflowError
from edge.decode.generate import Generator
from edge.decode.text_stream import StreamEvent
from edge.decode.sampling import SamplingConfig

log = logging.getLogger("edgechat")


def fit_messages(gen: Generator, messages: list[dict], reserve: int,
                 tools: list[dict] | None = None) -> tuple[list[int], list[dict], int]:
    """Drop the oldest non-system turns until prompt + `reserve` new tokens fit (`tools`: for a template
    that renders them itself, see edge.decode.tools).

    Returns (prompt ids, kept messages, number of messages dropped).
    """
    limit = gen.max_context - reserve
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    dropped = 0
    while True:
        kept = system + rest
        ids = gen.tokenizer.encode_chat(kept, tools=tools)
        if len(ids) <= limit:
            return ids, kept, dropped
        if len(rest) <= 1:
            raise ContextOverflowError(
                f"the last message alone needs {len(ids)} tokens but only {limit} fit "
                f"(context {gen.max_context} minus {reserve} for the answer): shorten it or lower max_new_tokens")
        # drop a whole turn: the oldest message and, if it was a user turn, its answer
        drop = 2 if len(rest) > 2 and rest[0]["role"] == "user" and rest[1]["role"] == "assistant" else 1
        rest = rest[drop:]
        dropped += drop


@dataclass
class Chat:
    gen: Generator
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    last_dropped: int = 0

    def __post_init__(self) -> None:
        if self.system:
            self.messages.insert(0, {"role": "system", "content": self.system})

    def ask(self, text: str, cfg: SamplingConfig) -> Iterator[StreamEvent]:
        self.messages.append({"role": "user", "content": text})
        reserve = min(cfg.max_new_tokens, self.gen.max_context // 4)
        try:
            ids, kept, dropped = fit_messages(self.gen, self.messages, reserve)
        except ContextOverflowError:
            self.messages.pop()
            raise
        if dropped:
            log.warning("context full: dropped the %d oldest message(s) to fit %d tokens", dropped, self.gen.max_context)
            self.messages = kept
        self.last_dropped = dropped
        reply = []
        try:
            for ev in self.gen.stream(ids, cfg):
                reply.append(ev.text)
                yield ev
        finally:  # also when the answer is stopped (Ctrl-C, close()): the history keeps what was said
            self.messages.append({"role": "assistant", "content": "".join(reply)})
