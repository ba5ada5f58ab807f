"""Anthropic's Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`), validated in one place and
translated into the OpenAI chat request the rest of the server already serves.

There is no second pipeline: `MessagesRequest.chat()` writes the same `ChatCompletionRequest` a client of
/v1/chat/completions could have sent (system prompt first, tool_use blocks as the assistant's `tool_calls`,
tool_result blocks as `role: "tool"` messages, tools as functions, tool_choice any -> "required"), so the
rows, the grammar, the conversation path (edge.decode.conversation) and the scheduler are the OpenAI route's.
What only Anthropic has is kept beside it: a final assistant message is the start of the answer (`prefill`),
and `max_tokens` is required. Errors are `BadRequest`s naming the field in Anthropic's terms.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError

from edge.decode.sampling import MAX_SEED
from edge.serve.openai_schema import (MAX_TOKENS_LIMIT, NAME, BadRequest, ChatCompletionRequest, StopText, Text,
                                      _Strict, parse_body, validation_error)

MAX_STOP_SEQUENCES = 16
MAX_TOOLS = 64


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text  # cache_control, citations: accepted and ignored (the prompt cache here is automatic)


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(pattern=NAME)]
    input: dict[str, Any]


class OtherBlock(_Strict):
    """Any other block (image, document, a server tool's): refused after validation, by name."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: Text | list[Annotated[Union[Annotated[TextBlock, Tag("text-block")], Annotated[OtherBlock, Tag("other-block")]],
                              Discriminator(lambda v: _kind(v, ("text",)))]] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        return self.content or ""


class ThinkingBlock(_Strict):
    """An earlier answer's thinking, sent back by a client: dropped (as Anthropic drops earlier turns' thinking)."""

    type: Literal["thinking", "redacted_thinking"]


KNOWN = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _kind(v: Any, known: tuple[str, ...] = KNOWN) -> str:
    """The union member (its tag) a content block is validated as: by its type, any other type is OtherBlock."""
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if t in ("thinking", "redacted_thinking"):
        t = "thinking"
    return f"{t}-block" if t in known else "other-block"


Block = Annotated[Union[Annotated[TextBlock, Tag("text-block")], Annotated[ToolUseBlock, Tag("tool_use-block")],
                        Annotated[ToolResultBlock, Tag("tool_result-block")], Annotated[ThinkingBlock, Tag("thinking-block")],
                        Annotated[OtherBlock, Tag("other-block")]], Discriminator(_kind)]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=1024)]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(_Strict):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=NAME)]
    description: Text | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(pattern=NAME)] | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    """Anthropic's extended thinking: "enabled" thinks within budget_tokens (the think block is closed after that
    many tokens, edge.decode.thinking), "adaptive" lets the model decide (the server's --reasoning-budget),
    "disabled" does not think. display "omitted": the thinking blocks come empty (their signature still)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # one effort here: accepted
    format: OutputFormat | None = None  # structured output: the answer is JSON that follows the schema


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: the prompt a Messages request would make, counted, nothing generated."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # the prompt cache here is automatic: accepted, nothing to do
    speed: Literal["standard", "fast"] | None = None  # one speed here: accepted

    def extra_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system

    def openai_tools(self) -> list[dict] | None:
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in self.tools] \
            if self.tools else None

    def openai_tool_choice(self) -> Any:
        c = self.tool_choice
        if c is None:
            return None
        if c.type == "tool":
            return {"type": "function", "function": {"name": c.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[c.type]

    def openai_messages(self) -> tuple[list[dict], str]:
        """(the conversation as OpenAI chat messages, the answer's start: a final assistant message's text)."""
        out: list[dict] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        merged: list[tuple[str, list]] = []  # Anthropic combines consecutive turns of one role into one
        for m in self.messages:
            if merged and merged[-1][0] == m.role:
                merged[-1][1].extend(m.blocks())
            else:
                merged.append((m.role, m.blocks()))
        prefill = ""
        if merged and merged[-1][0] == "assistant":
            role, blocks = merged.pop()
            prefill = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        names: dict[str, str] = {}  # tool_use id -> the tool's name (a tool message names its function)
        for role, blocks in merged:
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if role == "assistant":
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                         for b in blocks if isinstance(b, ToolUseBlock)]
                names.update({c["id"]: c["function"]["name"] for c in calls})
                out.append({"role": "assistant", "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
                continue
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    text = b.text()
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "name": names.get(b.tool_use_id, ""),
                                "content": f"Error: {text}" if b.is_error else text})
            if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "\n".join(texts)})
        return out, prefill

    def _chat_fields(self) -> dict[str, Any]:
        """The sampling fields of the OpenAI request (none for a token count)."""
        return {}

    def thinks(self, model_thinks: bool) -> bool:
        """Whether the answer may think: asked for ("enabled", or "adaptive": the model decides) on a model that
        thinks. Off unless asked for, as on Anthropic's API. "enabled" on a model that does not think is a
        BadRequest ("adaptive" is not: that model decides not to)."""
        t = self.thinking
        if t is None or t.type == "disabled" or (t.type == "adaptive" and not model_thinks):
            return False
        if not model_thinks:
            raise BadRequest("'thinking' is not available: this model does not think before answering; send "
                             "{\"type\": \"disabled\"} or leave it out", param="thinking")
        return True

    def thinking_display(self, model_thinks: bool) -> str | None:
        """How the answer's thinking is shown: None (no thinking), "summarized" (as it was written: a small
        model's thinking is short) or "omitted" (empty thinking blocks, the signature kept)."""
        if not self.thinks(model_thinks):
            return None
        return self.thinking.display or "summarized"  # type: ignore[union-attr]

    def chat(self, model_thinks: bool = False) -> tuple[ChatCompletionRequest, str]:
        """The OpenAI chat request this is (served by the same rows, grammar and scheduler) and the answer's
        start (a final assistant message: the answer continues it). A thinking model's template is told whether
        to think (`enable_thinking`, Qwen3's and SmolLM3's switch), so no think block lands in the text of an
        answer that was not asked to think; "enabled" thinking's budget_tokens is the row's reasoning budget."""
        messages, prefill = self.openai_messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self._chat_fields()}
        if model_thinks:
            on = self.thinks(True)
            if on and prefill:
                raise BadRequest("a final assistant message (the start of the answer) cannot be used with "
                                 "'thinking': the answer starts with its thinking; end with a user message",
                                 param="messages")
            body["chat_template_kwargs"] = {"enable_thinking": on}
            if on and self.thinking.type == "enabled":  # type: ignore[union-attr]
                body["reasoning_budget"] = self.thinking.budget_tokens  # type: ignore[union-attr]
        else:
            self.thinks(False)
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if self.tools:
            body["tools"] = self.openai_tools()
            body["tool_choice"] = self.openai_tool_choice()
            body["parallel_tool_calls"] = not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)
        stop = body.pop("stop", None)
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:  # checked above in Anthropic's terms: only a rule missed there gets here
            raise validation_error(e) from None
        # Anthropic takes more stop sequences than OpenAI's 4: set after validation, the loop takes any number
        return chat.model_copy(update={"stop": stop}), prefill


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
    metadata: Metadata | None = None
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool | None = None
    temperature: Annotated[float | None, Field(ge=0, le=1, allow_inf_nan=False)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1, allow_inf_nan=False)] = None
    top_k: Annotated[int | None, Field(ge=0, le=MAX_TOKENS_LIMIT)] = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: accepted, nothing to choose
    inference_geo: Annotated[str, Field(max_length=64)] | None = None  # runs here: accepted
    seed: Annotated[int | None, Field(ge=0, le=MAX_SEED)] = None  # EdgeChat's: a sampled answer, reproducible

    def thinks(self, model_thinks: bool) -> bool:
        on = super().thinks(model_thinks)
        t = self.thinking
        if on and t is not None and t.budget_tokens is not None and t.budget_tokens >= self.max_tokens:
            raise BadRequest(f"'thinking.budget_tokens' is {t.budget_tokens} but must be less than max_tokens "
                             f"({self.max_tokens}): max_tokens counts the thinking and the answer", param="thinking")
        return on

    def _chat_fields(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stream": self.stream, "stop": list(self.stop_sequences or []) or None,
                "user": self.metadata.user_id if self.metadata else None}


RULES = {  # what each field takes, in words, for the error message
    "model": "a non-empty string (any name: one model per server)",
    "max_tokens": f"an integer from 1 to {MAX_TOKENS_LIMIT} (required here; and within the model's context)",
    "messages": "a non-empty list of {\"role\": \"user\" | \"assistant\", \"content\": a string or a list of "
                "content blocks}",
    "messages.role": "\"user\" or \"assistant\" (the system prompt goes in the top-level 'system')",
    "messages.content": "a string or a list of content blocks: text, tool_use, tool_result",
    "messages.content.text": "a string",
    "messages.content.type": "one of text, tool_use, tool_result",
    "messages.content.id": "a string (the tool_use id a tool_result answers)",
    "messages.content.name": "a tool name: letters, digits, _ and -, at most 64",
    "messages.content.input": "an object (the tool's arguments)",
    "messages.content.tool_use_id": "a string (the id of the tool_use block this result answers)",
    "messages.content.content": "a string or a list of text blocks",
    "messages.content.is_error": "true or false",
    "system": "a string or a list of {\"type\": \"text\", \"text\": ...} blocks",
    "metadata": "an object such as {\"user_id\": ...}",
    "stop_sequences": f"a list of up to {MAX_STOP_SEQUENCES} non-empty strings",
    "stream": "true or false",
    "temperature": "a finite number from 0 to 1",
    "top_p": "a finite number greater than 0 and at most 1",
    "top_k": "an integer >= 0 (0: off)",
    "seed": f"an integer from 0 to {MAX_SEED} (EdgeChat's: the same seed gives the same sampled answer)",
    "tools": f"a list of up to {MAX_TOOLS} {{\"name\", \"description\", \"input_schema\"}} objects (name: letters, "
             "digits, _ and -, at most 64)",
    "tools.type": "\"custom\" or absent: this server runs the tools you define (name, description, input_schema); "
                  "Anthropic's server tools (web search, bash, ...) are not available here",
    "tools.input_schema": "a JSON schema object of the tool's input",
    "tool_choice": "{\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
    "thinking": "{\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or {\"type\": \"disabled\"} "
                "(display: \"summarized\" or \"omitted\"; enabled and adaptive on a model that thinks)",
    "thinking.budget_tokens": f"an integer from 1 to {MAX_TOKENS_LIMIT}, less than max_tokens",
    "service_tier": "\"auto\" or \"standard_only\"",
    "output_config": "{\"format\": {\"type\": \"json_schema\", \"schema\": {...}}} (effort is accepted, one effort here)",
    "speed": "\"standard\" or \"fast\"",
}
MEMBERS = frozenset({"text-block", "tool_use-block", "tool_result-block", "thinking-block", "other-block"})
UNSUPPORTED_HINTS = {
    "container": "this server runs no code containers",
    "mcp_servers": "this server connects to no MCP servers: define the tools in 'tools'",
    "context_management": "the server fits long chats itself (docs/serving.md)",
}
REFUSED_BLOCKS = {
    "image": "this model reads text only: describe the image in a text block",
    "document": "this model reads text only: send the document's text in a text block",
}


def parse_count_tokens_request(raw: bytes, lenient: bool = False) -> CountTokensRequest:
    """Validate a count_tokens body; raises BadRequest naming the field and what it takes."""
    return _check(_parse(CountTokensRequest, raw, lenient))


def parse_messages_request(raw: bytes, lenient: bool = False) -> MessagesRequest:
    """Validate a Messages body; raises BadRequest naming the field and what it takes."""
    body = _check(_parse(MessagesRequest, raw, lenient))
    wants_tools = bool(body.tools) and (body.tool_choice is None or body.tool_choice.type != "none")
    json_out = body.output_config is not None and body.output_config.format is not None
    if json_out and wants_tools:
        raise BadRequest("'output_config.format' and 'tools' cannot constrain the same answer: send one of them (or "
                         "tool_choice {\"type\": \"none\"})", param="output_config")
    if body.stop_sequences and json_out:
        raise BadRequest("'stop_sequences' cannot be used with 'output_config.format': a stop sequence would cut the "
                         "JSON short; send the request without it", param="stop_sequences")
    if body.stop_sequences and wants_tools:
        raise BadRequest("'stop_sequences' cannot be used with 'tools' (unless tool_choice is {\"type\": \"none\"}): a "
                         "stop sequence would cut a tool_use block's JSON short; send the request without it",
                         param="stop_sequences")
    last = body.messages[-1]
    if all(m.role == "assistant" for m in body.messages):
        raise BadRequest("'messages' needs a user message: there is nothing to answer", param="messages")
    if last.role == "assistant":
        if json_out:
            raise BadRequest("a final assistant message (the start of the answer) cannot be used with "
                             "'output_config.format': the JSON must start the answer; end with a user message",
                             param="messages")
        if wants_tools:
            raise BadRequest("a final assistant message (the start of the answer) cannot be used with 'tools': the "
                             "answer must be free to start a tool_use block; end with a user message",
                             param="messages")
        if any(not isinstance(b, TextBlock) for b in last.blocks()):
            raise BadRequest("the final assistant message (the start of the answer) may hold only text blocks: end "
                             "with a user message holding the tool_result", param="messages")
        if "".join(b.text for b in last.blocks()) != "".join(b.text for b in last.blocks()).rstrip():
            raise BadRequest("the final assistant message (the start of the answer) cannot end with whitespace: "
                             "remove it", param="messages")
    return body


def _check(body: CountTokensRequest) -> CountTokensRequest:
    """The rules across fields, in Anthropic's terms."""
    t = body.thinking
    if t is not None and t.type == "between_tools":
        raise BadRequest("'thinking' {\"type\": \"between_tools\"} is not supported by this server: send "
                         "{\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or "
                         "{\"type\": \"disabled\"}", param="thinking")
    if t is not None and t.type == "enabled" and t.budget_tokens is None:
        raise BadRequest("'thinking' {\"type\": \"enabled\"} needs 'budget_tokens': the most tokens the model may "
                         "think (fewer than max_tokens)", param="thinking")
    names = [t.name for t in body.tools or []]
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice:
        raise BadRequest(f"'tools' names the tool '{twice[0]}' more than once: each tool needs its own name",
                         param="tools")
    c = body.tool_choice
    if c is not None:
        if c.type != "none" and not body.tools:
            raise BadRequest("'tool_choice' needs 'tools': send the tools the model may use", param="tool_choice")
        if c.type == "tool" and c.name is None:
            raise BadRequest("'tool_choice' {\"type\": \"tool\"} needs 'name': the tool to use", param="tool_choice")
        if c.type == "tool" and c.name not in names:
            raise BadRequest(f"'tool_choice' names '{c.name}', which is not one of the 'tools'", param="tool_choice")
    seen: set[str] = set()
    for i, m in enumerate(body.messages):
        for j, b in enumerate(m.blocks()):
            where = f"messages[{i}].content[{j}]"
            if isinstance(b, OtherBlock):
                why = REFUSED_BLOCKS.get(b.type, "send text, tool_use or tool_result blocks")
                raise BadRequest(f"'{where}': '{b.type}' blocks are not supported by this server: {why}",
                                 param="messages")
            if isinstance(b, ToolUseBlock) and m.role != "assistant":
                raise BadRequest(f"'{where}': a tool_use block belongs in an assistant message", param="messages")
            if isinstance(b, ToolUseBlock):
                seen.add(b.id)
            if isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise BadRequest(f"'{where}': a tool_result block belongs in a user message", param="messages")
                if b.tool_use_id not in seen:
                    raise BadRequest(f"'{where}.tool_use_id' is '{b.tool_use_id}', but no earlier assistant message "
                                     "has a tool_use block with that id", param="messages")
                if isinstance(b.content, list) and any(not isinstance(x, TextBlock) for x in b.content):
                    raise BadRequest(f"'{where}.content' may hold only text blocks: this model reads text only",
                                     param="messages")
    return body


def _parse(model: type[CountTokensRequest], raw: bytes, lenient: bool) -> Any:
    return parse_body(model, raw, lenient, UNSUPPORTED_HINTS, rules=RULES, members=MEMBERS, deepest=True)


def openapi_schemas() -> dict:
    """The component schemas of the OpenAPI document: MessagesRequest, CountTokensRequest, AnthropicError, and
    their parts named Anthropic* (OpenAI's request has a Message and a Tool of its own)."""
    defs: dict = {}
    for model in (MessagesRequest, CountTokensRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/Anthropic{model}")
        defs.update({f"Anthropic{k}": v for k, v in schema.pop("$defs", {}).items()})
        defs[model.__name__] = schema
    defs["AnthropicError"] = {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}}
    return defs
