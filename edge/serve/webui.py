"""The Gradio chat page: the browser's chats (a list: new, open, rename, delete; kept in localStorage),
streaming answers with their tokens and tok/s under each, regenerate, edit-and-resend, undo, a visible system
prompt, sampling controls, stop, clear, JSON mode and tools (the API's response_format and tools, shown: a tool
call appears in the chat as a call block). A thinking model's think block shows collapsed above its answer
(a chatbot message with a title).

The open conversation lives in a `gr.State` as plain {role, content} messages (plus the page-only `stats` and
`notes` of each answer); the chatbot only draws it (edge/serve/page_chats.py, which also holds the stored
chats). Answers go through the same conversation path and scheduler as the API. Nothing here loads from the
network: system fonts only, Markdown and code highlighting come with gradio's own bundle, no analytics, no
share link.
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
from edge.serve import page_chats

SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"]
UI_UPDATE_S = 0.08  # at most ~12 page updates a second while an answer streams
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]
STORE_KEY = "edgechat-chats-v1"  # the browser's localStorage key for the page's chats (page_chats.py)
DELETE_LABEL = "Delete this chat"
# the per-answer stats line (page_chats.show_answer) and a phone-wide layout (360 px)
CSS = """
#chatbot .answer-stats { font-size: 0.78em; opacity: 0.65; margin-top: 0.35em; font-variant-numeric: tabular-nums; }
#stats { font-size: 0.85em; opacity: 0.8; min-height: 1.2em; }
#model-line { font-size: 0.9em; }
#composer { flex-wrap: nowrap; gap: 6px; align-items: stretch; }
#composer > button { flex: 0 0 auto !important; width: auto !important; white-space: nowrap; padding: 0 16px; }
#chat-list label { width: 100%; }
.hidden-control { display: none !important; }
#chat-list label span { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
@media (max-width: 640px) {
  .gradio-container { padding-left: 6px !important; padding-right: 6px !important; }
  #composer { gap: 4px; }
  #composer > button { padding: 0 10px; font-size: 0.9em; }
  #composer > #clear { display: none; }  /* the chatbot's own trash icon clears too */
  #chatbot .message-row.bubble { max-width: calc(100% - 16px) !important; margin: 8px !important; }
}
"""
# the chat list (a gradio Sidebar, closed as built) opens on wide screens; on a phone it covers the page, so it
# stays closed there and closes again once a chat is picked
SIDEBAR_JS = """(wanted) => {
  const panel = document.querySelector('#chats-panel');
  const button = panel && panel.querySelector('.toggle-button');
  if (button && panel.classList.contains('open') !== wanted) button.click();
}"""
# on load: the list opens on a wide screen, and follows the chats other tabs of this browser change (the
# storage event fires in every other tab; the hidden button re-reads the list)
OPEN_LIST_JS = f"""() => {{ ({SIDEBAR_JS})(window.innerWidth > 768);
  window.addEventListener("storage", (e) => {{
    if (e.key === {json.dumps(STORE_KEY)}) document.querySelector("#refresh-chats")?.click(); }}); }}"""
# The chats are read from localStorage by each event that changes them, just before it runs (its first input
# is replaced), and written back after it: a tab then changes only its own chat, never a stale copy of the
# others (gradio's BrowserState reads the storage once per page load, so two tabs overwrote each other).
# WRITE_JS runs before a no-op server call, to which it sends nothing: gradio 6.17 does not run the `.then`
# chained after an event that has no server function.
READ_STORE = f"""(() => {{ try {{ return JSON.parse(localStorage.getItem({json.dumps(STORE_KEY)}) || "null"); }}
  catch (e) {{ return null; }} }})()"""
FRESH_JS = f"(st, ...rest) => [{READ_STORE}, ...rest]"
FRESH_CLOSE_JS = (f"(st, ...rest) => {{ if (window.innerWidth <= 768) ({SIDEBAR_JS})(false); "
                  f"return [{READ_STORE}, ...rest]; }}")
WRITE_JS = f"""(st) => {{ if (!st) return [null];
  try {{ localStorage.setItem({json.dumps(STORE_KEY)}, JSON.stringify(st)); }}
  catch (e) {{ console.error("EdgeChat: the chats could not be kept in this browser:", e); }}
  return [null]; }}"""


THINKING_TITLE = page_chats.THINKING_TITLE


def show_messages(msgs: list[dict], thinking_now: bool = False) -> list[dict]:
    """The conversation as the chatbot draws it (page_chats.show); the last answer's think block open while
    `thinking_now`."""
    if thinking_now and msgs and msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1] + [msgs[-1] | {"thinking_now": True}]
    return page_chats.show(msgs)[0]


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
        cleared: bool = False  # the chat was cleared or another one opened: the answer writes only `final`
        final: tuple = ([], [], "")  # (history, chatbot, status): the answer's last write once cleared

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

    def stop(self, session: str, clear: bool = False, final: tuple | None = None) -> None:
        """Cancel every answer of this page (Enter pressed twice); `clear`: the chat was emptied, or with
        `final` replaced by another conversation, which the answer's event then writes last."""
        for entry in self._by_session.get(session, []):
            entry.stopped = True
            entry.cleared = entry.cleared or clear or final is not None
            if final is not None:
                entry.final = final
            if entry.req is not None:
                entry.req.cancel()



def build_ui(service) -> gr.Blocks:
    gen = service.gen
    defaults = gen.sampling()
    answers = Answers()
    most = max(1, gen.max_context // 2)
    with gr.Blocks(title=f"EdgeChat · {service.model_id}", analytics_enabled=False, fill_width=True) as demo:
        # every chat of this browser (edge/serve/page_chats.py), as read from and written to localStorage by
        # the events' JavaScript (FRESH_JS, WRITE_JS)
        store = gr.JSON(None, visible=False, elem_id="chat-store")
        chat = gr.State(page_chats.new_chat())  # the open chat's id and title; its messages are `history`
        history = gr.State([])
        armed = gr.State(None)  # the chat whose Delete was clicked once: a second click deletes it
        with gr.Sidebar(label="Chats", open=False, width=280, elem_id="chats-panel"):
            new = gr.Button("+ New chat", variant="primary", elem_id="new-chat")
            chat_list = gr.Radio([], label="Chats (kept in this browser)", elem_id="chat-list")
            title = gr.Textbox("", label="Rename this chat (Enter)", max_lines=1, elem_id="chat-title")
            delete = gr.Button(DELETE_LABEL, variant="stop", size="sm", elem_id="delete-chat")
            refresh = gr.Button("Refresh", elem_id="refresh-chats", elem_classes="hidden-control")
        gr.Markdown(f"**EdgeChat · {service.model_id}** · `{service.precision}` on {service.backend} · "
                    f"context {gen.max_context} tokens"
                    + ("" if gen.tokenizer.has_template else "\n\n⚠️ This bundle has no chat template (a base "
                       "model): it cannot chat here; use /v1/completions, or rebuild it with "
                       "`edge-export build --chat-template FILE`"), elem_id="model-line")
        # the boxes open once the stored chats are read (load_chats): typed before that, their text was lost
        system = gr.Textbox("", label="System prompt", placeholder="none: the model's own default", lines=1,
                            max_lines=6, elem_id="system", interactive=False)
        chatbot = gr.Chatbot(label="Chat", show_label=False, elem_id="chatbot", height="58vh", min_height=260,
                             buttons=["copy"], editable="user", layout="bubble", feedback_options=None,
                             placeholder="Ask anything. Your chats are kept in this browser: the arrow at the "
                                         "top left lists them.")
        with gr.Row(equal_height=True, elem_id="composer"):
            msg = gr.Textbox(placeholder="Message", show_label=False, container=False, scale=1,
                             min_width=80, elem_id="message", autofocus=True, lines=1, max_lines=8,
                             interactive=False)
            send = gr.Button("Send", variant="primary", scale=0, min_width=0, elem_id="send")
            stop = gr.Button("Stop", variant="stop", scale=0, min_width=0, elem_id="stop")
            clear = gr.Button("Clear", scale=0, min_width=0, elem_id="clear")
        stats = gr.Markdown("", elem_id="stats")
        with gr.Accordion("Settings", open=False):
            temperature = gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
            max_tokens = gr.Slider(1, most, value=min(defaults.max_new_tokens, most), step=1, label="Max new tokens",
                                   elem_id="max-tokens")
            json_mode = gr.Checkbox(False, label="JSON mode (the answer is one JSON object)", elem_id="json-mode")
            schema = gr.Textbox("", label="JSON schema for JSON mode (optional)", lines=3, elem_id="json-schema")
            tools = gr.Textbox("", label="Tools (a JSON list of OpenAI function tools; calls show in the chat)",
                               lines=3, elem_id="tools")
            tool_choice = gr.Radio(["auto", "required", "none"], value="auto", label="Tool choice",
                                   elem_id="tool-choice")

        def drawn(msgs: list[dict]) -> list[dict]:
            return page_chats.show(msgs)[0]

        # -- the chats: open, new, rename, delete; each writes the browser's store ---------------------------
        chat_outputs = [store, chat, history, chatbot, system, chat_list, title, stats, delete, armed]

        def opened(st: dict, c: dict, status: str = "") -> tuple:
            """Every chat output for showing chat `c` (a stored record or a new one); Delete disarmed."""
            return (st, {k: c[k] for k in ("id", "title", "titled")}, c["messages"], drawn(c["messages"]),
                    c["system"], gr.update(choices=page_chats.choices(st, c), value=c["id"]),
                    c["title"] if c["titled"] else "", status, gr.update(value=DELETE_LABEL), None)

        def record(c: dict, msgs: list[dict], system_prompt: str) -> dict:
            return dict(c, messages=msgs, system=system_prompt or "")

        def load_chats(st: Any, _system: str) -> tuple:
            st = page_chats.normalized(st)
            c = page_chats.find(st, st["current"]) or (st["chats"][0] if st["chats"] else page_chats.new_chat())
            out = opened(st, c)
            return *out[:4], gr.update(value=out[4], interactive=True), *out[5:], gr.update(interactive=True)

        def leave(request: gr.Request, st: Any, c: dict, msgs: list[dict], system_prompt: str, nxt: dict) -> dict:
            """The store with the open chat saved as it stands (a streaming answer is stopped: its event's
            last write shows `nxt`)."""
            st = page_chats.save(page_chats.normalized(st), record(c, msgs, system_prompt))
            answers.stop(request.session_hash or "", final=(nxt["messages"], drawn(nxt["messages"]), ""))
            return st

        async def open_chat(st: Any, chat_id: str, c: dict, msgs: list[dict], system_prompt: str,
                            request: gr.Request) -> tuple:
            st = page_chats.normalized(st)
            nxt = page_chats.find(st, chat_id)
            if nxt is None or chat_id == c["id"]:
                return opened(page_chats.save(st, record(c, msgs, system_prompt)), record(c, msgs, system_prompt))
            st = leave(request, st, c, msgs, system_prompt, nxt)
            return opened(dict(st, current=nxt["id"]), page_chats.find(st, chat_id))

        async def new_conversation(st: Any, c: dict, msgs: list[dict], system_prompt: str,
                                   request: gr.Request) -> tuple:
            nxt = page_chats.new_chat(system_prompt or "")  # a new chat keeps the system prompt in use
            st = leave(request, st, c, msgs, system_prompt, nxt)
            return opened(dict(st, current=nxt["id"]), nxt)

        async def rename_chat(st: Any, text: str, c: dict, msgs: list[dict], system_prompt: str) -> tuple:
            st, renamed = page_chats.rename(page_chats.normalized(st), record(c, msgs, system_prompt), text)
            return opened(st, renamed)

        async def delete_chat(st: Any, c: dict, armed_id: str | None, request: gr.Request) -> tuple:
            if armed_id != c["id"]:  # the first click only asks
                return *[gr.update()] * 8, gr.update(value="Click again to delete"), c["id"]
            st, nxt = page_chats.delete(page_chats.normalized(st), c["id"])
            answers.stop(request.session_hash or "", final=(nxt["messages"], drawn(nxt["messages"]), ""))
            return opened(st, nxt, "chat deleted")

        def refresh_list(st: Any, c: dict, msgs: list[dict], system_prompt: str) -> tuple:
            """The list as the stored chats now are (another tab changed them); the open chat stays as it is."""
            st = page_chats.normalized(st)
            shown = page_chats.find(st, c["id"]) or record(c, msgs, system_prompt)
            return gr.update(choices=page_chats.choices(st, shown), value=c["id"])

        def save_chat(st: Any, c: dict, msgs: list[dict], system_prompt: str) -> tuple:
            st = page_chats.save(page_chats.normalized(st), record(c, msgs, system_prompt))
            shown = page_chats.find(st, c["id"]) or record(c, msgs, system_prompt)
            return st, gr.update(choices=page_chats.choices(st, shown), value=c["id"])

        keep = dict(fn=lambda _: None, inputs=[store], outputs=None, js=WRITE_JS, queue=False,
                    show_progress="hidden")
        demo.load(load_chats, [store, system], chat_outputs + [msg], queue=False, js=FRESH_JS)
        demo.load(None, js=OPEN_LIST_JS)
        chat_list.input(open_chat, [store, chat_list, chat, history, system], chat_outputs, queue=False,
                        js=FRESH_CLOSE_JS).then(**keep)
        new.click(new_conversation, [store, chat, history, system], chat_outputs, queue=False,
                  js=FRESH_CLOSE_JS).then(**keep)
        title.submit(rename_chat, [store, title, chat, history, system], chat_outputs, queue=False,
                     js=FRESH_JS).then(**keep)
        delete.click(delete_chat, [store, chat, armed], chat_outputs, queue=False, js=FRESH_JS).then(**keep)
        save = dict(fn=save_chat, inputs=[store, chat, history, system], outputs=[store, chat_list], queue=False,
                    show_progress="hidden", js=FRESH_JS)
        system.blur(**save).then(**keep)
        refresh.click(refresh_list, [store, chat, history, system], [chat_list], queue=False, js=FRESH_JS,
                      show_progress="hidden")

        # -- asking: a typed message, regenerate, edit-and-resend, undo --------------------------------------
        def take(text: str, msgs: list[dict]):
            if not text.strip():
                return gr.update(), msgs, drawn(msgs)
            msgs = msgs + [{"role": "user", "content": text}]
            return "", msgs, drawn(msgs)

        def regenerate(msgs: list[dict], data: gr.RetryData):
            """Ask again from the user message the retry names (its answer and everything after it go)."""
            origin = page_chats.show(msgs)[1]
            i = origin[data.index] if isinstance(data.index, int) and data.index < len(origin) else len(msgs) - 1
            while i >= 0 and msgs[i]["role"] != "user":
                i -= 1
            msgs = msgs[:i + 1]
            return msgs, drawn(msgs)

        def edited(msgs: list[dict], data: gr.EditData):
            """Edit-and-resend: the edited user message replaces the one it was; what came after goes."""
            origin = page_chats.show(msgs)[1]
            i = origin[data.index] if isinstance(data.index, int) and data.index < len(origin) else None
            if i is None or msgs[i]["role"] != "user":
                return msgs, drawn(msgs)
            msgs = msgs[:i] + [{"role": "user", "content": str(data.value)}]
            return msgs, drawn(msgs)

        def undo(msgs: list[dict], data: gr.UndoData):
            """Take back the last question: it goes back into the message box."""
            origin = page_chats.show(msgs)[1]
            i = origin[data.index] if isinstance(data.index, int) and data.index < len(origin) else len(msgs) - 1
            return msgs[:i], drawn(msgs[:i]), msgs[i].get("content") or "" if i < len(msgs) else ""

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
                        if entry.cleared:  # this event's last write, so no update of ours lands after it
                            yield entry.final
                            return
                        yield update
            finally:  # also when gradio closes this generator (page gone): the request is cancelled at once
                answers.done(session, entry)

        async def answer_events(msgs: list[dict], system_prompt: str, temp: float, p: float, n: int, as_json: bool,
                                schema_text: str, tools_text: str, choice: str, entry: Answers.Answer):
            convo = ([{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []) + \
                page_chats.for_model(msgs)
            try:
                tool_list, logits = await asyncio.to_thread(page_constraint, gen, as_json, schema_text, tools_text,
                                                            choice)
                cfg = page_sampling(gen, temp, p, n)
                # rendering and tokenizing a long chat takes a while: off the event loop the API shares
                fitted = await asyncio.to_thread(conversation.prompt, gen.tokenizer, convo, tool_list,
                                                 fit=(gen.max_context, min(cfg.max_new_tokens, gen.max_context // 2)))
                fmt = gen.tokenizer.thinking
                think = thinking.row_state(fmt, fitted.opened, service.reasoning_budget, logits is not None)
                if think is not None:
                    logits = logits or RowLogits()
                    logits.think = think
                req, events = await service.generate(fitted.ids, cfg, logits=logits)
                answers.running(entry, req)
            except EdgeChatError as e:
                yield msgs, drawn(msgs), f"⚠️ {e}"
                return
            # an answer's notes show on its stats line (page_chats.show_answer): where a context shift is said too
            notes = [f"dropped {fitted.dropped} old message(s) to fit the context"] if fitted.dropped else []
            yield msgs, drawn(msgs), "generating…"  # at once: the events show no progress overlay (see below)
            reply, thought, last_yield = "", "", 0.0
            split = thinking.Splitter(fmt, fitted.opened)
            async for ev in events:
                r, c = split.push(ev.text)
                if ev.finish_reason:
                    more = split.finish()
                    r, c = r + more[0], c + more[1]
                reply, thought = reply + c, thought + r
                mind = ({"thinking": thought} if thought else {}) | ({"format": "json"} if as_json else {})
                shown = msgs + [{"role": "assistant", "content": reply} | mind
                                | ({"thinking_now": True} if thought and not reply else {})]
                if ev.finish_reason:
                    done = {"role": "assistant", "content": reply} | mind
                    if tool_list and choice != "none":
                        parsed = toolfmt.parse_calls(reply)
                        if parsed.tool_calls:
                            done = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls} \
                                | mind
                    s = ev.stats
                    done["stats"] = {"completion_tokens": s["completion_tokens"], "finish": ev.finish_reason,
                                     "decode_tok_s": round(float(s.get("decode_tok_s") or 0.0), 2),
                                     "ttft_s": round(float(s.get("ttft_s") or 0.0), 4)}
                    done["notes"] = notes
                    shown = msgs + [done]
                    if ev.finish_reason == "cancelled":
                        yield shown, drawn(shown), f"stopped · {s['completion_tokens']} tokens"
                        return
                    cached = f" · {s['cached_prompt_tokens']} prompt tokens cached" if s.get("cached_prompt_tokens") else ""
                    line = (f"TTFT {s['ttft_s'] * 1000:.0f} ms · {s['decode_tok_s']:.1f} tok/s · "
                            f"{s['completion_tokens']} tokens · {ev.finish_reason}{cached}"
                            + "".join(f" · {x}" for x in notes))
                    yield shown, drawn(shown), line
                elif ev.text and time.monotonic() - last_yield >= UI_UPDATE_S:
                    # coalesce tokens: re-rendering the chat per token costs the browser and the device CPU
                    last_yield = time.monotonic()
                    yield shown, drawn(shown), "thinking…" if thought and not reply else "generating…"

        inputs = [history, system, temperature, top_p, max_tokens, json_mode, schema, tools, tool_choice]
        ask = dict(fn=answer, inputs=inputs, outputs=[history, chatbot, stats], show_progress="hidden")
        def saved(event):
            """`event`, then the open chat saved into the stored chats and those written to localStorage."""
            return event.then(**save).then(**keep)

        # each turn is saved as soon as it is asked (a reload mid-answer keeps the question) and when answered
        for trigger in (msg.submit, send.click):
            saved(saved(trigger(take, [msg, history], [msg, history, chatbot], queue=False)).then(**ask))
        saved(chatbot.retry(regenerate, [history], [history, chatbot], queue=False).then(**ask))
        saved(saved(chatbot.edit(edited, [history], [history, chatbot], queue=False)).then(**ask))
        saved(chatbot.undo(undo, [history], [history, chatbot, msg], queue=False))

        # Stop cancels the session's request (Answers); the answer's event then ends by itself with "stopped"
        # on the status line. The answer events show no progress overlay: the status line and the streaming
        # text already show progress.
        async def stop_answer(request: gr.Request) -> None:
            answers.stop(request.session_hash or "")

        stop.click(stop_answer, None, None, queue=False, show_progress="hidden")

        async def clear_chat(request: gr.Request) -> tuple[list, list, str]:
            answers.stop(request.session_hash or "", clear=True)  # a streaming answer would refill the chat
            return [], [], ""

        saved(clear.click(clear_chat, None, [history, chatbot, stats], queue=False))
        # the chatbot's own trash icon clears the conversation too, not just the screen (the next turn would
        # still send the old history)
        async def clear_history(request: gr.Request):
            return (await clear_chat(request))[::2]

        saved(chatbot.clear(clear_history, None, [history, stats], queue=False))
    demo.queue(default_concurrency_limit=None)
    return demo
