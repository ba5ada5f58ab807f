"""Tool calling: tools into the prompt, a grammar that keeps a call to the tools' schemas, calls out of the text.

Format: a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the Hermes / Qwen format).
- When the bundle's chat template takes `tools` (it uses the variable), the tools, the assistant's earlier
  calls (`tool_calls`, arguments as objects) and `role: "tool"` results go to the template as they are:
  the model is prompted the way it was trained. A template that takes tools but never writes
  `<tool_call>` (Llama 3.x) is prompted its own way; the answer is still kept to the format above.
- Otherwise (SmolLM2, most small models) the fallback: the tools and the format go into the system
  message (`FALLBACK_PROMPT`), earlier calls become the assistant's text in the same format and tool
  results become user turns `<tool_response>...</tool_response>`, which any template renders.

tool_choice: "none" renders the tools but leaves the answer free; "auto" allows either plain text (not
starting with "<" or whitespace) or calls; "required" and a named function allow only calls. The grammar
(edge.decode.grammar, llguidance Lark with the tools' JSON schemas inline) makes every call parse and follow its
function's parameters schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edge.decode.grammar import JSON_OPTIONS, Grammar, GrammarVocab, compile_json, compile_lark

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FALLBACK_PROMPT = """You can call these functions (JSON schemas of their arguments):
{tools}
To call a function, answer with only:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments as JSON>}}}}
</tool_call>
Results come back in <tool_response></tool_response>. If no function is needed, answer normally."""
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def template_takes_tools(chat_template: str) -> bool:
    """Whether a chat template reads the `tools` variable (so it has its own way of showing them)."""
    from jinja2 import meta

    from edge.decode.tokenizer import _template_env

    env, jinja2 = _template_env()  # the tokenizer's settings: loop controls as in Hugging Face templates
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return False


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON, else the text as sent (a client's earlier call may
    hold anything, even JSON nested deeper than the parser's recursion limit: that stays text, never a 500)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def prompt_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """The conversation as the template should see it: unchanged for a template that takes tools (with
    arguments as objects, as Hugging Face templates expect), else with the fallback's system text and the
    calls and results written out as text."""
    if native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                            "arguments": _arguments(c["function"]["arguments"])}}
                                         for c in m["tool_calls"]]}
            out.append(m)
        return out
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c['function']['arguments'])}, ensure_ascii=False)}\n{CLOSE}"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools:
        listing = "\n".join(json.dumps({"name": t["function"]["name"],
                                        "description": t["function"].get("description") or "",
                                        "parameters": t["function"].get("parameters") or {"type": "object"}},
                                       ensure_ascii=False) for t in tools)
        text = FALLBACK_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _rebase_refs(node: Any, base: str) -> Any:
    """`node` with every local `$ref` ("#", "#/$defs/X", "#/properties/..") moved under the JSON pointer `base`:
    a tool's parameters schema sits inside the call's wrapper schema, where "#" is the wrapper, so the
    `$defs`/`$ref` pydantic writes would point nowhere."""
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _call_schema(tools: list[dict]) -> dict:
    """A call of any of `tools`: {"name": one of them, "arguments": that one's parameters}."""
    def where(i: int) -> str:
        return "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{i}/properties/arguments"

    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": _rebase_refs(t["function"].get("parameters") or {"type": "object"}, where(i))},
        "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def call_grammar(vocab: GrammarVocab, tools: list[dict], choice: Any, parallel: bool) -> Grammar | None:
    """The grammar for an answer under tool_choice `choice` (None for "none": the answer is free).
    GrammarError (-> 400) names the tool whose parameters schema cannot be used."""
    if choice == "none":
        return None
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    for t in tools:  # a bad parameters schema is named by its tool, not lost in the combined grammar
        compile_json(vocab, t["function"].get("parameters") or {"type": "object"},
                     what=f"tool '{t['function']['name']}' parameters schema")
    schema = json.dumps(_call_schema(tools))
    call = f'"{OPEN}\\n" %json{schema} "\\n{CLOSE}"'
    calls = f'call ("\\n" call)*' if parallel else "call"
    start = f"start: calls | TEXT\nTEXT: /[^<\\s][\\s\\S]*/\n" if choice in (None, "auto") else "start: calls\n"
    lark = f"{start}calls: {calls}\ncall: {call}\n"
    return compile_lark(vocab, lark, "the tools' parameters")


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict]


def parse_calls(text: str) -> Parsed:
    """The answer's tool calls (OpenAI's shape, arguments as JSON text) and the text around them. A block
    that does not parse stays in the content (it cannot happen under the grammar, but can under "none")."""
    calls, rest, last = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        rest.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    rest.append(text[last:])
    content = "".join(rest).strip() if calls else text
    return Parsed(content or None if calls else content, calls)


def may_be_call(text: str) -> bool:
    """While streaming: whether the text so far may still turn into a call (so it is held back)."""
    s = text.lstrip()
    return s == "" or s.startswith(OPEN) or OPEN.startswith(s)


# the start of a call as the call grammar writes it (JSON_OPTIONS: no free whitespace, the wrapper's keys in order)
_HEAD = re.compile(r"\s*" + re.escape(OPEN) + r'\n\{"name": "([a-zA-Z0-9_-]{1,64})", "arguments": ')
_TAIL = re.compile(r"\}\n" + re.escape(CLOSE))


@dataclass
class CallSoFar:
    name: str
    arguments: str  # the arguments' JSON text as far as it is written
    whole: bool  # the arguments' JSON value is closed


def calls_so_far(text: str) -> list[CallSoFar]:
    """While a tool-calling answer streams: its calls so far, each with its name and as much of its arguments'
    JSON text as is written, so a client can be sent the arguments as they come (Anthropic's input_json_delta).
    Reads the shape the call grammar writes (`call_grammar`); text in any other shape gives no calls (the
    answer is then parsed whole when it ends, `parse_calls`). Parses from the start each time: a call is short."""
    out: list[CallSoFar] = []
    pos = 0
    while True:
        m = _HEAD.match(text, pos)
        if m is None:
            return out
        end = _json_end(text, m.end())
        if end is None:
            out.append(CallSoFar(m.group(1), text[m.end():], False))
            return out
        out.append(CallSoFar(m.group(1), text[m.end():end], True))
        tail = _TAIL.match(text, end)
        if tail is None:
            return out
        pos = tail.end()


def _json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that starts at `start`, or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
