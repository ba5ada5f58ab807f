"""The OpenAI chat-completions request, validated in one place before anything reaches the scheduler.

`parse_chat_request(raw bytes)` parses and validates the body against pydantic models (strict types: a
string is not a number, true is not 1; finite numbers only; integers in range) and raises `BadRequest`
with a message that names the field and what it takes. The same models are the request schema in
the app's OpenAPI document (/openapi.json), which the tests fuzz with schemathesis.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from edge.sampling import MAX_SEED

MAX_TOKENS_LIMIT = 2**31 - 1  # what the schema admits; the model's context is checked after tokenizing
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


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ChatCompletionRequest(_Strict):
    """The fields EdgeChat reads; other OpenAI fields (user, logit_bias, ...) are accepted and ignored."""

    model: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS_LIMIT)] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS_LIMIT)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2, allow_inf_nan=False)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1, allow_inf_nan=False)] = None
    seed: Annotated[int | None, Field(ge=0, le=MAX_SEED)] = None
    n: Annotated[int | None, Field(ge=1, le=1)] = None
    stop: StopText | Annotated[list[StopText], Field(min_length=1, max_length=4)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None

    def conversation(self) -> list[dict]:
        """{role, content} dicts for the chat template ('developer' is OpenAI's new name for 'system')."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def sampling(self) -> dict:
        """Options for Service.sampling: max_tokens and the SamplingConfig fields the request sets."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {"max_tokens": self.max_completion_tokens or self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "stop": tuple(stop) if stop else None,
                "ignore_eos": self.ignore_eos or None}


RULES = {  # what each field takes, in words, for the error message
    "model": "a string (any name: one model per server)",
    "messages": "a non-empty list of {role, content} objects: role one of system, developer, user, assistant; "
                "content a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "max_tokens": f"an integer from 1 to {MAX_TOKENS_LIMIT} (and within the model's context)",
    "max_completion_tokens": f"an integer from 1 to {MAX_TOKENS_LIMIT} (and within the model's context)",
    "temperature": "a finite number from 0 to 2",
    "top_p": "a finite number greater than 0 and at most 1",
    "seed": f"an integer from 0 to {MAX_SEED}",
    "n": "1 (one answer per request)",
    "stop": "a non-empty string or a list of 1 to 4 non-empty strings",
    "stream": "true or false",
    "messages.role": "one of system, developer, user, assistant",
    "messages.content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts (text only)",
    "messages.content.type": "\"text\" (only text content is supported)",
    "messages.content.text": "a string",
    "stream_options": "an object such as {\"include_usage\": true}",
    "stream_options.include_usage": "true or false",
    "ignore_eos": "true or false",
}


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "TextPart", "list[constrained-str]", "constrained-str", "int", "float",
                      "bool", "StreamOptions", "function-after[_unicode(), str]",
                      "function-after[_unicode(), constrained-str]") or "[" in str(part):
            continue  # pydantic's names of union members
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def parse_chat_request(raw: bytes) -> ChatCompletionRequest:
    """Validate a chat-completions body; raises BadRequest naming the field and what it takes."""
    try:
        return ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            why = str(err.get("ctx", {}).get("error", err["msg"]))
            if "recursion limit" in why:
                raise BadRequest(f"the body's JSON is nested more than {JSON_DEPTH_LIMIT} levels deep") from None
            if "escape" in why or "surrogate" in why:
                raise BadRequest(f"the body is not valid JSON ({why}): a \\uD800-\\uDFFF escape must be half of a "
                                 "surrogate pair; send valid Unicode") from None
            raise BadRequest(f"the body is not valid JSON ({why})") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise BadRequest("the body must be a JSON object") from None
        where = _where(err["loc"])
        field = where.split(".")[0].split("[")[0]
        rule = RULES.get(re.sub(r"\[\d+\]", "", where), RULES.get(field))
        if err["type"] == "missing":
            raise BadRequest(f"'{where}' is required: {rule or 'see the API reference'}", param=field) from None
        detail = err["msg"].removeprefix("Value error, ")
        got = f", got {_short(err['input'])}" if "input" in err else ""
        msg = f"'{where}' must be {rule}{got} ({detail})" if rule else f"'{where}': {detail}{got}"
        raise BadRequest(msg, param=field) from None


def openapi_schemas() -> tuple[dict, dict]:
    """(request body schema, component schemas) for the OpenAPI document."""
    schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    defs["ChatCompletionRequest"] = schema
    defs["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    return {"$ref": "#/components/schemas/ChatCompletionRequest"}, defs
