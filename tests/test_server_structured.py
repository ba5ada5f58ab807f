"""Issue 26 through a real server and the official openai client: structured output, logprobs, n, penalties,
/v1/completions, tool calls. Reference numbers come from the same engine's logits, in process."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from conftest import ServerProcess, served

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# bounded everywhere, so even the tests' random-init model must finish it within max_tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Tokyo", "Kyoto", "Paris"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "member"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tokyo", "Paris", "Lima"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two small numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Tell me about a person, as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_bundle):
    yield from served(tiny_bundle.root, "--engine", "fp32", "--max-users", "8", "--no-ui")


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_for_20_seeded_sampled_requests_batched_with_other_users(server):
    client = _client(server)
    stop = threading.Event()
    others = []

    def other_user(i: int) -> None:  # plain streamed chats, sampled, all the while
        while not stop.is_set():
            chunks = client.chat.completions.create(model="x", messages=[{"role": "user", "content": f"Hi {i}"}],
                                                    max_tokens=40, temperature=1.0, seed=i, stream=True)
            others.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    steps0 = _metric(server, "edgechat_decode_steps_total")
    tokens0 = _metric(server, "edgechat_completion_tokens_total")
    with ThreadPoolExecutor(3) as pool:
        busy = [pool.submit(other_user, i) for i in range(3)]
        try:
            answers = []
            for seed in range(20):
                r = client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=seed,
                                                   max_tokens=200, response_format=_schema_format(PERSON))
                answers.append(r.choices[0])
        finally:
            stop.set()
            for f in busy:
                f.result()
    for c in answers:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in answers}) > 10  # sampled, seeded: different answers
    assert others and all(isinstance(t, str) for t in others)
    steps = _metric(server, "edgechat_decode_steps_total") - steps0
    tokens = _metric(server, "edgechat_completion_tokens_total") - tokens0
    assert tokens / steps > 1.5, f"{tokens} tokens in {steps} steps: the constrained answers were not batched"
    # the same seed gives the same constrained answer
    again = client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=3, max_tokens=200,
                                           response_format=_schema_format(PERSON))
    assert again.choices[0].message.content == answers[3].message.content


def test_json_object_and_greedy_json_schema(server, tiny_bundle):
    client = _client(server)
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=200,
                                       response_format=_schema_format(PERSON))
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # json_object: any JSON object. A random model writes long keys, so lean it towards closing them.
    tok = _tokenizer(tiny_bundle)
    close = {str(t): 8 for t in (tok.token_to_id('"'), tok.token_to_id("}")) if t is not None}
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=200,
                                       response_format={"type": "json_object"}, logit_bias=close)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_why(server):
    url = server.url + "/v1/chat/completions"
    cases = {
        "bad regex": ({"type": "string", "pattern": "(unclosed"}, "unclosed"),
        "unknown type": ({"type": "strnig"}, "strnig"),
        "bad $ref": ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
        "too large": ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                         for i in range(1000)}}, "limit"),
        "deep": (_deep(60), ""),
    }
    for what, (schema, words) in cases.items():
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 5,
                                  "response_format": _schema_format(schema)}, timeout=60)
        if what == "deep" and r.status_code == 200:  # the engine may accept deep nesting: then it must answer
            continue
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["param"] == "response_format" and words in err["message"], (what, err)
    r = httpx.post(url, json={"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "[z-a]"}}}}}],
        "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and "tool 'f'" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert _metric(server, "edgechat_active_requests") == 0


def _deep(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def test_logprobs_equal_the_engines_own_logits(server, tiny_generator):
    client = _client(server)
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=12, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    gen = tiny_generator
    prompt = gen.tokenizer.encode_chat(ASK)
    ids = _ids_from_bytes(gen, content)
    dec = gen.decoder
    cache = dec.new_cache(capacity=len(prompt) + 16)
    logits = dec.prefill(prompt, cache)[0]
    for k, (e, tok) in enumerate(zip(content, ids)):
        lp = _log_softmax(logits)
        assert tok == int(np.argmax(lp)), f"token {k}: the server's greedy token is not the engine's"
        assert abs(e.logprob - lp[tok]) < 2e-4, (k, e.logprob, lp[tok])
        best = np.argsort(-lp, kind="stable")[:3]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([lp[b] for b in best], abs=2e-4)
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)
        logits = dec.forward(np.array([[tok]]), cache)[0]
    # streamed: the same numbers, token by token
    chunks = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=12, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def _ids_from_bytes(gen, content) -> list[int]:
    """Token ids from logprobs entries' bytes (unique in the tests' byte-level vocabulary)."""
    from edge.serve.openai_answers import token_table

    table = token_table(gen.tokenizer, gen.decoder.dims.vocab_size)
    index = {b: i for i, b in reversed(list(enumerate(table))) if b}
    return [index[bytes(e.bytes)] for e in content]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_completions_echo_and_logprobs_match_the_chat_path_on_the_same_tokens(server, tiny_generator):
    client = _client(server)
    chat = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=10, logprobs=True)
    gen = tiny_generator
    prompt = gen.tokenizer.encode_chat(ASK)
    answer = _ids_from_bytes(gen, chat.choices[0].logprobs.content)
    # the same prompt tokens through /v1/completions: the same continuation and the same numbers
    c = client.completions.create(model="x", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    assert c.choices[0].text == chat.choices[0].message.content
    assert c.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in chat.choices[0].logprobs.content],
                                                                  abs=1e-5)
    # echo: prompt + answer scored in one pass (prefill numbers, not decode steps': equal within fp32 error)
    e = client.completions.create(model="x", prompt=prompt + answer, max_tokens=0, echo=True, logprobs=1)
    lp = e.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + len(answer) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[len(prompt):] == pytest.approx([x.logprob for x in chat.choices[0].logprobs.content],
                                                            abs=2e-4)
    assert e.choices[0].text == gen.tokenizer.decode(prompt + answer, skip_special_tokens=False)
    # a text prompt, streamed, with stop
    text = "The capital of Japan is"
    full = client.completions.create(model="x", prompt=text, max_tokens=12, temperature=0, echo=True)
    assert full.choices[0].text.startswith(text) and full.usage.completion_tokens == 12
    parts = [ch.choices[0].text for ch in client.completions.create(model="x", prompt=text, max_tokens=12,
                                                                    temperature=0, stream=True) if ch.choices]
    assert text + "".join(parts) == full.choices[0].text
    cont = full.choices[0].text[len(text):]
    stop = cont[len(cont) // 2:len(cont) // 2 + 2]
    cut = client.completions.create(model="x", prompt=text, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == cont[:cont.find(stop)]


def test_n3_gives_three_answers_each_equal_to_the_single_answer_with_its_seed(server):
    client = _client(server)
    many = client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=40, n=3, max_tokens=20)
    assert [c.index for c in many.choices] == [0, 1, 2]
    single = [client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=40 + i, max_tokens=20)
              .choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == single
    assert len(set(single)) == 3
    assert many.usage.completion_tokens == 60
    # streamed: three interleaved choices, the same texts
    texts = ["", "", ""]
    for ch in client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=40, n=3, max_tokens=20,
                                             stream=True):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == single


def test_penalties_and_logit_bias_equal_a_reference_on_the_engines_logits(server, tiny_generator):
    client = _client(server)
    r = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=16, frequency_penalty=1.5,
                                       presence_penalty=0.5, logprobs=True)
    got = _ids_from_bytes(tiny_generator, r.choices[0].logprobs.content)
    gen = tiny_generator
    prompt = gen.tokenizer.encode_chat(ASK)
    cache = gen.decoder.new_cache(capacity=len(prompt) + 20)
    logits = gen.decoder.prefill(prompt, cache)[0]
    counts: dict[int, int] = {}
    want = []
    for _ in range(16):
        x = np.array(logits, dtype=np.float64)
        for t, n in counts.items():
            x[t] -= 1.5 * n + 0.5
        tok = int(np.argmax(x))
        want.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        logits = gen.decoder.forward(np.array([[tok]]), cache)[0]
    assert got == want
    plain = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=16)
    assert plain.choices[0].message.content != r.choices[0].message.content  # the penalties did something here
    # logit_bias -100 bans a token: the greedy answer's first token never appears
    first = want[0]
    banned = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=16, logprobs=True,
                                            frequency_penalty=1.5, presence_penalty=0.5,
                                            logit_bias={str(first): -100})
    assert first not in _ids_from_bytes(gen, banned.choices[0].logprobs.content)


@pytest.fixture(scope="module")
def long_server(long_bundle):
    """The 4k-context model: the fallback tool prompt alone is ~800 of the small tokenizer's tokens."""
    s = ServerProcess(long_bundle.root, "--max-users", "4", "--no-ui")
    yield s
    code, out = s.stop()
    assert code == 0 and "Traceback" not in out, out


def test_a_tool_call_round_trip(long_server):
    client = _client(long_server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER, ADD], tool_choice="required",
                                       temperature=0, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    params = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    # the tool's result goes back; the model answers in text
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    final = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER, ADD], tool_choice="none",
                                           temperature=0, max_tokens=20)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    # a named function, streamed: the call's id and name arrive once its name is written, then its arguments in
    # pieces as they are written (as OpenAI streams a call), and the answer finishes with "tool_calls"
    calls, finish, pieces, ids = {}, None, [], []
    forced = {"type": "function", "function": {"name": "add"}}
    for ch in client.chat.completions.create(model="x", messages=messages[:1], tools=[WEATHER, ADD], temperature=0,
                                             tool_choice=forced, max_tokens=100, stream=True):
        for d in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
            pieces += [d.function.arguments] if d.function.arguments else []
            ids += [d.id] if d.id else []
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "add" and len(ids) == 1 and ids[0].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["function"]["parameters"])
    assert len(pieces) > 2, pieces  # streamed as written, not one piece at the end
    whole = client.chat.completions.create(model="x", messages=messages[:1], tools=[WEATHER, ADD], temperature=0,
                                           tool_choice=forced, max_tokens=100).choices[0].message.tool_calls[0]
    assert json.loads(whole.function.arguments) == json.loads(calls[0]["arguments"])


def test_unsupported_fields_are_a_400_saying_so(server):
    url = server.url + "/v1/chat/completions"
    for field, value, words in [("metadata", {"a": "b"}, "'metadata' is not supported"),
                                ("functions", [], "use 'tools' instead"),
                                ("audio", {"voice": "x"}, "--lenient")]:
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 3, field: value}, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (field, r.text)
        assert r.json()["error"]["param"] == field
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "suffix": "x"}, timeout=30)
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]
    # what OpenAI clients commonly send and this server does take
    r = httpx.post(url, json={"messages": ASK, "max_completion_tokens": 3, "user": "me", "frequency_penalty": 0,
                              "presence_penalty": 0, "logit_bias": {}, "n": 1, "parallel_tool_calls": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _metric(server, name: str) -> float:
    import re

    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _tokenizer(bundle):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundle.root / bundle.manifest.tokenizer.file))


def test_stop_token_ids_end_the_answer_before_that_token(server, tiny_generator):
    client = _client(server)
    full = client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=3, max_tokens=20,
                                          logprobs=True)
    ids = _ids_from_bytes(tiny_generator, full.choices[0].logprobs.content)
    k = next(i for i in range(2, 20) if ids[i] not in ids[:i])  # a token's first appearance
    cut = client.chat.completions.create(model="x", messages=ASK, temperature=1.0, seed=3, max_tokens=20,
                                         extra_body={"stop_token_ids": [ids[k]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == k
    assert cut.choices[0].message.content == tiny_generator.tokenizer.decode(ids[:k])


def test_lenient_ignores_fields_the_server_does_not_support(tiny_bundle):
    s = ServerProcess(tiny_bundle.root, "--engine", "fp32", "--no-ui", "--lenient")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, "metadata": {"a": 1},
                                                             "store": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, "n": "two"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # a known field is still validated
    finally:
        code, out = s.stop()
    assert code == 0, out


def test_logprobs_on_the_fused_int8_engine_equal_its_logits_and_are_near_the_fp32_reference(
        tiny_bundle, fused_generator, tiny_generator):
    """The default kind of engine (int8-dynamic, fused graph, prefilled in fixed spans, decoded in the shared
    batch buffer): the server's logprobs equal its own logits replayed alone, and stay within the
    quantization error of the fp32 engine on the same tokens."""
    s = ServerProcess(tiny_bundle.root, "--engine", "int8-dynamic", "--max-users", "2", "--no-ui")
    try:
        r = _client(s).chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=12, logprobs=True)
    finally:
        code, out = s.stop()
    assert code == 0, out
    content = r.choices[0].logprobs.content
    ids = _ids_from_bytes(fused_generator, content)
    prompt = fused_generator.tokenizer.encode_chat(ASK)
    worst = 0.0
    replay = []
    for gen in (fused_generator, tiny_generator):
        cache = gen.decoder.new_cache(capacity=len(prompt) + 16)
        logits = gen.decoder.prefill(prompt, cache)[0]
        lps = []
        for tok in ids:
            lps.append(_log_softmax(logits)[tok])
            logits = gen.decoder.forward(np.array([[tok]]), cache)[0]
        replay.append(lps)
    assert [e.logprob for e in content] == pytest.approx(replay[0], abs=1e-3)
    worst = max(abs(e.logprob - ref) for e, ref in zip(content, replay[1]))
    assert worst < 0.05, f"int8 logprobs differ from fp32's by up to {worst:.3f} nats"
    print(f"int8-dynamic vs fp32 logprobs on the same 12 tokens: max |diff| {worst:.4f} nats")


def test_an_lm_evaluation_harness_loglikelihood_request_scores_the_continuation(server, tiny_generator):
    """The payload lm-evaluation-harness's local-completions model sends for loglikelihood (token-id prompts in a
    batch, max_tokens 1, echo, logprobs 1, temperature 0, a seed), read the way it reads it: token_logprobs
    [ctxlen:-1] summed, greedy = each token is the top of its top_logprobs."""
    gen = tiny_generator
    ctx = gen.tokenizer.encode("The capital of Japan is")
    cache = gen.decoder.new_cache(capacity=len(ctx) + 4)
    first = int(np.argmax(gen.decoder.prefill(ctx, cache)[0]))
    second = int(np.argmax(gen.decoder.forward(np.array([[first]]), cache)[0]))
    conts = [gen.tokenizer.encode(" Tokyo."), gen.tokenizer.encode(" a fish."), [first, second]]  # the last: greedy
    body = {"model": "x", "prompt": [ctx + c for c in conts], "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    greedy_seen = []
    for cont, choice in zip(conts, choices):
        lp = choice["logprobs"]
        ids = ctx + cont
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
        cache = gen.decoder.new_cache(capacity=len(ids) + 1)
        logits = gen.decoder.forward(np.asarray(ids, dtype=np.int64)[None], cache, last_only=False)[0]
        want = [_log_softmax(logits[j - 1])[ids[j]] for j in range(len(ctx), len(ids))]
        got = lp["token_logprobs"][len(ctx):-1]
        assert got == pytest.approx(want, abs=1e-4)
        greedy_ref = all(int(np.argmax(logits[j - 1])) == ids[j] for j in range(len(ctx), len(ids)))
        greedy = all(t == max(top, key=top.get) for t, top in zip(lp["tokens"][len(ctx):-1],
                                                                  lp["top_logprobs"][len(ctx):-1]))
        assert greedy == greedy_ref
        greedy_seen.append(greedy)
    assert greedy_seen[2] is True  # the model's own greedy continuation reads as greedy
