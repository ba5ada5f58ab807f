"""edge/serve/page_chats.py: the page's stored chats and how an answer is drawn, without a browser."""

from __future__ import annotations

from edge.serve import page_chats as pc


def _chat(text: str, **kw) -> dict:
    return dict(pc.new_chat(), messages=[{"role": "user", "content": text}], **kw)


def test_what_the_browser_hands_back_is_checked_not_trusted():
    for junk in (None, [], "x", {"version": 99, "chats": []}, {"version": 1, "chats": "no"}):
        assert pc.normalized(junk) == pc.empty_store()
    store = {"version": 1, "current": "gone", "chats": [
        {"id": "a", "title": "t" * 500, "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"},
                                                     "junk", {"role": "assistant", "content": 3}]},
        {"no id": True}, {"id": "b", "messages": "not a list"}]}
    n = pc.normalized(store)
    assert [c["id"] for c in n["chats"]] == ["a"] and n["current"] is None
    assert n["chats"][0]["messages"] == [{"role": "user", "content": "hi"}]
    assert len(n["chats"][0]["title"]) == pc.TITLE_CHARS


def test_save_titles_orders_caps_and_skips_empty_chats():
    store = pc.empty_store()
    empty = pc.new_chat()
    store = pc.save(store, empty)
    assert store["chats"] == [] and store["current"] == empty["id"]  # nothing in it: not kept
    assert pc.choices(store, empty) == [(pc.NEW_TITLE, empty["id"])]
    first = _chat("  What is\nthe capital   of Japan? " + "x" * 100)
    store = pc.save(store, first)
    assert store["chats"][0]["title"].startswith("What is the capital of Japan? x") and \
        store["chats"][0]["title"].endswith("…") and len(store["chats"][0]["title"]) == pc.TITLE_CHARS
    second = _chat("Second")
    store = pc.save(store, second)
    assert [c["id"] for c in store["chats"]] == [second["id"], first["id"]]  # newest first
    store = pc.save(store, pc.find(store, first["id"]))
    assert [c["id"] for c in store["chats"]] == [first["id"], second["id"]] and store["current"] == first["id"]
    assert pc.kept(dict(pc.new_chat(), system="Be brief.")) and pc.kept(dict(pc.new_chat(), titled=True))
    for i in range(pc.MAX_CHATS + 5):
        store = pc.save(store, _chat(f"q{i}"))
    assert len(store["chats"]) == pc.MAX_CHATS and store["chats"][0]["title"] == f"q{pc.MAX_CHATS + 4}"


def test_rename_and_delete():
    store = pc.save(pc.empty_store(), _chat("one"))
    two = _chat("two")
    store = pc.save(store, two)
    store, renamed = pc.rename(store, pc.find(store, two["id"]), "  My   chat ")
    assert renamed["title"] == "My chat" and pc.find(store, two["id"])["title"] == "My chat"
    store = pc.save(store, dict(pc.find(store, two["id"]), messages=two["messages"] * 2))
    assert pc.find(store, two["id"])["title"] == "My chat"  # a title given by hand stays
    store, renamed = pc.rename(store, renamed, "")
    assert renamed["title"] == "two" and not renamed["titled"]  # empty: back to the automatic title
    store, nxt = pc.delete(store, two["id"])
    assert [c["title"] for c in store["chats"]] == ["one"] and nxt["title"] == "one" and store["current"] == nxt["id"]
    store, nxt = pc.delete(store, nxt["id"])
    assert store["chats"] == [] and nxt["messages"] == [] and store["current"] == nxt["id"]


def test_an_answer_is_drawn_with_its_stats_and_mapped_back_to_its_message():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a <b>", "notes": ["dropped 2 old message(s) to fit the context"],
             "stats": {"completion_tokens": 20, "decode_tok_s": 35.25, "ttft_s": 0.04, "finish": "length"}},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "stats": {"completion_tokens": 3, "finish": "cancelled"},
             "tool_calls": [{"function": {"name": "add", "arguments": "{\"a\": 1}"}}]}]
    drawn, origin = pc.show(msgs)
    assert origin == [1, 2, 3, 4] and [d["role"] for d in drawn] == ["user", "assistant", "user", "assistant"]
    assert drawn[1]["content"] == ('a <b>\n\n<div class="answer-stats">20 tokens · 35.2 tok/s · TTFT 40 ms · length · '
                                   'dropped 2 old message(s) to fit the context</div>')
    assert "🔧 **add**" in drawn[3]["content"] and "stopped · 3 tokens" in drawn[3]["content"]
    assert pc.stats_line({"completion_tokens": 5, "decode_tok_s": 10, "ttft_s": 0.001, "finish": "stop"}) == \
        "5 tokens · 10.0 tok/s · TTFT 1 ms"
    # the model gets only what it reads
    assert pc.for_model(msgs[1:3]) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a <b>"}]


def test_a_json_mode_answer_is_drawn_as_written():
    """JSON mode's answer is drawn in a code block, not as Markdown: a string's escaped backslash stayed one
    backslash on the page (`"\\ x"` read back is not JSON; the browser test's answer once was); a fence is longer
    than any backtick run in the text."""
    raw = '{"name": "a\\\\ b*c*", "code": "```x```"}'
    drawn = pc.show_answer({"role": "assistant", "content": raw, "format": "json"})[0]["content"]
    assert drawn == f"````json\n{raw}\n````"
    assert pc.show_answer({"role": "assistant", "content": raw})[0]["content"] == raw  # not JSON mode: as before
    assert pc.for_model([{"role": "assistant", "content": raw, "format": "json"}]) == [{"role": "assistant", "content": raw}]
