"""The CLI's multi-turn chat (edge-chat repl), which always fits the context window.

When history grows past the context, the oldest user/assistant turns are dropped (the system prompt is kept)
and the caller is told how many: edge.decode.conversation fits and writes the prompt, as for the page and the API.
On a thinking model the history keeps each answer's content, not its think block (as the API's clients send it
back); `opened` says whether the last prompt opened the block, for the caller's edge.decode.thinking.Splitter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

from edge.decode import conversation, thinking
from edge.decode.logits import RowLogits
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
    reasoning_budget: int | None = None  # thinking tokens before the think block is closed (None: no limit)
    opened: bool = False  # the last prompt opened a think block: its answer starts inside it

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
        self.opened = fitted.opened
        fmt = self.gen.tokenizer.thinking
        state = thinking.row_state(fmt, fitted.opened, self.reasoning_budget, False)
        reply = []
        try:
            for ev in self.gen.stream(fitted.ids, cfg, logits=RowLogits(think=state) if state is not None else None):
                reply.append(ev.text)
                yield ev
        finally:  # also when the answer is stopped (Ctrl-C, close()): the history keeps what was said
            self.messages.append({"role": "assistant",
                                  "content": thinking.split("".join(reply), fmt, fitted.opened)[1]})
