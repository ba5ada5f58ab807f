"""edge.decode.tools without a server: which templates render tools themselves, the fallback prompt, call parsing."""

from __future__ import annotations

import json

from edge.bundle import TokenizerSpec
from edge.decode.tools import FALLBACK_PROMPT, calls_so_far, parse_calls, prompt_messages, template_takes_tools

# the shape of Qwen2.5's template: it reads `tools` and writes calls as <tool_call> blocks with tojson arguments
NATIVE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
HISTORY = [{"role": "user", "content": "1 plus 2?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
           {"role": "tool", "content": "3", "tool_call_id": "call_1"}]


def _tokenizer(tmp_path, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from edge.decode.tokenizer import ChatTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return ChatTokenizer(path, TokenizerSpec(file="tokenizer.json", chat_template=template, eos_token_ids=[1]))


def test_a_template_that_reads_tools_renders_them_and_the_calls_itself(tmp_path):
    assert template_takes_tools(NATIVE) and not template_takes_tools(PLAIN)
    assert not template_takes_tools("{% for %}")  # a template that does not parse is not asked
    assert template_takes_tools("{% for t in tools %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}")
    tok = _tokenizer(tmp_path, NATIVE)
    text = tok.render(prompt_messages(HISTORY, [ADD], native=True), tools=[ADD])
    assert '"name": "add", "description": "Add two integers."' in text  # the template's own tool listing
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text  # arguments as an object
    assert "<|im_start|>tool\n3<|im_end|>" in text
    assert "You can call these functions" not in text  # no fallback prompt


def test_the_fallback_writes_tools_calls_and_results_as_text_any_template_renders(tmp_path):
    msgs = prompt_messages([{"role": "system", "content": "Be brief."}] + HISTORY, [ADD], native=False)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert json.dumps({"name": "add", "description": "Add two integers.",
                       "parameters": ADD["function"]["parameters"]}) in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant",
                       "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert all(set(m) == {"role", "content"} for m in msgs)
    text = _tokenizer(tmp_path, PLAIN).render(msgs)
    assert "<|im_start|>tool" not in text and FALLBACK_PROMPT.splitlines()[0] in text


def test_calls_are_parsed_into_openai_tool_calls():
    p = parse_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "sub", "arguments": {"a": 2}}\n</tool_call>')
    assert [c["function"]["name"] for c in p.tool_calls] == ["add", "sub"] and p.content is None
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    assert len({c["id"] for c in p.tool_calls}) == 2
    broken = parse_calls("<tool_call>\n{not json}\n</tool_call>")
    assert broken.tool_calls == [] and broken.content == "<tool_call>\n{not json}\n</tool_call>"
    assert parse_calls("just text").content == "just text"


def test_calls_so_far_gives_each_calls_arguments_as_they_are_written():
    """Every prefix of two parallel calls in the grammar's shape: the calls begun so far, names whole, arguments
    a prefix of the final arguments (a brace or quote inside a string does not end them), whole once closed; the
    final text gives what parse_calls gives. Text in another shape gives no calls (it is parsed at the end)."""
    a, b = {"a": 1, "s": 'x}"y{['}, {"c": [1, {"d": 2}]}
    text = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(v)}}}\n</tool_call>' + sep
                   for n, v, sep in (("add", a, "\n"), ("w", b, "")))
    final = calls_so_far(text)
    assert [(c.name, json.loads(c.arguments), c.whole) for c in final] == [("add", a, True), ("w", b, True)]
    assert [(c.name, c.arguments) for c in final] == [(k["function"]["name"], k["function"]["arguments"])
                                                     for k in parse_calls(text).tool_calls]
    seen = 0
    for k in range(len(text) + 1):
        got = calls_so_far(text[:k])
        assert len(got) >= seen  # a call, once begun, stays
        seen = len(got)
        for c, f in zip(got, final):
            assert c.name == f.name and f.arguments.startswith(c.arguments)
            assert c.whole == (c.arguments == f.arguments)
    assert calls_so_far('<tool_call>\n{"arguments": {}, "name": "add"}\n</tool_call>') == []
    assert calls_so_far("Plain text") == []
