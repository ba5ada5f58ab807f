"""Messages (and tools) -> the prompt ids and the row's constraint: the one conversation path.

The CLI's chat (edge.decode.chat), the page (edge.serve.webui) and the OpenAI API (edge.serve.openai_answers) all
turn a conversation into a prompt here, so a template, a tool format or a fitting rule changes in one place:
- tools and tool turns are written the way the chat template takes them (its own `tools` variable when it
  has one, else the fallback prompt of edge.decode.tools);
- `fit`: the oldest non-system turns are dropped until the prompt and the answer's reserve fit the context
  (the page and the CLI; the API refuses an overflow instead);
- `constraint`: the grammar a row decodes under, from tools (a call to one of them) or a response format
  (any JSON object, or one JSON schema).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge.decode import tools as toolfmt
from edge.decode.grammar import Grammar, GrammarVocab, compile_json
from edge.decode.tokenizer import ChatTokenizer
from edge.errors import ContextOverflowError


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    messages: list[dict]  # what the template was given (tools written in, old turns dropped)
    dropped: int = 0  # messages dropped to fit the context


def _written(tokenizer: ChatTokenizer, messages: list[dict],
             tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages with tools and tool turns in the template's format, and the tools the template takes
    itself (None when it has no `tools` variable and they were written into the messages)."""
    native = bool(tools) and toolfmt.template_takes_tools(tokenizer.spec.chat_template)
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        messages = toolfmt.prompt_messages(messages, tools, native)
    return messages, tools if native else None


def prompt(tokenizer: ChatTokenizer, messages: list[dict], tools: list[dict] | None = None,
           fit: tuple[int, int] | None = None, answer_start: str = "") -> Prompt:
    """The prompt of a conversation. `fit` = (context, reserve): drop the oldest non-system turns (a user turn
    with its answer) until the prompt plus `reserve` new tokens fit `context`; ContextOverflowError when the
    last message alone does not. `answer_start`: text the answer begins with (Anthropic's final assistant
    message), written after the assistant's header; the answer continues it."""
    messages, template_tools = _written(tokenizer, messages, tools)
    start = tokenizer.encode(answer_start) if answer_start else []
    if fit is None:
        return Prompt(tokenizer.encode_chat(messages, tools=template_tools) + start, messages)
    context, reserve = fit
    limit = context - reserve
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    dropped = 0
    while True:
        kept = system + rest
        ids = tokenizer.encode_chat(kept, tools=template_tools) + start
        if len(ids) <= limit:
            return Prompt(ids, kept, dropped)
        if len(rest) <= 1:
            raise ContextOverflowError(
                f"the last message alone needs {len(ids)} tokens but only {limit} fit "
                f"(context {context} minus {reserve} for the answer): shorten it or lower max_new_tokens")
        drop = 2 if len(rest) > 2 and rest[0]["role"] == "user" and rest[1]["role"] == "assistant" else 1
        rest = rest[drop:]
        dropped += drop


def constraint(tokenizer: ChatTokenizer, vocab_size: int, tools: list[dict] | None = None, tool_choice: Any = None,
               parallel_tool_calls: bool = False, json_schema: dict | None = None, json_mode: bool = False,
               what: str = "the JSON schema") -> Grammar | None:
    """The grammar a row decodes under: a call to the tools (unless tool_choice is "none"), else any JSON object
    (`json_mode`) or one that follows `json_schema`; None when nothing constrains it. Compiling can take a while
    for a large schema: callers on an event loop run it in a thread."""
    wants_tools = bool(tools) and tool_choice != "none"
    if not wants_tools and not json_mode and json_schema is None:
        return None
    gv = GrammarVocab.for_tokenizer(tokenizer, vocab_size)
    if wants_tools:
        return toolfmt.call_grammar(gv, tools, tool_choice, parallel_tool_calls)
    return compile_json(gv, json_schema, what=what) if json_schema is not None else compile_json(gv, None)
