"""The OpenAI chat-completions request, validated in one place before anything reaches the scheduler.

`parse_chat_request(raw bytes)` parses and validates the body against pydantic models (strict types: a
string is not a number, true is not 1; finite numbers only; integers in range) and raises `BadRequest`
with a message that names the field and what it takes. The same models are the request schema in
the app's OpenAPI document (/openapi.json), which the tests fuzz with schemathesis.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from edge.decode.sampling import MAX_SEED, MIN_REPETITION_PENALTY, MIN_TEMPERATURE

MAX_TOKENS_LIMIT = 2**31 - 1  # what the schema admits; the model's context is checked after tokenizing
MAX_N = 16  # answers per request (each is a row of the batch)
MAX_PROMPTS = 16  # prompts per /v1/completions request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
JSON_DEPTH_LIMIT = 200  # pydantic's JSON parser refuses deeper nesting (a 100k-deep body would exhaust the stack)


class BadRequest(ValueError):
    """A request body that does not follow the schema: `param` names the field, the message what it takes."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone UTF-16 surrogate: send valid Unicode") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]
StopText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
TEMPLATE_VAR = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # a Jinja variable name


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Annotated[str, Field(pattern=NAME)]
    arguments: Text  # JSON text, as OpenAI sends it back


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=64)] | None = None  # assistant: the calls it made
    tool_call_id: Text | None = None  # tool: which call this is the result of
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool | None = None


class JSONSchemaFormat(_Strict):
    name: Annotated[str, Field(pattern=NAME)] = "answer"
    description: Text | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=NAME)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolName(_Strict):
    name: Annotated[str, Field(pattern=NAME)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolName


_S = TypeVar("_S", bound="_Sampling")

# Fields of OpenAI's requests this server does not implement: a 400 saying so (unless --lenient).
UNSUPPORTED_HINTS = {
    "functions": "use 'tools' instead (the deprecated 'functions' is not supported)",
    "function_call": "use 'tool_choice' instead (the deprecated 'function_call' is not supported)",
    "best_of": "ask for 'n' answers instead",
    "suffix": "this server does not fill in the middle",
}
Penalty = Annotated[float | None, Field(ge=-2, le=2, allow_inf_nan=False)]
Bias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100,
                 allow_inf_nan=False)]] | None, Field(max_length=1024)]


class _Sampling(_Strict):
    """The sampling fields chat and text completions share. Fields not declared here are a 400 naming them
    (`extra_fields`), unless the server runs with --lenient."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Text | None = None
    max_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS_LIMIT)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2, allow_inf_nan=False)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1, allow_inf_nan=False)] = None
    top_k: Annotated[int | None, Field(ge=0, le=MAX_TOKENS_LIMIT)] = None
    seed: Annotated[int | None, Field(ge=0, le=MAX_SEED)] = None
    n: Annotated[int | None, Field(ge=1, le=MAX_N)] = None
    stop: StopText | Annotated[list[StopText], Field(min_length=1, max_length=4)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    repetition_penalty: Annotated[float | None, Field(ge=MIN_REPETITION_PENALTY, le=10, allow_inf_nan=False)] = None
    logit_bias: Bias = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]] | None, Field(max_length=16)] = None  # as vLLM
    user: Annotated[str | None, Field(max_length=256)] = None

    def extra_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def sampling(self) -> dict:
        """Options for Service.sampling: max_tokens and the SamplingConfig fields the request sets."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": tuple(stop) if stop else None,
                "ignore_eos": self.ignore_eos or None, "repetition_penalty": self.repetition_penalty}

    def bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS_LIMIT)] = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=64)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # variables for the chat template (vLLM's and llama.cpp's field), e.g. {"enable_thinking": false}
    chat_template_kwargs: Annotated[dict[Annotated[str, Field(pattern=TEMPLATE_VAR)], Any] | None,
                                    Field(max_length=32)] = None
    # a thinking model's think block closes after this many tokens (edge.decode.thinking); -1: no limit (as
    # llama.cpp's --reasoning-budget); absent: the server's --reasoning-budget
    reasoning_budget: Annotated[int | None, Field(ge=-1, le=MAX_TOKENS_LIMIT)] = None

    def sampling(self) -> dict:
        out = super().sampling()
        out["max_tokens"] = self.max_completion_tokens or self.max_tokens
        return out

    def conversation(self) -> list[dict]:
        """{role, content} dicts for the chat template ('developer' is OpenAI's new name for 'system');
        tool calls and tool results keep their fields (edge.decode.tools renders them)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                d["name"] = m.name
            out.append(d)
        return out


class CompletionRequest(_Sampling):
    """POST /v1/completions: a prompt (text or token ids, or a list of them) continued as is, no template."""

    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] \
        | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                    Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: Annotated[int | None, Field(ge=0, le=MAX_TOKENS_LIMIT)] = None  # 0: score the prompt only (echo)
    echo: bool | None = None
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


RULES = {  # what each field takes, in words, for the error message
    "model": "a string (any name: one model per server)",
    "messages": "a non-empty list of {role, content} objects: role one of system, developer, user, assistant, "
                "tool; content a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "max_tokens": f"an integer from 1 to {MAX_TOKENS_LIMIT} (and within the model's context)",
    "max_completion_tokens": f"an integer from 1 to {MAX_TOKENS_LIMIT} (and within the model's context)",
    "temperature": f"a finite number from 0 to 2 (below {MIN_TEMPERATURE}: greedy, as 0)",
    "top_p": "a finite number greater than 0 and at most 1",
    "top_k": "an integer >= 0 (0: off)",
    "seed": f"an integer from 0 to {MAX_SEED}",
    "n": f"an integer from 1 to {MAX_N} (answers, each a row of the batch)",
    "stop": "a non-empty string or a list of 1 to 4 non-empty strings",
    "stream": "true or false",
    "messages.role": "one of system, developer, user, assistant, tool",
    "messages.content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts (text only)",
    "messages.content.type": "\"text\" (only text content is supported)",
    "messages.content.text": "a string",
    "messages.tool_calls": "a list of {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}} "
                           "(arguments a JSON string)",
    "messages.tool_call_id": "a string (the id of the call this message answers)",
    "stream_options": "an object such as {\"include_usage\": true}",
    "stream_options.include_usage": "true or false",
    "ignore_eos": "true or false",
    "frequency_penalty": "a finite number from -2 to 2",
    "presence_penalty": "a finite number from -2 to 2",
    "repetition_penalty": f"a finite number from {MIN_REPETITION_PENALTY} to 10 (1: off)",
    "logit_bias": "an object of up to 1024 token ids (as strings) to biases from -100 to 100",
    "user": "a string of at most 256 characters",
    "stop_token_ids": "a list of up to 16 token ids that end the answer (not shown in it)",
    "response_format": "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "tools": "a list of up to 64 {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}} "
             "(name: letters, digits, _ and -, at most 64)",
    "tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "parallel_tool_calls": "true or false",
    "logprobs": "true or false (chat), an integer from 0 to 20 (completions)",
    "top_logprobs": "an integer from 0 to 20 (with logprobs: true)",
    "chat_template_kwargs": "an object of up to 32 chat template variables (names: letters, digits and _), e.g. "
                            "{\"enable_thinking\": false}",
    "reasoning_budget": "an integer >= 0: tokens a thinking model may think before its think block is closed "
                        "(-1: no limit)",
    "prompt": f"a string, a list of up to {MAX_PROMPTS} strings, a list of token ids or a list of such lists",
    "echo": "true or false",
}


def _where(loc: tuple, members: frozenset[str] = frozenset()) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in members or part in ("str", "list[TextPart]", "TextPart", "list[constrained-str]", "constrained-str", "int", "float",
                      "bool", "StreamOptions", "function-after[_unicode(), str]", "NamedToolChoice", "ResponseFormat",
                      "function-after[_unicode(), constrained-str]") or "[" in str(part) or "'" in str(part):
            continue  # pydantic's names of union members
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_common(body: "_Sampling") -> None:
    """Rules of fields that chat and text completions share."""
    if body.stream_options is not None and not body.stream:
        raise BadRequest("'stream_options' is only for streamed answers: send it with 'stream': true, or leave it "
                         "out", param="stream_options")


def parse_chat_request(raw: bytes, lenient: bool = False) -> ChatCompletionRequest:
    """Validate a chat-completions body; raises BadRequest naming the field and what it takes."""
    body = parse_body(ChatCompletionRequest, raw, lenient)
    _check_common(body)
    if body.tools:
        names = [t.function.name for t in body.tools]
        twice = sorted({x for x in names if names.count(x) > 1})
        if twice:
            raise BadRequest(f"'tools' names the function '{twice[0]}' more than once: each tool needs its own name "
                             "(a call names the function it calls)", param="tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    rf = body.response_format
    if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
        raise BadRequest("response_format json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}",
                         param="response_format")
    if body.tool_choice is not None and body.tool_choice != "none" and not body.tools:
        raise BadRequest("'tool_choice' needs 'tools': send the functions the model may call", param="tool_choice")
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        if name not in {t.function.name for t in body.tools or []}:
            raise BadRequest(f"'tool_choice' names '{name}', which is not one of the 'tools'", param="tool_choice")
    constrained = (rf is not None and rf.type != "text") or (body.tools and body.tool_choice != "none")
    if body.stop and constrained:
        raise BadRequest("'stop' cannot be used with 'response_format' json or 'tools': a stop string would cut the "
                         "JSON or the call short (a stopped answer must parse); the grammar ends the answer when it is "
                         "complete, so send the request without 'stop' (or tool_choice \"none\")", param="stop")
    if body.tools and rf is not None and rf.type != "text" and body.tool_choice != "none":
        raise BadRequest("'response_format' and 'tools' cannot constrain the same answer: send one of them "
                         "(or tool_choice \"none\")", param="response_format")
    for i, m in enumerate(body.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise BadRequest(f"'messages[{i}].tool_call_id' is required for a tool message: the id of the call it "
                             "answers", param="messages")
        if m.tool_calls and m.role != "assistant":
            raise BadRequest(f"'messages[{i}].tool_calls' is only for assistant messages", param="messages")
    return body


def parse_completion_request(raw: bytes, lenient: bool = False) -> CompletionRequest:
    """Validate a text-completions body; raises BadRequest naming the field and what it takes."""
    body = parse_body(CompletionRequest, raw, lenient)
    _check_common(body)
    if body.max_tokens == 0 and not body.echo:
        raise BadRequest("'max_tokens' 0 only makes sense with 'echo': true (score the prompt)", param="max_tokens")
    return body


def parse_body(model: type[_S], raw: bytes, lenient: bool, hints: dict[str, str] | None = None, **rules: Any) -> _S:
    """The body validated (`rules`: validation_error's) and, unless `lenient`, a field this server does not
    support refused by name with its `hints` entry (both APIs' requests: edge.serve.anthropic_schema too)."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e, **rules) from None
    extra = body.extra_fields()
    if extra and not lenient:
        name = extra[0]
        hint = (UNSUPPORTED_HINTS if hints is None else hints).get(name, "send the request without it")
        raise BadRequest(f"'{name}' is not supported by this server: {hint} (or start the server with --lenient "
                         "to ignore fields it does not support)", param=name)
    return body


def validation_error(e: ValidationError, rules: dict[str, str] | None = None,
                     members: frozenset[str] = frozenset(), deepest: bool = False) -> BadRequest:
    """pydantic's first complaint as a BadRequest naming the field and what it takes (`rules`: field -> what it
    takes, in words; `members`: the names pydantic gives union members, left out of the field's path;
    `deepest`: the complaint about the innermost field, e.g. a content block's missing text rather than "not a
    string"). The Anthropic schema (edge.serve.anthropic_schema) words its errors here too."""
    rules = RULES if rules is None else rules
    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: len(x["loc"])) if deepest else errors[0]
    if err["type"] == "json_invalid":
        why = str(err.get("ctx", {}).get("error", err["msg"]))
        if "recursion limit" in why:
            return BadRequest(f"the body's JSON is nested more than {JSON_DEPTH_LIMIT} levels deep")
        if "escape" in why or "surrogate" in why:
            return BadRequest(f"the body is not valid JSON ({why}): a \\uD800-\\uDFFF escape must be half of a "
                              "surrogate pair; send valid Unicode")
        return BadRequest(f"the body is not valid JSON ({why})")
    if err["type"] == "model_type" and not err["loc"]:
        return BadRequest("the body must be a JSON object")
    where = _where(err["loc"], members)
    field = where.split(".")[0].split("[")[0]
    rule = rules.get(re.sub(r"\[\d+\]", "", where), rules.get(field))
    if err["type"] == "missing":
        return BadRequest(f"'{where}' is required: {rule or 'see the API reference'}", param=field)
    detail = err["msg"].removeprefix("Value error, ")
    got = f", got {_short(err['input'])}" if "input" in err else ""
    msg = f"'{where}' must be {rule}{got} ({detail})" if rule else f"'{where}': {detail}{got}"
    return BadRequest(msg, param=field)


def openapi_schemas() -> tuple[dict, dict]:
    """(chat request body schema, component schemas) for the OpenAPI document; the completions request is
    the component CompletionRequest."""
    defs: dict = {}
    for model in (ChatCompletionRequest, CompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(schema.pop("$defs", {}))
        defs[model.__name__] = schema
    defs["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    return {"$ref": "#/components/schemas/ChatCompletionRequest"}, defs
