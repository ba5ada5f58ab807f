"""The Gradio chat page: streaming answers, history, system prompt, sampling controls, stop, clear, JSON mode
and tools (the API's response_format and tools, shown: a tool call appears in the chat as a call block).

The conversation lives in a `gr.State` as plain {role, content} messages; the
chatbot only displays it. Answers go through the same scheduler as the API.
Nothing here loads from the network: system fonts only, no analytics, no share
link.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr

from edge import tools as toolfmt
from edge.chat import fit_messages
from edge.errors import EdgeChatError
from edge.grammar import GrammarVocab, compile_json
from edge.logits import RowLogits

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
    vocab = gen.decoder.dims.vocab_size
    if tools and choice != "none":
        grammar = toolfmt.call_grammar(GrammarVocab.for_tokenizer(gen.tokenizer, vocab), tools, choice, False)
        return tools, RowLogits(grammar=grammar)
    if json_mode:
        schema = parsed(schema_text, "JSON schema") if (schema_text or "").strip() else None
        return tools, RowLogits(grammar=compile_json(GrammarVocab.for_tokenizer(gen.tokenizer, vocab), schema))
    return tools, None


def show_message(m: dict) -> dict:
    """A message as the chatbot shows it: tool calls as call blocks, tool results labelled."""
    if m.get("tool_calls"):
        blocks = "\n".join(f"🔧 **{c['function']['name']}**\n```json\n{c['function']['arguments']}\n```"
                           for c in m["tool_calls"])
        return {"role": "assistant", "content": ((m["content"] or "") + "\n" + blocks).strip()}
    return {"role": m["role"], "content": m["content"]}


def build_ui(service) -> gr.Blocks:
    gen = service.gen
    defaults = gen.sampling()
    with gr.Blocks(title=f"EdgeChat · {service.model_id}", analytics_enabled=False) as demo:
        gr.Markdown(f"### EdgeChat · {service.model_id}\n"
                    f"`{service.precision}` on {service.backend} · context {gen.max_context} tokens",
                    elem_id="model-line")
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

        def show(msgs: list[dict]) -> list[dict]:
            return [show_message(m) for m in msgs if m["role"] != "system"]

        def take(text: str, msgs: list[dict]):
            if not text.strip():
                return gr.update(), msgs, show(msgs)
            msgs = msgs + [{"role": "user", "content": text}]
            return "", msgs, show(msgs)

        async def answer(msgs: list[dict], system_prompt: str, temp: float, p: float, n: int, as_json: bool,
                         schema_text: str, tools_text: str, choice: str):
            if not msgs or msgs[-1]["role"] != "user":
                return
            convo = ([{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []) + msgs
            try:
                tool_list, logits = await asyncio.to_thread(page_constraint, gen, as_json, schema_text, tools_text,
                                                            choice)
                native = bool(tool_list) and toolfmt.template_takes_tools(gen.tokenizer.spec.chat_template)
                if tool_list or any(m.get("tool_calls") for m in convo):
                    convo = toolfmt.prompt_messages(convo, tool_list, native)
                cfg = gen.sampling(max_new_tokens=int(n), temperature=float(temp), top_p=float(p))
                ids, kept, dropped = fit_messages(gen, convo, min(cfg.max_new_tokens, gen.max_context // 2),
                                                  tools=tool_list if native else None)
                _, events = await service.generate(ids, cfg, logits=logits)
            except EdgeChatError as e:
                yield msgs, show(msgs), f"⚠️ {e}"
                return
            note = f" · dropped {dropped} old message(s) to fit the context" if dropped else ""
            yield msgs, show(msgs), "generating…"  # at once: the events show no progress overlay (see below)
            reply, last_yield = "", 0.0
            async for ev in events:
                reply += ev.text
                shown = msgs + [{"role": "assistant", "content": reply}]
                if ev.finish_reason:
                    if tool_list and choice != "none":
                        parsed = toolfmt.parse_calls(reply)
                        if parsed.tool_calls:
                            shown = msgs + [{"role": "assistant", "content": parsed.content,
                                             "tool_calls": parsed.tool_calls}]
                    s = ev.stats
                    cached = f" · {s['cached_prompt_tokens']} prompt tokens cached" if s.get("cached_prompt_tokens") else ""
                    line = (f"TTFT {s['ttft_s'] * 1000:.0f} ms · {s['decode_tok_s']:.1f} tok/s · "
                            f"{s['completion_tokens']} tokens · {ev.finish_reason}{cached}{note}")
                    yield shown, show(shown), line
                elif ev.text and time.monotonic() - last_yield >= UI_UPDATE_S:
                    # coalesce tokens: re-rendering the chat per token costs the browser and the device CPU
                    last_yield = time.monotonic()
                    yield shown, show(shown), "generating…"

        inputs = [history, system, temperature, top_p, max_tokens, json_mode, schema, tools, tool_choice]
        sub = msg.submit(take, [msg, history], [msg, history, chatbot], queue=False).then(
            answer, inputs, [history, chatbot, stats], show_progress="hidden")
        click = send.click(take, [msg, history], [msg, history, chatbot], queue=False).then(
            answer, inputs, [history, chatbot, stats], show_progress="hidden")
        # Stop cancels the answer's event (its generator closes, which cancels the request and frees the slot)
        # and says so on the status line, which would otherwise keep "generating…". The answer events show no
        # progress overlay: a cancelled event's overlay reads "Error" (gradio 6), and the status line and the
        # streaming text already show progress.
        stop.click(None, None, None, cancels=[sub, click])
        stop.click(lambda: "stopped", None, stats, queue=False, show_progress="hidden")
        clear.click(lambda: ([], [], ""), None, [history, chatbot, stats], queue=False)
        # the chatbot's own trash icon clears the conversation too, not just the screen (the next turn would
        # still send the old history)
        chatbot.clear(lambda: ([], ""), None, [history, stats], queue=False)
    demo.queue(default_concurrency_limit=None)
    return demo
