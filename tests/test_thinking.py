"""Thinking models and base models, end to end on a tiny random-init model whose tokenizer has <think> and
</think> as added tokens and whose chat template writes them (Qwen3 / DeepSeek-R1 style): the think block as
`reasoning_content` (whole and streamed, through the real server and the official openai client),
chat_template_kwargs, the reasoning budget (the close tag forced through the one decode loop, counted in
tokens), grammars after the block, the CLI and the page; and a bundle without a chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import ServerProcess, make_tiny_model, run_cli, served
from edge.decode import thinking
from edge.decode.thinking import Splitter, ThinkFormat, ThinkState

openai = pytest.importorskip("openai")

# the generation prompt opens the block (the answer starts inside it) unless enable_thinking is false, when it
# writes an empty block, as Qwen3's template does
OPENS = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
         "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
         "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
FMT = ThinkFormat("<think>", "</think>", (7,), (8,), (8, 9))
HELLO = [{"role": "user", "content": "Hello"}]
SAMPLED = dict(temperature=1.0, seed=3)  # a random model's greedy answer is newlines only: sample, seeded
ADD = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def think_bundle(tmp_path_factory):
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path_factory.mktemp("think") / "tiny-thinker", chat_template=OPENS,
                          added_tokens=("<think>", "</think>"), max_pos=1024)
    out = tmp_path_factory.mktemp("bundles") / "think.bundle"
    return build(BuildOptions(output=out, model=str(src), precisions=("fp32",), max_context=1024, eval_samples=2,
                              calibration_samples=2, skip_eval=True, fused=False), log=lambda s: None)


@pytest.fixture(scope="module")
def server(think_bundle):
    yield from served(think_bundle.root, "--no-ui", "--reasoning-budget", "6")


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _raw(choice) -> list[str]:
    """The answer's tokens as text, from the logprobs (each token's bytes): what the model really wrote."""
    return [bytes(t.bytes).decode("utf-8", "replace") for t in choice.logprobs.content]


# -- the split, piece by piece ---------------------------------------------------------------------------

@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("text, opened, want", [
    ("<think>\nhmm, let me see\n</think>\n\nThe answer.", False, ("hmm, let me see", "The answer.")),
    ("\nhmm\n\n</think>\n\nAns  ", True, ("hmm", "Ans  ")),
    ("Plain <think> answer", False, (None, "Plain <think> answer")),
    ("  <think>never closed  \n", False, ("never closed", "")),
    ("never closed, opened by the prompt </thi", True, ("never closed, opened by the prompt </thi", "")),
    ("<thi", False, (None, "<thi")),
])
def test_splitter_gives_the_same_split_whatever_the_pieces(text, opened, want, step):
    s = Splitter(FMT, opened)
    got = ["", ""]
    for i in range(0, len(text), step):
        r, c = s.push(text[i:i + step])
        got[0] += r
        got[1] += c
    r, c = s.finish()
    assert ((got[0] + r) if s.thought else None, got[1] + c) == want == thinking.split(text, FMT, opened)


def test_no_format_leaves_the_text_alone():
    assert thinking.split("<think>x</think>y", None) == (None, "<think>x</think>y")


def test_think_state_opens_counts_and_forces_the_close_then_the_grammar_applies(think_bundle):
    """The model opens the block itself (Qwen3's own template): the open tag is allowed past the grammar at
    the first step; inside the block the grammar waits; after the budget the close tag and a newline are the only
    tokens; then the grammar takes the content."""
    from edge.decode.conversation import constraint
    from edge.decode.generate import Generator
    from edge.decode.logits import RowLogits
    from edge.bundle import Bundle

    tok = Generator.from_bundle(Bundle.open(think_bundle.root), threads=1).tokenizer
    fmt = tok.thinking
    assert fmt is not None and len(fmt.open_ids) == len(fmt.close_ids) == 1  # added tokens: one id each
    vocab = tok.tok.get_vocab_size()
    grammar = constraint(tok, vocab, json_mode=True)
    rl = RowLogits(grammar=grammar, think=thinking.row_state(fmt, False, 2, True))
    x = np.zeros(vocab, np.float32)
    x[fmt.open_ids[0]] = 5.0
    row = rl.process(x)
    assert row[fmt.open_ids[0]] == 5.0 and np.isneginf(row).any()  # open allowed, the grammar masks the rest
    rl.accept(fmt.open_ids[0], x)
    letter = tok.encode("a")[0]  # not JSON: the grammar would forbid it, but it sleeps inside the block
    for _ in range(2):
        assert np.isfinite(rl.process(x)).all()
        rl.accept(letter, x)
    forced = []
    for _ in range(2):
        row = rl.process(x)
        assert np.isfinite(row).sum() == 1
        forced.append(int(np.argmax(row)))
        rl.accept(forced[-1], x)
    assert tuple(forced) == fmt.forced_ids and tok.decode(forced, skip_special_tokens=False) == "</think>\n"
    row = rl.process(x)
    assert not np.isfinite(row[letter]) and np.isfinite(row[tok.encode("{")[0]])  # now the grammar rules


# -- through the server, with the official client ----------------------------------------------------------

def test_whole_answer_has_reasoning_content_and_the_budget_closes_it(server):
    r = _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=14, logprobs=True,
                                                extra_body={"reasoning_budget": 4}, **SAMPLED)
    choice = r.choices[0]
    raw = _raw(choice)
    assert raw.index("</think>") == 4 and raw[5] == "\n"  # 4 thinking tokens, then the forced close and newline
    text = "".join(raw)
    m = choice.message
    assert m.reasoning_content == text.split("</think>")[0].strip() and m.reasoning_content
    assert m.content == text.split("</think>")[1].lstrip() and "think>" not in m.content


def test_the_server_budget_is_the_default_and_minus_one_lifts_it(server):
    c = _client(server)
    r = c.chat.completions.create(model="x", messages=HELLO, max_tokens=12, logprobs=True, **SAMPLED)
    assert _raw(r.choices[0]).index("</think>") == 6  # --reasoning-budget 6
    r = c.chat.completions.create(model="x", messages=HELLO, max_tokens=12, logprobs=True,
                                  extra_body={"reasoning_budget": -1}, **SAMPLED)
    raw = _raw(r.choices[0])
    assert "</think>" not in raw and r.choices[0].finish_reason == "length"
    # never closed: all of it is reasoning, nothing is content
    assert r.choices[0].message.reasoning_content == "".join(raw).strip() and r.choices[0].message.content == ""


def test_streamed_reasoning_is_its_own_delta_field_before_the_content(server):
    c = _client(server)
    ask = dict(model="x", messages=HELLO, max_tokens=16, extra_body={"reasoning_budget": 5}, **SAMPLED)
    whole = c.chat.completions.create(**ask).choices[0].message
    kinds, reasoning, content = [], "", ""
    for chunk in c.chat.completions.create(stream=True, **ask):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r, t = getattr(d, "reasoning_content", None), d.content
        if r:
            reasoning += r
            kinds.append("r")
        if t:
            content += t
            kinds.append("c")
    assert reasoning == whole.reasoning_content and content == whole.content and reasoning and content
    assert "".join(kinds).rstrip("c") == "r" * kinds.count("r")  # every reasoning delta before the content
    assert "think>" not in reasoning + content


def test_enable_thinking_false_gives_no_think_block(server):
    c = _client(server)
    on = c.chat.completions.create(model="x", messages=HELLO, max_tokens=8, **SAMPLED)
    off = c.chat.completions.create(model="x", messages=HELLO, max_tokens=8, logprobs=True,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **SAMPLED)
    assert on.choices[0].message.reasoning_content
    m = off.choices[0].message
    assert m.reasoning_content is None and m.content == "".join(_raw(off.choices[0]))
    # the template wrote the empty block itself: 4 more prompt tokens (</think> and the newlines around it)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_anthropic_route_asks_a_thinking_model_not_to_think(server):
    """Anthropic's thinking is off unless enabled (which this server refuses): /v1/messages renders the thinking
    model's template with enable_thinking false, so its prompt is the OpenAI route's with that switch, and no
    think block reaches the text."""
    import anthropic

    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = a.messages.create(model="x", max_tokens=8, messages=HELLO, extra_body={"temperature": 1.0, "seed": 7})
    off = _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=8, **SAMPLED,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == off.usage.prompt_tokens
    assert a.messages.count_tokens(model="x", messages=HELLO).input_tokens == off.usage.prompt_tokens
    assert all("think>" not in b.text for b in msg.content if b.type == "text")


def _anthropic(server):
    anthropic = pytest.importorskip("anthropic", reason="pip install -e '.[dev]' (anthropic)")
    return anthropic, anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _anthropic_events(server, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    return [(dict(x.split(": ", 1) for x in b.split("\n"))["event"],
             json.loads(dict(x.split(": ", 1) for x in b.split("\n"))["data"])) for b in text.strip().split("\n\n")]


def test_anthropic_thinking_enabled_is_a_thinking_block_whole_and_streamed(server):
    """Anthropic's `thinking: {"type": "enabled", "budget_tokens": N}`: the think block comes as a thinking block
    (with a signature: the SHA-256 of its text) before the text, the budget closes it after N tokens, the same
    thinking and text as the OpenAI route's reasoning_content and content for the same prompt and seed; streamed
    as thinking_delta events then one signature_delta, as Anthropic streams it."""
    import hashlib

    _, a = _anthropic(server)
    ask = dict(model="x", max_tokens=16, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 4},
               extra_body={"temperature": 1.0, "seed": 3})
    msg = a.messages.create(**ask)
    assert [b.type for b in msg.content] == ["thinking", "text"], msg
    thought, text = msg.content[0], msg.content[1].text
    assert thought.signature == "edgechat-sha256:" + hashlib.sha256(thought.thinking.encode()).hexdigest()
    oa = _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=16, logprobs=True,
                                                 extra_body={"reasoning_budget": 4}, **SAMPLED)
    assert _raw(oa.choices[0]).index("</think>") == 4  # budget_tokens is the reasoning budget
    assert thought.thinking == oa.choices[0].message.reasoning_content and thought.thinking
    assert text == oa.choices[0].message.content and "think>" not in text
    assert msg.usage.output_tokens == oa.usage.completion_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == oa.usage.prompt_tokens
    # streamed: message_start, [thinking: start, thinking_delta+, signature_delta, stop], [text ...], message_delta
    body = {k: v for k, v in ask.items() if k != "extra_body"} | ask["extra_body"]
    events = _anthropic_events(server, body)
    names = [n for n, _ in events if n != "ping"]
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    blocks: dict[int, list] = {}
    for n, d in events:
        if n.startswith("content_block_"):
            blocks.setdefault(d["index"], []).append((n, d))
    assert sorted(blocks) == [0, 1]
    start, *deltas, stop = blocks[0]
    assert start[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""} and stop[0].endswith("stop")
    kinds = [d["delta"]["type"] for _, d in deltas]
    assert kinds[-1] == "signature_delta" and set(kinds[:-1]) == {"thinking_delta"}, kinds
    assert "".join(d["delta"]["thinking"] for _, d in deltas[:-1]) == thought.thinking
    assert deltas[-1][1]["delta"]["signature"] == thought.signature
    assert blocks[1][0][1]["content_block"]["type"] == "text"
    assert "".join(d["delta"]["text"] for n, d in blocks[1] if n == "content_block_delta") == text
    # the official client's own accumulation of the stream equals the whole answer
    with a.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    # a later turn sends the thinking block back (as Anthropic's clients do): accepted, dropped from the prompt
    turn = HELLO + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": "And then?"}]
    plain = HELLO + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    assert a.messages.count_tokens(model="x", messages=turn).input_tokens == \
        a.messages.count_tokens(model="x", messages=plain).input_tokens


def test_anthropic_thinking_adaptive_omitted_and_its_errors(server):
    anthropic, a = _anthropic(server)
    how = {"temperature": 1.0, "seed": 3}
    shown = a.messages.create(model="x", max_tokens=16, messages=HELLO, extra_body=how,
                              thinking={"type": "enabled", "budget_tokens": 4})
    omitted = a.messages.create(model="x", max_tokens=16, messages=HELLO, extra_body=how,
                                thinking={"type": "enabled", "budget_tokens": 4, "display": "omitted"})
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
    assert omitted.content[0].signature == shown.content[0].signature  # over the thinking as written
    assert omitted.content[1].text == shown.content[1].text
    # adaptive: the model decides, within the server's --reasoning-budget (6)
    adaptive = a.messages.create(model="x", max_tokens=16, messages=HELLO, extra_body=how, thinking={"type": "adaptive"})
    oa = _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=16, **SAMPLED)
    assert adaptive.content[0].type == "thinking" and adaptive.content[0].thinking == oa.choices[0].message.reasoning_content
    # disabled, as when it is left out: no thinking block
    off = a.messages.create(model="x", max_tokens=16, messages=HELLO, extra_body=how, thinking={"type": "disabled"})
    assert all(b.type == "text" for b in off.content)

    def refused(words: str, **kw) -> None:
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(**{"model": "x", "max_tokens": 16, "messages": HELLO, **kw})
        assert e.value.body["type"] == "error" and words in e.value.body["error"]["message"], e.value.body

    refused("must be less than max_tokens", thinking={"type": "enabled", "budget_tokens": 16})
    refused("needs 'budget_tokens'", thinking={"type": "enabled"})
    refused("cannot be used with 'thinking'", thinking={"type": "enabled", "budget_tokens": 4},
            messages=HELLO + [{"role": "assistant", "content": "Well"}])
    refused('"between_tools"} is not supported', thinking={"type": "between_tools"})


def test_anthropic_thinking_then_a_forced_tool_call(server):
    """The grammar of a forced tool call applies after the think block: a thinking block, then a tool_use block."""
    _, a = _anthropic(server)
    tool = {"name": "add", "input_schema": ADD[0]["function"]["parameters"]}
    one_call = {"type": "any", "disable_parallel_tool_use": True}  # one call (a random model calls again and again)
    msg = a.messages.create(model="x", max_tokens=100, messages=HELLO, tools=[tool], tool_choice=one_call,
                            thinking={"type": "enabled", "budget_tokens": 3}, extra_body={"temperature": 1.0, "seed": 3})
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use", msg.content
    assert msg.content[0].thinking and set(msg.content[1].input) == {"a"}
    with a.messages.stream(model="x", max_tokens=100, messages=HELLO, tools=[tool], tool_choice=one_call,
                           thinking={"type": "enabled", "budget_tokens": 3},
                           extra_body={"temperature": 1.0, "seed": 3}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == msg.content[0].thinking and final.content[1].input == msg.content[1].input


def test_template_kwargs_may_not_replace_the_conversation(server):
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=2,
                                                extra_body={"chat_template_kwargs": {"messages": []}})
    assert "chat_template_kwargs may not set 'messages'" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=2,
                                                extra_body={"chat_template_kwargs": {"no good": 1}})
    assert "chat_template_kwargs" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # the template's own functions stay its own
        _client(server).chat.completions.create(model="x", messages=HELLO, max_tokens=2,
                                                extra_body={"chat_template_kwargs": {"raise_exception": 1}})
    assert "one of the template's functions" in str(e.value)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_kwarg_the_template_cannot_use_is_a_clear_error(think_bundle):
    from edge.bundle import Bundle, TokenizerSpec
    from edge.decode.tokenizer import ChatTokenizer
    from edge.errors import EdgeChatError

    spec = Bundle.open(think_bundle.root).manifest.tokenizer
    template = spec.chat_template + "{% if enable_thinking + 1 %}{% endif %}"  # a template doing arithmetic on it
    tok = ChatTokenizer(think_bundle.root / spec.file, TokenizerSpec(**{**spec.__dict__, "chat_template": template}))
    with pytest.raises(EdgeChatError, match=r"failed with these chat_template_kwargs \(enable_thinking\): TypeError"):
        tok.render(HELLO, template_kwargs={"enable_thinking": [1]})


def test_json_and_tool_calls_apply_to_the_content_after_the_think_block(server):
    c = _client(server)
    schema = ADD[0]["function"]["parameters"]
    r = c.chat.completions.create(model="x", messages=HELLO, max_tokens=40, logprobs=True,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "a", "schema": schema}},
                                  extra_body={"reasoning_budget": 3}, **SAMPLED)
    m = r.choices[0].message
    assert _raw(r.choices[0]).index("</think>") == 3 and m.reasoning_content
    assert set(json.loads(m.content)) == {"a"}
    ask = dict(model="x", messages=HELLO, max_tokens=100, tools=ADD, tool_choice="required",
               extra_body={"reasoning_budget": 3}, **SAMPLED)
    r = c.chat.completions.create(**ask)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.reasoning_content, r
    assert m.tool_calls[0].function.name == "add" and set(json.loads(m.tool_calls[0].function.arguments)) == {"a"}
    reasoning, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **ask):  # streamed: the same thinking, the same call
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        for k in d.tool_calls or []:  # a call's name, then its arguments in pieces, by index (as OpenAI streams)
            name, args = calls.get(k.index, ("", ""))
            calls[k.index] = (name + (k.function.name or ""), args + (k.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == m.reasoning_content and finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [(k.function.name, k.function.arguments) for k in m.tool_calls]


# -- the CLI and the page -----------------------------------------------------------------------------------

def test_cli_hides_the_thinking_when_piped_and_shows_it_when_asked(think_bundle):
    args = ("edge.cli", "run", str(think_bundle.root), "Hello", "--reasoning-budget", "3", "--temperature", "1",
            "--seed", "3", "--max-new-tokens", "12", "--threads", "1")
    shown = run_cli(*args, "--show-thinking")
    hidden = run_cli(*args)
    assert shown.returncode == hidden.returncode == 0, shown.stderr + hidden.stderr
    assert shown.stdout.startswith("<think>\n") and "\n</think>\n\n" in shown.stdout
    assert "think>" not in hidden.stdout and hidden.stdout.strip()
    assert shown.stdout.split("\n</think>\n\n")[1] == hidden.stdout  # the same answer after the block
    both = run_cli(*args, "--show-thinking", "--hide-thinking")
    assert both.returncode == 2 and "contradict" in both.stderr
    assert "thinking model (<think> ... </think>" in run_cli("edge.cli", "info", str(think_bundle.root)).stdout


def test_page_shows_the_thinking_as_a_titled_message_above_the_answer():
    from edge.serve.webui import THINKING_TITLE, show_messages

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "thinking": "They greet me."}]
    shown = show_messages(msgs)
    assert shown == [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "They greet me.",
                      "metadata": {"title": THINKING_TITLE, "status": "done"}},
                     {"role": "assistant", "content": "Hello."}]
    pending = show_messages(msgs[:2] + [{"role": "assistant", "content": "", "thinking": "So far"}], thinking_now=True)
    assert pending[-1]["metadata"]["status"] == "pending" and len(pending) == 2  # no empty answer bubble yet


# -- a base model: no chat template ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_bundle(think_bundle, tmp_path_factory):
    """The bundle with its chat template taken out of the manifest (the manifest is not among the hashed files)."""
    dst = tmp_path_factory.mktemp("base") / "base.bundle"
    shutil.copytree(think_bundle.root, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["tokenizer"]["chat_template"] = ""
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_a_bundle_without_a_template_continues_text_and_refuses_chat_clearly(base_bundle):
    s = ServerProcess(base_bundle)
    try:
        import httpx

        assert "This bundle has no chat template" in httpx.get(s.url + "/config").text  # the page says so
        c = _client(s)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="x", messages=HELLO, max_tokens=4)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
        assert e.value.body["param"] == "messages"
        assert "no chat template" in e.value.body["message"] and "--chat-template FILE" in e.value.body["message"]
        r = c.completions.create(model="x", prompt="The capital of Japan is", max_tokens=4, **SAMPLED)
        assert r.choices[0].text and r.usage.completion_tokens == 4
    finally:
        code, out = s.stop()
    assert code == 0 and "Traceback" not in out, out
    raw = run_cli("edge.cli", "run", str(base_bundle), "The capital of Japan is", "--raw", "--max-new-tokens", "4",
                  "--threads", "1")
    assert raw.returncode == 0 and raw.stdout.strip(), raw.stderr
    chat = run_cli("edge.cli", "run", str(base_bundle), "Hello", "--threads", "1")
    assert chat.returncode == 2 and "no chat template" in chat.stderr and "--raw" in chat.stderr
    assert "no chat template (a base model)" in run_cli("edge.cli", "info", str(base_bundle)).stdout


def test_export_takes_a_chat_template_for_a_model_without_one(tmp_path):
    from edge.errors import ModelSourceError
    from export import load
    from export.model_source import resolve

    src = make_tiny_model(tmp_path / "base-model", chat_template=None)
    ref = resolve(str(src))
    with pytest.raises(ModelSourceError, match="--chat-template FILE"):
        load.run(ref, tmp_path / "refused")
    f = tmp_path / "chatml.jinja"
    f.write_text(OPENS)
    load.run(ref, tmp_path / "loaded", chat_template=load.read_chat_template(f))
    spec = load.tokenizer_spec(tmp_path / "loaded")
    assert spec.chat_template == OPENS
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(ModelSourceError, match="does not parse"):
        load.read_chat_template(tmp_path / "bad.jinja")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (apt-get install chromium)")
def test_the_page_draws_the_thinking_collapsed_above_the_answer(think_bundle):
    """In a real headless Chromium: the think block is a "Thinking" accordion above the answer, closed once the
    answer is there (its text hidden until the title is clicked)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    s = ServerProcess(think_bundle.root, "--reasoning-budget", "5")
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page()
            page.goto(s.url + "/", wait_until="load")
            page.wait_for_selector("#message textarea", timeout=30_000)
            page.get_by_text("Settings").click()
            page.get_by_label("number input for Max new tokens").fill("16")
            temperature = page.get_by_label("number input for Temperature (0 = greedy)")
            temperature.fill("1")  # greedy, the random model thinks in newlines only: nothing to show
            temperature.press("Enter")
            page.locator("#message textarea").fill("Hello")
            page.locator("#message textarea").press("Enter")
            page.wait_for_function("document.querySelector('#stats').innerText.includes('tok/s')", timeout=60_000)
            group = page.locator("#chatbot .thought-group")
            group.wait_for(timeout=10_000)
            assert group.locator(".title").inner_text().strip() == "Thinking"
            thought = page.locator("#chatbot [data-testid='bot']").first.get_attribute("aria-label")
            assert thought.removeprefix("bot's message: ").strip()  # the reasoning is there, in the accordion
            assert "think>" not in thought  # the tags that framed it are not drawn
            assert group.inner_text().strip() == "Thinking"  # closed: its text is not drawn
            answer = page.locator("#chatbot [data-testid='bot']").last.inner_text().strip()
            # the closing tag is not drawn before the answer (a sampled answer may write the tag's token again later:
            # that is the model's text, shown as written, as llama.cpp's server does)
            assert answer and not answer.startswith(("<think>", "</think>"))
            group.locator(".title").click()
            page.wait_for_function("document.querySelector('#chatbot .thought-group').innerText.trim() != 'Thinking'",
                                   timeout=5_000)  # open: the reasoning drawn under its title
            browser.close()
    finally:
        code, out = s.stop()
    assert code == 0 and "Traceback" not in out, out
