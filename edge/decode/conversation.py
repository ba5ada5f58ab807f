"""Messages (and tools) -> the prompt ids and the row's constraint: the one conversation path.

The CLI's chat (edge.decode.chat), the page (edge.serve.webui) and the APIs (edge.serve.openai_answers) all
turn a conversation into a prompt here, so a template, a tool format or a fitting rule changes in one place:
- tools and tool turns are written the way the chat template takes them (its own `tools` variable when it
  has one, else the fallback prompt of edge.decode.tools);
- `fit`: the oldest turns are dropped (never the system prompt or the last turn) until the prompt and the
  answer's reserve fit the context, past a grid point so that the chat's next request drops the same turns and
  the prompt cache still serves it (the page, the CLI, and the chat APIs unless `--context-overflow error`);
- `constraint`: the grammar a row decodes under, from tools (a call to one of them) or a response format
  (any JSON object, or one JSON schema);
- `template_kwargs` (the API's chat_template_kwargs, e.g. enable_thinking) go to the template render, and the
  prompt says whether it opened a think block (edge.decode.thinking) the answer starts inside.
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
    opened: bool = False  # the prompt ends inside a think block it opened (edge.decode.thinking)


def _written(tokenizer: ChatTokenizer, messages: list[dict],
             tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages with tools and tool turns in the template's format, and the tools the template takes
    itself (None when it has no `tools` variable and they were written into the messages)."""
    native = bool(tools) and toolfmt.template_takes_tools(tokenizer.spec.chat_template)
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        messages = toolfmt.prompt_messages(messages, tools, native)
    return messages, tools if native else None


def _prompt(tokenizer: ChatTokenizer, ids: list[int], messages: list[dict], dropped: int = 0) -> Prompt:
    fmt = tokenizer.thinking
    return Prompt(ids, messages, dropped, opened=fmt is not None and fmt.opens_in(tokenizer, ids))


def prompt(tokenizer: ChatTokenizer, messages: list[dict], tools: list[dict] | None = None,
           fit: tuple[int, int] | None = None, answer_start: str = "",
           template_kwargs: dict | None = None) -> Prompt:
    """The prompt of a conversation. `fit` = (context, reserve): when the prompt plus `reserve` new tokens would
    not fit `context`, the oldest turns are dropped (a turn: a user message and what follows it up to the next
    one, so a tool call stays with its result); never the system prompt, never the last turn;
    ContextOverflowError when those two alone do not fit. `answer_start`: text the answer begins with
    (Anthropic's final assistant message), written after the assistant's header; the answer continues it.
    NoChatTemplateError (edge.decode.tokenizer) for a bundle without a template."""
    start = tokenizer.encode(answer_start) if answer_start else []
    if fit is None:
        written, template_tools = _written(tokenizer, messages, tools)
        ids = tokenizer.encode_chat(written, tools=template_tools, template_kwargs=template_kwargs) + start
        return _prompt(tokenizer, ids, written)
    return _fitted(tokenizer, messages, tools, start, *fit, template_kwargs=template_kwargs)


def _turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(the system message, if the conversation starts with one; the rest in turns). A turn starts at a user
    message and holds what follows it up to the next one: the answer, tool calls and their results, so dropping
    a whole turn never parts a call from its result."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns: list[list[dict]] = []
    for m in messages[len(system):]:
        if m["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(m)
    return system, turns


def _size(tokenizer: ChatTokenizer, turn: list[dict]) -> int:
    """About how many tokens a turn takes (its text, plus a few per message for the template): only to place
    the drop points on a grid, so it depends on the turn alone."""
    return sum(len(tokenizer.encode(m.get("content") or "")) + 4 + sum(
        len(tokenizer.encode(c["function"]["arguments"])) for c in m.get("tool_calls") or []) for m in turn)


def _fitted(tokenizer: ChatTokenizer, messages: list[dict], tools: list[dict] | None, start: list[int],
            context: int, reserve: int, template_kwargs: dict | None = None) -> Prompt:
    """The prompt with the fewest oldest turns dropped past a grid point (see `prompt`)."""
    limit = context - reserve
    if limit <= 0:
        raise ContextOverflowError(f"{reserve} new tokens asked for, but this model's context is {context} tokens: "
                                   "ask for fewer")

    def encoded(kept: list[dict]) -> tuple[list[int], list[dict]]:
        written, template_tools = _written(tokenizer, kept, tools)
        return tokenizer.encode_chat(written, tools=template_tools, template_kwargs=template_kwargs) + start, written

    ids, written = encoded(messages)
    if len(ids) <= limit:
        return _prompt(tokenizer, ids, written)
    system, turns = _turns(messages)
    if not turns:  # the system message is all there is
        raise ContextOverflowError(f"the system prompt alone needs {len(ids)} tokens but only {limit} fit (context "
                                   f"{context} minus {reserve} for the answer): shorten it or ask for fewer new tokens")
    last, _ = encoded(system + turns[-1])
    if len(last) > limit:
        raise ContextOverflowError(
            f"the last turn alone (with the system prompt) needs {len(last)} tokens but only {limit} fit "
            f"(context {context} minus {reserve} for the answer): shorten it or ask for fewer new tokens")
    sizes = [_size(tokenizer, t) for t in turns]

    def fits(d: int) -> bool:
        return len(encoded(system + [m for t in turns[d:] for m in t])[0]) <= limit

    # the fewest turns to drop: guessed from the sizes, then checked (a kept prompt is short to encode)
    need, gone = 0, 0
    while need < len(turns) - 1 and gone < len(ids) - limit:
        gone += sizes[need]
        need += 1
    while not fits(need):
        need += 1
    while need > 1 and fits(need - 1):
        need -= 1
    # Drop on a grid (every half of the room past the system prompt, in the turns' own sizes), not just enough:
    # the next request of this chat then drops the same turns, so its prompt starts as this one did and the
    # prompt cache serves it, until the chat has grown by another half room (llama.cpp shifts half too).
    step = max(1, (limit - len(encoded(system + [{"role": "user", "content": ""}])[0])) // 2)
    done = sum(sizes[:need])
    grid = -(-done // step) * step
    drop = need
    while drop < len(turns) - 1 and sum(sizes[:drop]) < grid:
        drop += 1
    kept = system + [m for t in turns[drop:] for m in t]
    ids, written = encoded(kept)
    return _prompt(tokenizer, ids, written, len(messages) - len(kept))


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
