"""Thinking models: an answer that starts with a `<think> ... </think>` block (Qwen3, SmolLM3, DeepSeek-R1).

A bundle thinks when its chat template writes the tags (the template is the manifest's record of how the model
was trained to be prompted; `detect`). Three things follow, each written once here:
- `ThinkFormat.opens_in(prompt)`: whether the prompt itself opens the block (templates that end the generation
  prompt with `<think>\\n`; the answer then starts inside it);
- `Splitter`: a row's text, piece by piece, into reasoning and content (the API's `reasoning_content`, the
  page's collapsed block, the CLI's dimmed text); a block the model never closes is all reasoning;
- `ThinkState`: what a row's logits processors (edge.decode.logits) know of the block at token level: which
  tokens are thinking (a grammar, from tools or response_format, applies to the content after the block), and,
  with a budget, the close tag and a newline forced into the sequence after that many thinking tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokens(Protocol):
    """What this module reads of edge.decode.tokenizer.ChatTokenizer (which builds a ThinkFormat: no import
    circle)."""

    spec: Any

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

TAGS = (("<think>", "</think>"),)  # (open, close) pairs a chat template may write
TAIL_TOKENS = 16  # prompt tokens read back to see whether the prompt ends inside an open block


@dataclass(frozen=True)
class ThinkFormat:
    """A thinking bundle's tags and their token ids (one id each when the tokenizer has them as added tokens)."""

    open: str
    close: str
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    forced_ids: tuple[int, ...]  # what a budget forces: the close tag and a newline

    def opens_in(self, tokenizer: Tokens, prompt_ids: list[int]) -> bool:
        """The prompt ends inside an open think block (its generation prompt wrote `<think>`)."""
        tail = tokenizer.decode(prompt_ids[-TAIL_TOKENS:], skip_special_tokens=False)
        return tail.rfind(self.open) > tail.rfind(self.close)


def tags_in(template: str) -> tuple[str, str] | None:
    """The (open, close) think tags a chat template writes, or None."""
    return next(((o, c) for o, c in TAGS if o in template and c in template), None)


def detect(tokenizer: Tokens) -> ThinkFormat | None:
    """The think tags the bundle's chat template writes, with their ids, or None for a model that does not think."""
    tags = tags_in(tokenizer.spec.chat_template or "")
    if tags is None:
        return None
    o, c = tags
    return ThinkFormat(o, c, tuple(tokenizer.encode(o)), tuple(tokenizer.encode(c)), tuple(tokenizer.encode(c + "\n")))


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: the tag may follow)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Splitter:
    """One answer's text pieces in, (reasoning, content) pieces out.

    `opened`: the prompt opened the block (the answer starts inside it); else a block counts only when the answer
    starts with the open tag (after whitespace). Reasoning is stripped of the whitespace around it, content of the
    whitespace after the block; a tag split across pieces is held back until it is whole. Without a format (a
    model that does not think) everything is content, unchanged."""

    def __init__(self, fmt: ThinkFormat | None, opened: bool = False) -> None:
        self.fmt = fmt
        self.state = "content" if fmt is None else "think" if opened else "start"
        self.thought = opened and fmt is not None  # a think block was seen
        self.buf = ""
        self._reasoned = self._answered = False

    def push(self, text: str) -> tuple[str, str]:
        if self.fmt is None:
            return "", text
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(self.fmt.open):
                    self.buf, self.state, self.thought = s[len(self.fmt.open):], "think", True
                    continue
                if self.fmt.open.startswith(s):  # nothing yet, or the tag's start: wait
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "think":
                i = self.buf.find(self.fmt.close)
                if i >= 0:
                    rest = self.buf[i + len(self.fmt.close):]
                    reasoning += self._reason(self.buf[:i], final=True)
                    self.buf, self.state = rest, "content"
                    continue
                keep = _partial(self.buf, self.fmt.close)
                reasoning += self._reason(self.buf[:len(self.buf) - keep])
                return reasoning, content
            return reasoning, content + self._answer()

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the answer: an unclosed block is reasoning, an undecided start content."""
        if self.fmt is None or self.state == "start":
            out, self.buf = self.buf, ""
            return "", out
        if self.state == "think":
            return self._reason(self.buf, final=True), ""
        return "", self._answer()

    def _reason(self, text: str, final: bool = False) -> str:
        """Emit `text` (the start of the held text) as reasoning; unless `final`, its trailing whitespace stays
        held (it may be the whitespace before the close tag)."""
        body = text.rstrip()
        self.buf = "" if final else text[len(body):] + self.buf[len(text):]
        if not self._reasoned:
            body = body.lstrip()
        self._reasoned = self._reasoned or bool(body)
        return body

    def _answer(self) -> str:
        out, self.buf = self.buf, ""
        if self.thought and not self._answered:
            out = out.lstrip()
        self._answered = self._answered or bool(out)
        return out


def split(text: str, fmt: ThinkFormat | None, opened: bool = False) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning None when the answer had no think block."""
    s = Splitter(fmt, opened)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2


@dataclass
class ThinkState:
    """A row's think block at token level, for its logits processors (edge.decode.logits.RowLogits).

    phase "start": the first token may open the block (the open tag as one token), else the answer is content;
    "think": inside the block, `spent` thinking tokens so far; "content": after it. With `budget`, once `spent`
    reaches it the close tag and a newline are forced, one token per step, through the one decode loop."""

    fmt: ThinkFormat
    budget: int | None = None
    phase: str = "start"
    spent: int = 0
    forced: list[int] = field(default_factory=list)
    recent: list[int] = field(default_factory=list)

    @property
    def may_open(self) -> int | None:
        """The token that opens the block at this step (phase "start", a one-token open tag), else None."""
        return self.fmt.open_ids[0] if self.phase == "start" and len(self.fmt.open_ids) == 1 else None

    def forced_token(self) -> int | None:
        """The token this step must take (the budget is spent), or None."""
        if self.phase == "think" and not self.forced and self.budget is not None and self.spent >= self.budget:
            self.forced = list(self.fmt.forced_ids)
        return self.forced[0] if self.forced else None

    def accept(self, tok: int) -> bool:
        """Record the row's next token; True when it is content (after the block: the grammar takes it)."""
        if self.phase == "content":
            return True
        if self.phase == "start":
            self.phase = "think" if tok == self.may_open else "content"
            return self.phase == "content"
        if self.forced:
            self.forced.pop(0)
            if not self.forced:
                self.phase = "content"
            return False
        self.recent = (self.recent + [tok])[-len(self.fmt.close_ids):]
        if tuple(self.recent) == self.fmt.close_ids:
            self.phase = "content"
        else:
            self.spent += 1
        return False


def row_state(fmt: ThinkFormat | None, opened: bool, budget: int | None, constrained: bool) -> ThinkState | None:
    """The token-level state a row needs: only with a budget or a grammar (else the text split suffices and the
    row stays free of processors, e.g. for drafting)."""
    if fmt is None or (budget is None and not constrained):
        return None
    return ThinkState(fmt, budget, phase="think" if opened else "start")
