"""Every Anthropic Messages answer shape, whole and streamed, written in one place: the message (id, type, role,
model, content blocks: thinking, text, tool_use; stop_reason, stop_sequence, usage), its server-sent events (message_start, ping,
content_block_start / delta / stop, message_delta, message_stop, error), the token count and the error object
`{"type": "error", "error": {"type", "message"}}` with Anthropic's HTTP status for each error type. EdgeChat's
own `context_shift` field (edge.serve.openai_writer) goes on the message and on message_start's.
edge.serve.service hands it the row's result; tool calls are parsed out by edge.decode.tools, as for OpenAI.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, AsyncIterator

from edge.decode import thinking
from edge.decode import tools as toolfmt
from edge.decode.text_stream import StreamEvent
from edge.serve.openai_writer import Service, context_shift, timeout_message  # the same on both routes

# Anthropic's error type for each HTTP status this server answers with (docs.claude.com/en/api/errors); a 4xx not
# listed is an invalid_request_error, a 5xx an api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def error(status: int, message: str) -> tuple[int, dict]:
    """(HTTP status, body) of an error on an Anthropic path. A full queue (this server's only 429: there are no
    per-key rate limits) is Anthropic's 529 overloaded_error, which its clients retry after Retry-After."""
    if status == 429:
        status = 529
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def token_count(n: int) -> dict:
    """POST /v1/messages/count_tokens."""
    return {"input_tokens": n}


def stop_reason(last: StreamEvent, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the loop's finish: EOS -> end_turn, a stop string -> stop_sequence (named),
    the token limit -> max_tokens, a finished tool call -> tool_use; a cancelled answer ended as asked."""
    hit = last.stats.get("stop_sequence")
    if last.finish_reason == "length":
        return "max_tokens", None
    if hit is not None:
        return "stop_sequence", hit
    return ("tool_use" if called else "end_turn"), None


def usage(last: StreamEvent | None, prompt_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens computed for this answer, cache_read_input_tokens
    those taken from the prompt cache (the two add up to the prompt, as on Anthropic's API)."""
    cached = last.stats.get("cached_prompt_tokens", 0) if last is not None else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": last.stats.get("completion_tokens", 0)
            if last is not None else 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_use(call: dict) -> dict:
    """An OpenAI-shaped parsed call (edge.decode.tools) as a tool_use block: input is the arguments object."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def content(text: str, rows) -> list[dict]:
    """The answer's content blocks: its text (when there is any), then its tool calls as tool_use blocks."""
    if rows.tools and rows.tool_choice != "none":
        parsed = toolfmt.parse_calls(text)
        if parsed.tool_calls:
            head = [{"type": "text", "text": parsed.content}] if parsed.content else []
            return head + [_tool_use(c) for c in parsed.tool_calls]
    return [{"type": "text", "text": text}] if text else []


def signature(thought: str) -> str:
    """A thinking block's `signature` (Anthropic's shape requires one: there, an encrypted check that Anthropic
    wrote the block). Here: "edgechat-sha256:" and the SHA-256 of the thinking text as written, unkeyed, so not
    proof of anything; the server never reads it back (thinking sent back in a later turn is dropped from the
    prompt, edge.serve.anthropic_schema.ThinkingBlock). Computed on the full text, also when display is
    "omitted"."""
    return "edgechat-sha256:" + hashlib.sha256(thought.encode()).hexdigest()


def thinking_block(thought: str, display: str) -> dict:
    return {"type": "thinking", "thinking": thought if display != "omitted" else "", "signature": signature(thought)}


def _envelope(service: Service, mid: str) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": service.model_id}


def message(service: Service, mid: str, text: str, last: StreamEvent, rows, prompt_tokens: int,
            display: str | None = None) -> dict:
    """A whole Messages answer; with thinking on (`display`), a think block first as a thinking block."""
    head = []
    if display is not None:
        thought, text = thinking.split(text, rows.think, rows.opened)
        head = [thinking_block(thought, display)] if thought else []  # as streamed: no block for no thinking
    blocks = head + content(text, rows)
    reason, seq = stop_reason(last, any(b["type"] == "tool_use" for b in blocks))
    return _envelope(service, mid) | {"content": blocks, "stop_reason": reason, "stop_sequence": seq,
                                      "usage": usage(last, prompt_tokens)} | context_shift(rows)


def _event(kind: str, **body: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


def error_event(service: Service, ev: StreamEvent) -> str:
    """A failed or timed-out answer after the 200 status line: Anthropic's error event, counted."""
    timeout = ev.finish_reason == "timeout"
    service.metrics.http_error(504 if timeout else 500)
    _, body = error(504 if timeout else 500, timeout_message(service) if timeout
                    else f"generation failed: {ev.stats.get('error')}")
    return _event("error", error=body["error"])


async def messages_sse(service: Service, mid: str, events: AsyncIterator[tuple[int, StreamEvent]], rows,
                       prompt_tokens: int, display: str | None = None) -> AsyncIterator[str]:
    """The events of one streamed answer, in Anthropic's order. With thinking on (`display`), the think block is
    a thinking block first (thinking_delta as it comes, then its signature_delta). With tools the text is held
    while it may still be a call; a call is a tool_use block opened once its name is written, its input sent as
    input_json_delta pieces as the arguments are written (edge.decode.tools.calls_so_far); a call in another
    shape goes out whole when the answer ends."""
    calls = bool(rows.tools) and rows.tool_choice != "none"
    split = thinking.Splitter(rows.think if display is not None else None, rows.opened)
    held = ""  # text that may still become a tool call
    plain = not calls
    index = 0  # the next block's index
    open_kind: str | None = None  # the block now open: "thinking", "text", "tool_use" or None
    thought = ""  # the thinking so far (its signature is over all of it)
    sent: list[int] = []  # per tool_use block streamed so far: how much of its arguments' text was sent

    def close() -> list[str]:
        nonlocal open_kind, index
        out = []
        if open_kind == "thinking":
            out.append(_event("content_block_delta", index=index,
                              delta={"type": "signature_delta", "signature": signature(thought)}))
        if open_kind is not None:
            out.append(_event("content_block_stop", index=index))
            index += 1
        open_kind = None
        return out

    def delta(kind: str, piece: str) -> list[str]:
        nonlocal open_kind
        out = []
        if open_kind != kind:
            out += close()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            out.append(_event("content_block_start", index=index, content_block=block))
            open_kind = kind
        if kind == "text":
            out.append(_event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece}))
        elif display != "omitted":
            out.append(_event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": piece}))
        return out

    def tool_deltas(so_far: list[toolfmt.CallSoFar]) -> list[str]:
        """The calls written so far, as tool_use blocks: opened, their new arguments text, closed when whole."""
        nonlocal open_kind
        out = []
        for k, c in enumerate(so_far):
            if k == len(sent):
                out += close()
                block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c.name, "input": {}}
                out.append(_event("content_block_start", index=index, content_block=block))
                open_kind = "tool_use"
                sent.append(0)
            if k == len(sent) - 1 and open_kind == "tool_use":
                if len(c.arguments) > sent[k]:
                    out.append(_event("content_block_delta", index=index, delta={
                        "type": "input_json_delta", "partial_json": c.arguments[sent[k]:]}))
                    sent[k] = len(c.arguments)
                if c.whole:
                    out += close()
        return out

    try:
        yield _event("message_start", message=_envelope(service, mid) | {
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(None, prompt_tokens)}
            | context_shift(rows))
        yield _event("ping")
        async for _, ev in events:
            reasoning, text = split.push(ev.text) if ev.text else ("", "")
            if ev.finish_reason:
                more = split.finish()
                reasoning, text = reasoning + more[0], text + more[1]
            if reasoning:
                thought += reasoning
                for s in delta("thinking", reasoning):
                    yield s
            if text:
                if plain:
                    for s in delta("text", text):
                        yield s
                else:
                    held += text
                    if not toolfmt.may_be_call(held):  # plain text after all: let it flow
                        plain = True
                        for s in delta("text", held):
                            yield s
                    else:
                        for s in tool_deltas(toolfmt.calls_so_far(held)):
                            yield s
            if not ev.finish_reason:
                continue
            if ev.finish_reason in ("error", "timeout"):
                yield error_event(service, ev)
                return
            blocks = [] if plain else content(held, rows)
            if sent:  # calls streamed as they were written; one cut short by max_tokens ends as it is
                for s in tool_deltas(toolfmt.calls_so_far(held)) + close():
                    yield s
                blocks = [b for b in blocks if b["type"] == "tool_use"][len(sent):]
            if blocks and blocks[0]["type"] == "text":
                for s in delta("text", blocks.pop(0)["text"]):
                    yield s
            for s in close():
                yield s
            for b in blocks:
                yield _event("content_block_start", index=index, content_block={**b, "input": {}})
                yield _event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)})
                yield _event("content_block_stop", index=index)
                index += 1
            reason, seq = stop_reason(ev, bool(blocks) or bool(sent))
            yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                         usage=usage(ev, prompt_tokens))
            yield _event("message_stop")
    finally:
        await events.aclose()  # type: ignore[attr-defined]
