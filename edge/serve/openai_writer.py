"""Every OpenAI answer shape, whole and streamed, written in one place: the envelope (id, object, created,
model, system_fingerprint), the finish reason, usage, error bodies; a chat completion's choices (a thinking
model's think block as `reasoning_content`, tool calls parsed out of the content after it) and a text
completion's (echo, logprobs); and the server-sent events of both for n rows (reasoning as its own
`delta.reasoning_content`, tool calls held back until they parse, logprobs per chunk). edge.serve.service only
hands it the rows' results."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Protocol

from edge.serve import openai_answers as api_answers
from edge.decode import thinking
from edge.decode import tools as toolfmt
from edge.decode.text_stream import StreamEvent

class Service(Protocol):
    """What the stream writers read of the server (edge.serve.service.Service has these)."""

    request_timeout_s: float
    model_id: str
    precision: str
    metrics: Any


def timeout_message(service: Service) -> str:
    return (f"the answer took longer than this server's --request-timeout of {service.request_timeout_s:g} s: "
            "ask for fewer max_tokens or retry later")


def finish(reason: str | None) -> str:
    """OpenAI's finish_reason for the loop's (a cancelled answer ended as asked: "stop")."""
    return {"cancelled": "stop", None: "stop"}.get(reason, reason)


def envelope(service: Service, cid: str, created: int, kind: str) -> dict[str, Any]:
    """The fields every answer and chunk starts with."""
    return {"id": cid, "object": kind, "created": created, "model": service.model_id,
            "system_fingerprint": f"edgechat-{service.precision}"}


def chat_choice(i: int, text: str, last, lps: list, rows, table: list[bytes] | None) -> dict:
    """One choice of a chat completion: the message (tool calls parsed out), finish reason, logprobs."""
    reason = finish(last.finish_reason)
    reasoning, text = thinking.split(text, rows.think, rows.opened)
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if rows.tools and rows.tool_choice != "none":
        parsed = toolfmt.parse_calls(text)
        if parsed.tool_calls:
            msg = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
            if reason == "stop":
                reason = "tool_calls"
    if rows.think is not None:  # a thinking model: its think block (None when the answer had none)
        msg["reasoning_content"] = reasoning
    logprobs = {"content": api_answers.chat_logprobs(table, lps)} if table is not None else None
    return {"index": i, "message": msg, "finish_reason": reason, "logprobs": logprobs}


def chat_completion(service: Service, cid: str, created: int, texts: list[str], lasts: list, lps: list, rows,
                    table: list[bytes] | None) -> dict:
    """A whole chat completion of n rows."""
    return envelope(service, cid, created, "chat.completion") | {
        "choices": [chat_choice(i, texts[i], lasts[i], lps[i], rows, table) for i in range(len(texts))],
        "usage": usage(lasts, len(rows.prompts[0]))} | context_shift(rows)


def context_shift(rows) -> dict:
    """EdgeChat's field saying the chat's oldest messages were dropped to fit the context (--context-overflow
    shift): on the answer, and on the first chunk of a stream; absent when nothing was dropped."""
    return {"context_shift": {"dropped_messages": rows.dropped}} if rows.dropped else {}


def text_completion(service: Service, cid: str, created: int, texts: list[str], lasts: list, lps: list, rows,
                    table: list[bytes], scored: list, logprobs: int | None, n: int) -> dict:
    """A whole text completion: n choices per prompt, each the echoed prompt (asked) and the row's text."""
    choices = []
    for p, prompt_text in enumerate(rows.prompt_texts):
        for _ in range(n):
            k = len(choices)
            row = k if lasts else None  # max_tokens 0 with echo: no rows ran
            lp = None
            if logprobs is not None:
                mine = (scored[p] if rows.echo and scored else []) + (lps[row] if row is not None else [])
                lp = api_answers.completion_logprobs(table, mine)
            choices.append({"index": k, "text": (prompt_text if rows.echo else "") + (texts[row] if row is not None else ""),
                            "logprobs": lp, "finish_reason": finish(lasts[row].finish_reason) if row is not None
                            else "length"})
    return envelope(service, cid, created, "text_completion") | {
        "choices": choices, "usage": usage(lasts, sum(len(p) for p in rows.prompts))}


def usage(lasts: list, prompt_tokens: int) -> dict:
    """Usage of a whole request: its prompt once, every row's answer."""
    c = sum(last.stats.get("completion_tokens", 0) for last in lasts)
    cached = max((last.stats.get("cached_prompt_tokens", 0) for last in lasts), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_event(service: Service, ev: StreamEvent) -> str:
    """A failed or timed-out row of a stream (whose status line said 200 already): an error event, counted."""
    timeout = ev.finish_reason == "timeout"
    service.metrics.http_error(504 if timeout else 500)
    err = {"error": {"message": timeout_message(service) if timeout else f"generation failed: {ev.stats.get('error')}",
                     "type": "timeout_error" if timeout else "server_error", "param": None,
                     "code": "request_timeout" if timeout else None}}
    return f"data: {json.dumps(err)}\n\n"


async def chat_sse(service: Service, cid: str, created: int, events: AsyncIterator[tuple[int, StreamEvent]], n: int,
                    rows, table, include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """Chat chunks for n rows. With tools, a row's text is held while it may still be a call; a call in the
    shape the call grammar writes goes out as it is written, as OpenAI streams one: a tool_calls delta with its
    id and name once the name is written, then its arguments' text in pieces (edge.decode.tools.calls_so_far);
    a call in another shape goes out whole when the answer ends; finish_reason "tool_calls"."""
    def chunk(i: int, delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True,
              lps: list | None = None, extra: dict | None = None) -> str:
        logprobs = {"content": api_answers.chat_logprobs(table, lps or [])} if table is not None and choices else None
        body = envelope(service, cid, created, "chat.completion.chunk") | {
            "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}] if choices else []
        } | (extra or {})
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    calls = bool(rows.tools) and rows.tool_choice != "none"
    held = [""] * n  # text that may still become a tool call
    held_lps: list[list] = [[] for _ in range(n)]
    plain = [not calls] * n
    split = [thinking.Splitter(rows.think, rows.opened) for _ in range(n)]  # reasoning | content, per row
    unsent: list[list] = [[] for _ in range(n)]  # logprobs of text the splitter still holds
    lasts: list[Any] = []
    sent: list[list[int]] = [[] for _ in range(n)]  # per row, per call streamed so far: its arguments' text sent

    def call_deltas(i: int, so_far: list[toolfmt.CallSoFar]) -> list[dict]:
        """The tool_calls delta entries for what row i's calls wrote since the last look."""
        out = []
        for k, c in enumerate(so_far):
            if k == len(sent[i]):
                out.append({"index": k, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
                sent[i].append(0)
            if len(c.arguments) > sent[i][k]:
                out.append({"index": k, "function": {"arguments": c.arguments[sent[i][k]:]}})
                sent[i][k] = len(c.arguments)
        return out

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""}, extra=context_shift(rows) if i == 0 else None)
        async for i, ev in events:
            lps = unsent[i] + (getattr(ev, "logprobs", None) or [])
            reasoning, text = split[i].push(ev.text)
            if ev.finish_reason:
                more = split[i].finish()
                reasoning, text = reasoning + more[0], text + more[1]
            if reasoning:
                yield chunk(i, {"reasoning_content": reasoning}, lps=lps)
                lps = []
            unsent[i] = [] if text or not ev.text else lps  # held by the splitter: sent with the text later
            if text or (lps and not unsent[i]):
                if plain[i]:
                    yield chunk(i, {"content": text}, lps=lps)
                else:
                    held[i] += text
                    held_lps[i] += lps
                    if not toolfmt.may_be_call(held[i]):  # plain text after all: let it flow
                        plain[i] = True
                        yield chunk(i, {"content": held[i]}, lps=held_lps[i])
                    else:
                        pieces = call_deltas(i, toolfmt.calls_so_far(held[i]))
                        if pieces:
                            yield chunk(i, {"tool_calls": pieces}, lps=held_lps[i])
                            held_lps[i] = []
            if ev.finish_reason:
                if ev.finish_reason in ("error", "timeout"):
                    yield error_event(service, ev)
                    return
                reason = finish(ev.finish_reason)
                if not plain[i]:
                    parsed = toolfmt.parse_calls(held[i])
                    streamed = len(sent[i])
                    if streamed:  # calls streamed as they were written; one cut short by max_tokens ends as it is
                        rest = call_deltas(i, toolfmt.calls_so_far(held[i]))
                        streamed = len(sent[i])
                        more = [{"index": streamed + k, **c} for k, c in enumerate(parsed.tool_calls[streamed:])]
                        if rest or more:
                            yield chunk(i, {"tool_calls": rest + more}, lps=held_lps[i])
                            held_lps[i] = []
                        reason = "tool_calls" if reason == "stop" else reason
                    elif parsed.tool_calls:
                        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(parsed.tool_calls)]}
                        if parsed.content:
                            delta["content"] = parsed.content
                        yield chunk(i, delta, lps=held_lps[i])
                        reason = "tool_calls" if reason == "stop" else reason
                    elif held[i]:
                        yield chunk(i, {"content": held[i]}, lps=held_lps[i])
                yield chunk(i, {}, reason, lps=unsent[i])
                lasts.append(ev)
        if include_usage:
            yield chunk(0, {}, usage=usage(lasts, prompt_tokens), choices=False)
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def completion_sse(service: Service, cid: str, created: int, events: AsyncIterator[tuple[int, StreamEvent]],
                          rows, table, scored: list, logprobs: int | None, include_usage: bool,
                          n: int = 1) -> AsyncIterator[str]:
    """Text-completion chunks: the echoed prompt first (with its logprobs), then each row's text as it comes.
    `text_offset` runs on across a choice's chunks (as in the whole answer); with max_tokens 0 (echo only: no
    rows ran) each of the n choices per prompt is its echoed prompt, finished "length", as the whole answer."""
    offsets: dict[int, int] = {}  # choice -> characters of its tokens so far (the echoed prompt's included)

    def chunk(k: int, text: str, finish: str | None = None, lps: list | None = None, usage: dict | None = None) -> str:
        lp = None
        if logprobs is not None and usage is None:
            lp = api_answers.completion_logprobs(table, lps or [], offset=offsets.get(k, 0))
            if lp["tokens"]:
                offsets[k] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        body = envelope(service, cid, created, "text_completion") | {
            "choices": [] if usage is not None else [{"index": k, "text": text, "finish_reason": finish,
                                                      "logprobs": lp}]}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    lasts: list[Any] = []
    try:
        if rows.echo:
            echo_only = not rows.prompt_of
            choices = [(k, k // n) for k in range(len(rows.prompts) * n)] if echo_only else enumerate(rows.prompt_of)
            for k, p in choices:
                yield chunk(k, rows.prompt_texts[p], lps=scored[p] if scored else [])
                if echo_only:
                    yield chunk(k, "", "length")
        async for k, ev in events:
            lps = getattr(ev, "logprobs", None) or []
            if ev.text or lps:
                yield chunk(k, ev.text, lps=lps)
            if ev.finish_reason:
                if ev.finish_reason in ("error", "timeout"):
                    yield error_event(service, ev)
                    return
                yield chunk(k, "", finish(ev.finish_reason))
                lasts.append(ev)
        if include_usage:
            yield chunk(0, "", usage=usage(lasts, sum(len(p) for p in rows.prompts)))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]
