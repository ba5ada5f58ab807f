"""The page's conversations as the browser keeps them, and how one conversation is drawn in the chatbot.

The browser's localStorage (key `edgechat-chats-v1`, read and written by the page's JavaScript) holds one JSON object:
`{"version": 1, "current": id, "chats": [{"id", "title", "titled", "system", "messages", "updated"}, ...]}`,
newest first. A message is `{role, content}` as the model gets it, plus what only the page shows: an answer's
`stats` (tokens, tok/s, time to first token, finish reason) and `notes` (e.g. old turns dropped to fit the
context). Everything here is a pure function of that object, so it is tested without a browser; the server
keeps nothing between page loads.

Drawing an answer (`show_answer`) is the one place that decides what sits around an answer's text: today the
per-answer stats line with its notes; a collapsed "thinking" block (a chatbot message with `metadata.title`)
or a "context shifted" note go there too.
"""

from __future__ import annotations

import html
import re
import secrets
import time
from typing import Any

STORE_VERSION = 1
MAX_CHATS = 50  # the newest kept: each save sends the whole store to the server and back (and a site gets ~5 MB)
TITLE_CHARS = 60
NEW_TITLE = "New chat"
MODEL_KEYS = ("role", "content", "tool_calls")  # what the conversation path reads


def empty_store() -> dict:
    return {"version": STORE_VERSION, "current": None, "chats": []}


def new_chat(system: str = "") -> dict:
    return {"id": secrets.token_hex(6), "title": NEW_TITLE, "titled": False, "system": system, "messages": [],
            "updated": time.time()}


def normalized(store: Any) -> dict:
    """The store as read back from the browser, with anything malformed (another version, a hand-edited
    localStorage) dropped rather than crashing the page."""
    if not isinstance(store, dict) or store.get("version") != STORE_VERSION or not isinstance(store.get("chats"), list):
        return empty_store()
    chats = []
    for c in store["chats"]:
        if not (isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("messages"), list)):
            continue
        messages = [m for m in c["messages"] if isinstance(m, dict) and m.get("role") in ("user", "assistant")
                    and isinstance(m.get("content", ""), (str, type(None)))]
        messages = [{k: v for k, v in m.items() if k not in ("thinking", "thinking_now")}
                    | ({"thinking": m["thinking"]} if isinstance(m.get("thinking"), str) else {}) for m in messages]
        chats.append({"id": c["id"], "title": str(c.get("title") or NEW_TITLE)[:TITLE_CHARS],
                      "titled": bool(c.get("titled")), "system": str(c.get("system") or ""),
                      "messages": messages, "updated": float(c.get("updated") or 0)})
    current = store.get("current")
    return {"version": STORE_VERSION, "current": current if any(c["id"] == current for c in chats) else None,
            "chats": chats}


def find(store: dict, chat_id: str | None) -> dict | None:
    return next((c for c in store["chats"] if c["id"] == chat_id), None)


def auto_title(messages: list[dict]) -> str:
    """The first line of the first user message, shortened: what the list shows until the user renames it."""
    first = next((m.get("content") or "" for m in messages if m["role"] == "user"), "")
    line = " ".join(first.split())
    if not line:
        return NEW_TITLE
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1].rstrip() + "…"


def kept(chat: dict) -> bool:
    """A chat is stored once it holds something: a message, a system prompt or a title given by hand."""
    return bool(chat["messages"] or chat["system"].strip() or chat["titled"])


def save(store: dict, chat: dict) -> dict:
    """The store with `chat` written first (newest) and made current; MAX_CHATS kept, newest first."""
    chat = dict(chat, updated=time.time())
    if not chat["titled"]:
        chat["title"] = auto_title(chat["messages"])
    others = [c for c in store["chats"] if c["id"] != chat["id"]]
    chats = ([chat] if kept(chat) else []) + others
    return {"version": STORE_VERSION, "current": chat["id"], "chats": chats[:MAX_CHATS]}


def rename(store: dict, chat: dict, title: str) -> tuple[dict, dict]:
    """(store, chat) with the chat's title set by hand; an empty title goes back to the automatic one."""
    title = " ".join((title or "").split())[:TITLE_CHARS]
    chat = dict(chat, title=title or auto_title(chat["messages"]), titled=bool(title))
    return save(store, chat), chat


def delete(store: dict, chat_id: str) -> tuple[dict, dict]:
    """(store, the chat to show next): the newest remaining one, or a new empty chat."""
    chats = [c for c in store["chats"] if c["id"] != chat_id]
    nxt = chats[0] if chats else new_chat()
    return {"version": STORE_VERSION, "current": nxt["id"], "chats": chats}, nxt


def choices(store: dict, current: dict | None = None) -> list[tuple[str, str]]:
    """(label, id) per stored chat for the list, the current chat first when it is not stored yet."""
    rows = [(c["title"], c["id"]) for c in store["chats"]]
    if current is not None and not any(i == current["id"] for _, i in rows):
        rows.insert(0, (current["title"] if current["titled"] else NEW_TITLE, current["id"]))
    return rows


def for_model(messages: list[dict]) -> list[dict]:
    """The conversation as the model gets it: no page-only keys (stats, notes)."""
    return [{k: m[k] for k in MODEL_KEYS if k in m} for m in messages]


# -- drawing -------------------------------------------------------------------------------------------------

def stats_line(stats: dict | None, notes: list[str] | tuple[str, ...] = ()) -> str:
    """An answer's speed line: tokens, tok/s, time to first token, how it ended, then its notes."""
    parts = []
    if stats:
        n = stats.get("completion_tokens", 0)
        if stats.get("finish") == "cancelled":
            parts.append(f"stopped · {n} tokens")
        else:
            parts += [f"{n} tokens", f"{stats.get('decode_tok_s', 0.0):.1f} tok/s",
                      f"TTFT {stats.get('ttft_s', 0.0) * 1000:.0f} ms"]
            if stats.get("finish") and stats["finish"] != "stop":
                parts.append(str(stats["finish"]))
    parts += list(notes)
    return " · ".join(parts)


THINKING_TITLE = "Thinking"


def show_answer(m: dict) -> list[dict]:
    """An assistant message as the chatbot draws it: a thinking model's think block (kept under "thinking") as
    a message with a title, which the chatbot draws collapsible (open while "thinking_now"), then the answer:
    tool calls as call blocks, then the stats line (no empty bubble while only the thinking has come)."""
    drawn = []
    if m.get("thinking"):
        drawn.append({"role": "assistant", "content": m["thinking"],
                      "metadata": {"title": THINKING_TITLE, "status": "pending" if m.get("thinking_now") else "done"}})
        if not (m.get("content") or m.get("tool_calls") or m.get("stats")):
            return drawn
    return drawn + _answer(m)


def fenced(text: str, lang: str = "") -> str:
    """`text` as a Markdown code block, drawn verbatim: a JSON answer's backslashes and asterisks are not Markdown
    (the chatbot drew a JSON string's escaped backslash as a lone one, which is not JSON); the fence is longer
    than any backtick run inside."""
    runs = [len(r) for r in re.findall(r"`+", text)]
    fence = "`" * max(3, max(runs, default=0) + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def _answer(m: dict) -> list[dict]:
    content = m.get("content") or ""
    if content and m.get("format") == "json":  # JSON mode's answer: shown as written
        content = fenced(content, "json")
    if m.get("tool_calls"):
        blocks = "\n".join(f"🔧 **{c['function']['name']}**\n{fenced(c['function']['arguments'], 'json')}"
                           for c in m["tool_calls"])
        content = (content + "\n" + blocks).strip()
    line = stats_line(m.get("stats"), m.get("notes") or ())
    if line:
        content += f'\n\n<div class="answer-stats">{html.escape(line)}</div>'
    return [{"role": "assistant", "content": content}]


def show(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """(what the chatbot draws, for each drawn message the index of the message it came from): the chatbot's
    retry and edit events name a drawn message, the conversation is edited by its own index."""
    drawn: list[dict] = []
    origin: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue
        parts = show_answer(m) if m["role"] == "assistant" else [{"role": m["role"], "content": m.get("content") or ""}]
        drawn += parts
        origin += [i] * len(parts)
    return drawn, origin
