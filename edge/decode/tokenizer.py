"""Tokenizer and chat template, without transformers.

`tokenizers` does the BPE; jinja2 renders the chat template exactly as
transformers' `apply_chat_template` does (same sandbox, same options, same
helpers), so a bundle prompts the model the way it was trained.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Iterable

from edge.bundle import TokenizerSpec
from edge.errors import BundleError, EdgeChatError

# variables the template gets from the conversation itself: chat_template_kwargs may not replace them
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class NoChatTemplateError(EdgeChatError):
    """The bundle has no chat template (a base model): it continues text, it does not take messages."""


def _raise(message: str) -> None:
    raise EdgeChatError(f"chat template refused the conversation: {message}")


def _template_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Same settings as transformers.utils.chat_template_utils._compile_jinja_template
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    import json

    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2


class ChatTokenizer:
    def __init__(self, tokenizer_file: str | Path, spec: TokenizerSpec) -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise BundleError(f"cannot load tokenizer {tokenizer_file}: {e}") from None
        self.spec = spec
        env, jinja2 = _template_env()
        try:  # "" : a base model's bundle, which has no template (raw text and /v1/completions only)
            self.template = env.from_string(spec.chat_template) if spec.chat_template.strip() else None
        except jinja2.TemplateSyntaxError as e:
            raise BundleError(f"the bundle's chat template does not parse: {e}") from None
        self.eos_ids = frozenset(spec.eos_token_ids)
        # Message content is text: a control token typed in a message ("<|im_end|>\n<|im_start|>system ...")
        # becomes ordinary text tokens, so a user cannot forge a turn; only the template inserts real ones.
        # True restores the old behaviour (content tokenized like the template). Set by --allow-special-in-content.
        self.allow_special_in_content = False
        self.specials = tuple(t.content for t in self.tok.get_added_tokens_decoder().values() if t.special)
        self._as_text = None  # a copy of the tokenizer that splits special tokens like any text
        from edge.decode.thinking import detect

        self.thinking = detect(self)  # the think tags the template writes (edge.decode.thinking), or None

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> str:
        """The template's text; `tools` (OpenAI function tools) are passed only to a template that takes them
        (edge.decode.tools decides); `template_kwargs` (a request's chat_template_kwargs, e.g. enable_thinking)
        are more variables for the template."""
        if self.template is None:
            raise NoChatTemplateError(
                "this bundle has no chat template (a base model): it continues text instead of answering messages; "
                "use /v1/completions or `edge-chat run --raw`, or rebuild the bundle with "
                "`edge-export build --chat-template FILE` (a Jinja chat template) to chat with it")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise EdgeChatError(f"each message needs 'role' and 'content', got {m!r}")
        extra = dict(template_kwargs or {})
        clash = sorted((RESERVED_TEMPLATE_VARS | set(self.template.environment.globals)) & set(extra))
        if clash:
            raise EdgeChatError(f"chat_template_kwargs may not set '{clash[0]}': "
                                + ("the conversation sets it" if clash[0] in RESERVED_TEMPLATE_VARS else
                                   "it is one of the template's functions"))
        variables = {**self.spec.special_tokens, **extra, "messages": messages,
                     "add_generation_prompt": add_generation_prompt, "bos_token": self.spec.bos_token or "",
                     "eos_token": self.spec.eos_token or "", **({"tools": tools} if tools else {})}
        if not extra:
            return self.template.render(variables)
        try:
            return self.template.render(variables)
        except EdgeChatError:
            raise
        except Exception as e:  # a variable's value the template cannot use (a list where it compares a bool)
            raise EdgeChatError(f"the chat template failed with these chat_template_kwargs "
                                f"({', '.join(sorted(extra))}): {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        # The template already contains the special tokens: add none (as apply_chat_template does).
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """A raw prompt (text completion, `run --raw`) as the model was trained to see text: after the BOS token
        where the bundle says so (Gemma degenerates without it), once, even if the text starts with it. Empty text
        stays empty (callers refuse an empty prompt, BOS or not)."""
        ids = self.encode(text)
        bos = self.spec.bos_token_id
        if ids and self.spec.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids: the rendered template, with each message's content tokenized as text."""
        if self.allow_special_in_content or not any(
                isinstance(m.get("content"), str) and sp in m["content"] for m in messages for sp in self.specials):
            # nothing to escape: one call
            return self.encode(self.render(messages, add_generation_prompt, tools, template_kwargs))
        return self._encode_content_as_text(messages, add_generation_prompt, tools, template_kwargs)

    def _encode_content_as_text(self, messages: list[dict], add_generation_prompt: bool,
                                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Render with a marker in place of each content, then tokenize the template's text normally (its
        control tokens are real) and each content with special tokens split into ordinary tokens."""
        import re
        import uuid

        tag = uuid.uuid4().hex
        marks = {f"\x00content-{i}-{tag}\x00": m["content"] for i, m in enumerate(messages)}
        rendered = self.render([{**m, "content": k} for m, k in zip(messages, marks)], add_generation_prompt, tools,
                               template_kwargs)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
        if "".join(marks.get(p, p) for p in pieces) != self.render(messages, add_generation_prompt, tools,
                                                                   template_kwargs):
            raise EdgeChatError("this bundle's chat template rewrites message content, so control tokens typed in "
                                f"a message ({', '.join(sp for sp in self.specials if any(sp in c for c in marks.values()))}) "
                                "cannot be kept as text: remove them, or serve with --allow-special-in-content")
        if self._as_text is None:
            from tokenizers import Tokenizer

            self._as_text = Tokenizer.from_str(self.tok.to_str())
            self._as_text.encode_special_tokens = True
        ids: list[int] = []
        for p in pieces:
            if p in marks:
                ids += self._as_text.encode(marks[p], add_special_tokens=False).ids
            elif p:
                ids += self.encode(p)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def streamer(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces that never split a character.

    Decodes a short window of recent tokens and emits only the text that is
    stable: a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until
    the next token completes it. The pieces concatenate to `decode(all ids)`.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.t = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # tokens already emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.t.decode(self.ids[self.prefix:self.read])
        full = self.t.decode(self.ids[self.prefix:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            piece = full[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        prefix_text = self.t.decode(self.ids[self.prefix:self.read])
        full = self.t.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):]
