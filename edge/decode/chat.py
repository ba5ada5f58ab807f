"""The CLI's multi-turn chat (edge-chat repl), which always fits the context window.

When history grows past the context, the oldest user/assistant turns are dropped (the system prompt is kept)
and the caller is told how many: edge.decode.conversation fits and writes the prompt, as for the page and the API.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

from edge.decode import conversation
from edge.errors import ContextOverflowError
from edge.decode.generate import Generator
from edge.decode.text_stream import StreamEvent
from edge.decode.sampling import SamplingConfig

log = logging.getLogger("edgechat")


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
            fitted = conversation.prompt(self.gen.tokenizer, self.messages, fit=(self.gen.max_context, reserve))
        except ContextOverflowError:
            self.messages.pop()
            raise
        if fitted.dropped:
            log.warning("context full: dropped the %d oldest message(s) to fit %d tokens", fitted.dropped,
                        self.gen.max_context)
            self.messages = fitted.messages
        self.last_dropped = fitted.dropped
        reply = []
        try:
            for ev in self.gen.stream(fitted.ids, cfg):
                reply.append(ev.text)
                yield ev
        finally:  # also when the answer is stopped (Ctrl-C, close()): the history keeps what was said
            self.messages.append({"role": "assistant", "content": "".join(reply)})
