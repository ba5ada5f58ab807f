"""The Gradio chat page: streaming answers, history, system prompt, sampling controls, stop, clear, JSON mode
and tools (the API's response_format and tools, shown: a tool call appears in the chat as a call block). A
thinking model's think block shows collapsed above its answer (a chatbot message with a title).

The conversation lives in a `gr.State` as plain {role, content} messages; the
chatbot only displays it. Answers go through the same scheduler as the API.
Nothing here loads from the network: system fonts only, no analytics, no share
link.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr

from edge.decode import tools as toolfmt
from edge.decode import conversation, thinking
from edge.errors import EdgeChatError
from edge.decode.logits import RowLogits

SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"]
UI_UPDATE_S = 0.08  # at most ~12 page updates a second while an answer streams
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]


def theme() -> gr.themes.Base:
    return gr.themes.Default(font=SYSTEM_FONTS, font_mono=MONO_FONTS)


def page_constraint(gen, json_mode: bool, schema_text: str, tools_text: str, choice: str):
    """(tools, RowLogits or None) for the page's JSON mode / tools settings; EdgeChatError (shown on the
    status line) when the schema or the tools are not valid JSON or cannot be compiled."""
    def parsed(text: str, what: str):
        try:
            return json.loads(text)
        except ValueError as e:
            raise EdgeChatError(f"{what} is not valid JSON: {e}") from None

    tools = parsed(tools_text, "Tools") if (tools_text or "").strip() else None
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise EdgeChatError('Tools must be a JSON list of {"type": "function", "function": {"name": ..., '
                            '"parameters": {...}}}')
    schema = parsed(schema_text, "JSON schema") if json_mode and (schema_text or "").strip() else None
    grammar = conversation.constraint(gen.tokenizer, gen.decoder.dims.vocab_size, tools, choice, json_schema=schema,
                                      json_mode=json_mode)
    return tools, RowLogits(grammar=grammar) if grammar is not None else None


def page_sampling(gen, temperature: Any, top_p: Any, max_tokens: Any):
    """The page's settings as a SamplingConfig; EdgeChatError (shown on the status line) for what a slider's
    number box lets through: NaN, infinities, text, values out of range (a raw Python error before)."""
    def number(v: Any, what: str, low: float, high: float) -> float:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise EdgeChatError(f"{what} must be a number from {low:g} to {high:g}, got {v!r}") from None
        if not math.isfinite(x) or not low <= x <= high:
            raise EdgeChatError(f"{what} must be a number from {low:g} to {high:g}, got {v!r}")
        return x

    most = max(1, gen.max_context // 2)
    n = number(max_tokens, "Max new tokens", 1, most)
    t = number(temperature, "Temperature", 0, 2)
    p = number(top_p, "Top-p", 0, 1)
    if p == 0:
        raise EdgeChatError("Top-p must be greater than 0")
    return gen.sampling(max_new_tokens=int(n), temperature=t, top_p=p)


THINKING_TITLE = "Thinking"


def show_messages(msgs: list[dict], thinking_now: bool = False) -> list[dict]:
    """The conversation as the chatbot shows it: each answer's think block (kept under "thinking") as a message
    with a title, which the chatbot draws collapsible, above the answer; the last one open while `thinking_now`."""
    out = []
    for k, m in enumerate(msgs):
        if m["role"] == "system":
            continue
        if m.get("thinking"):
            pending = thinking_now and k == len(msgs) - 1
            out.append({"role": "assistant", "content": m["thinking"],
                        "metadata": {"title": THINKING_TITLE, "status": "pending" if pending else "done"}})
        if m["role"] != "assistant" or m.get("content") or m.get("tool_calls") or not m.get("thinking"):
            out.append(show_message(m))
    return out


def show_message(m: dict) -> dict:
    """A message as the chatbot shows it: tool calls as call blocks, tool results labelled."""
    if m.get("tool_calls"):
        blocks = "\n".join(f"🔧 **{c['function']['name']}**\n```json\n{c['function']['arguments']}\n```"
                           for c in m["tool_calls"])
        return {"role": "assistant", "content": ((m["content"] or "") + "\n" + blocks).strip()}
    return {"role": m["role"], "content": m["content"]}


class Answers:
    """The answers each page session is streaming, so Stop (and Clear) can cancel those requests.

    Stop cancels the scheduler request, which then ends with finish "cancelled" like any other answer: the
    answer's event finishes normally and writes its own status line. (Cancelling the gradio event instead
    made gradio 6 draw an "Error" beside it now and then.) Stop pressed while an answer is still being set
    up (prompt fitted, grammar compiled) cancels its request as soon as it exists; Stop with no answer
    under way does nothing. Touched only on the server's event loop (async handlers), so no lock."""

    @dataclass(eq=False)
    class Answer:
        req: object = None
        stopped: bool = False
        cleared: bool = False  # the chat was cleared: the answer writes nothing more

    def __init__(self) -> None:
        self._by_session: dict[str, list[Answers.Answer]] = {}

    def starting(self, session: str) -> Answer:
        entry = Answers.Answer()
        self._by_session.setdefault(session, []).append(entry)
        return entry

    @staticmethod
    def running(entry: Answer, req) -> None:
        entry.req = req
        if entry.stopped:
            req.cancel()

    def done(self, session: str, entry: Answer) -> None:
        if entry.req is not None:
            entry.req.cancel()  # no-op for a finished request; frees the slot of one whose page went away
        entries = self._by_session.get(session, [])
        if entry in entries:
            entries.remove(entry)
        if not entries:
            self._by_session.pop(session, None)

    def stop(self, session: str, clear: bool = False) -> None:
        for entry in self._by_session.get(session, []):  # every answer of this page (Enter pressed twice)
            entry.stopped = True
            entry.cleared = entry.cleared or clear
            if entry.req is not None:
                entry.req.cancel()


def build_ui(service) -> gr.Blocks:
    gen = service.gen
    defaults = gen.sampling()
    answers = Answers()
    with gr.Blocks(title=f"EdgeChat · {service.model_id}", analytics_enabled=False) as demo:
        gr.Markdown(f"### EdgeChat · {service.model_id}\n"
                    f"`{service.precision}` on {service.backend} · context {gen.max_context} tokens"
                    + ("" if gen.tokenizer.has_template else "\n\n⚠️ This bundle has no chat template (a base "
                       "model): it cannot chat here; use /v1/completions, or rebuild it with "
                       "`edge-export build --chat-template FILE`"), elem_id="model-line")
        history = gr.State([])
        chatbot = gr.Chatbot(label="Chat", elem_id="chatbot", height=420, buttons=["copy"])
        with gr.Row():
            msg = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=6,
                             elem_id="message", autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
            clear = gr.Button("Clear", scale=1, elem_id="clear")
        stats = gr.Markdown("", elem_id="stats")
        with gr.Accordion("Settings", open=False):
            system = gr.Textbox("", label="System prompt", lines=2, elem_id="system")
            temperature = gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
            max_tokens = gr.Slider(1, max(1, gen.max_context // 2), value=min(defaults.max_new_tokens, gen.max_context // 2),
                                   step=1, label="Max new tokens", elem_id="max-tokens")
            json_mode = gr.Checkbox(False, label="JSON mode (the answer is one JSON object)", elem_id="json-mode")
            schema = gr.Textbox("", label="JSON schema for JSON mode (optional)", lines=3, elem_id="json-schema")
            tools = gr.Textbox("", label="Tools (a JSON list of OpenAI function tools; calls show in the chat)",
                               lines=3, elem_id="tools")
            tool_choice = gr.Radio(["auto", "required", "none"], value="auto", label="Tool choice",
                                   elem_id="tool-choice")

        show = show_messages

        def take(text: str, msgs: list[dict]):
            if not text.strip():
                return gr.update(), msgs, show(msgs)
            msgs = msgs + [{"role": "user", "content": text}]
            return "", msgs, show(msgs)

        async def answer(msgs: list[dict], system_prompt: str, temp: float, p: float, n: int, as_json: bool,
                         schema_text: str, tools_text: str, choice: str, request: gr.Request):
            if not msgs or msgs[-1]["role"] != "user":
                return
            session = request.session_hash or ""
            entry = answers.starting(session)
            try:
                async with contextlib.aclosing(answer_events(msgs, system_prompt, temp, p, n, as_json, schema_text,
                                                             tools_text, choice, entry)) as updates:
                    async for update in updates:
                        if entry.cleared:  # this event's last write, so no update of ours lands after the clear
                            yield [], [], ""
                            return
                        yield update
            finally:  # also when gradio closes this generator (page gone): the request is cancelled at once
                answers.done(session, entry)

        async def answer_events(msgs: list[dict], system_prompt: str, temp: float, p: float, n: int, as_json: bool,
                                schema_text: str, tools_text: str, choice: str, entry: Answers.Answer):
            convo = ([{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []) + [
                {k: v for k, v in m.items() if k != "thinking"} for m in msgs]  # the template gets the answers only
            try:
                tool_list, logits = await asyncio.to_thread(page_constraint, gen, as_json, schema_text, tools_text,
                                                            choice)
                cfg = page_sampling(gen, temp, p, n)
                # rendering and tokenizing a long chat takes a while: off the event loop the API shares
                fitted = await asyncio.to_thread(conversation.prompt, gen.tokenizer, convo, tool_list,
                                                 fit=(gen.max_context, min(cfg.max_new_tokens, gen.max_context // 2)))
                dropped = fitted.dropped
                fmt = gen.tokenizer.thinking
                think = thinking.row_state(fmt, fitted.opened, service.reasoning_budget, logits is not None)
                if think is not None:
                    logits = logits or RowLogits()
                    logits.think = think
                req, events = await service.generate(fitted.ids, cfg, logits=logits)
                answers.running(entry, req)
            except EdgeChatError as e:
                yield msgs, show(msgs), f"⚠️ {e}"
                return
            note = f" · dropped {dropped} old message(s) to fit the context" if dropped else ""
            yield msgs, show(msgs), "generating…"  # at once: the events show no progress overlay (see below)
            reply, thought, last_yield = "", "", 0.0
            split = thinking.Splitter(fmt, fitted.opened)
            async for ev in events:
                r, c = split.push(ev.text)
                if ev.finish_reason:
                    more = split.finish()
                    r, c = r + more[0], c + more[1]
                reply, thought = reply + c, thought + r
                answer_msg = {"role": "assistant", "content": reply} | ({"thinking": thought} if thought else {})
                shown = msgs + [answer_msg]
                if ev.finish_reason:
                    if tool_list and choice != "none":
                        parsed = toolfmt.parse_calls(reply)
                        if parsed.tool_calls:
                            shown = msgs + [answer_msg | {"content": parsed.content, "tool_calls": parsed.tool_calls}]
                    s = ev.stats
                    if ev.finish_reason == "cancelled":
                        yield shown, show(shown), f"stopped · {s['completion_tokens']} tokens"
                        return
                    cached = f" · {s['cached_prompt_tokens']} prompt tokens cached" if s.get("cached_prompt_tokens") else ""
                    line = (f"TTFT {s['ttft_s'] * 1000:.0f} ms · {s['decode_tok_s']:.1f} tok/s · "
                            f"{s['completion_tokens']} tokens · {ev.finish_reason}{cached}{note}")
                    yield shown, show(shown), line
                elif ev.text and time.monotonic() - last_yield >= UI_UPDATE_S:
                    # coalesce tokens: re-rendering the chat per token costs the browser and the device CPU
                    last_yield = time.monotonic()
                    yield shown, show(shown, thinking_now=not reply), "thinking…" if thought and not reply \
                        else "generating…"

        inputs = [history, system, temperature, top_p, max_tokens, json_mode, schema, tools, tool_choice]
        msg.submit(take, [msg, history], [msg, history, chatbot], queue=False).then(
            answer, inputs, [history, chatbot, stats], show_progress="hidden")
        send.click(take, [msg, history], [msg, history, chatbot], queue=False).then(
            answer, inputs, [history, chatbot, stats], show_progress="hidden")
        # Stop cancels the session's request (Answers); the answer's event then ends by itself with "stopped"
        # on the status line. The answer events show no progress overlay: the status line and the streaming
        # text already show progress.
        async def stop_answer(request: gr.Request) -> None:
            answers.stop(request.session_hash or "")

        stop.click(stop_answer, None, None, queue=False, show_progress="hidden")

        async def clear_chat(request: gr.Request) -> tuple[list, list, str]:
            answers.stop(request.session_hash or "", clear=True)  # a streaming answer would refill the chat
            return [], [], ""

        clear.click(clear_chat, None, [history, chatbot, stats], queue=False)
        # the chatbot's own trash icon clears the conversation too, not just the screen (the next turn would
        # still send the old history)
        async def clear_history(request: gr.Request):
            return (await clear_chat(request))[1:]

        chatbot.clear(clear_history, None, [history, stats], queue=False)
    demo.queue(default_concurrency_limit=None)
    return demo
