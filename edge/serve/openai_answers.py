"""From a validated OpenAI request to rows of the batch, and from the rows' events to OpenAI's answers.

A request becomes one row per answer: `n` rows for chat (row i seeded `seed + i`, so each answer equals the
single answer asked with that seed), `n` rows per prompt for /v1/completions. Each row may carry a
`RowLogits` (edge.decode.logits: bias, penalties, the grammar of response_format or tools, a logprobs wish) that
the scheduler applies to that row alone. All rows' events arrive on one asyncio queue as (row, event).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import numpy as np

from edge.decode import conversation, thinking
from edge.serve.openai_schema import MAX_N, BadRequest, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from edge.decode.grammar import token_bytes
from edge.decode.logits import RowLogits, TokenLogprob, token_logprob
from edge.decode.sampling import MAX_SEED, SamplingConfig
from edge.decode.tokenizer import NoChatTemplateError
from edge.errors import ContextOverflowError

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
INLINE_PROMPT_CHARS = 8192  # a chat this short is rendered and tokenized on the event loop (~0.1-1 ms), not in a thread


@dataclass
class Rows:
    """What goes to the scheduler for one request: the prompts, and per row its prompt, config and logits."""

    prompts: list[list[int]]
    prompt_of: list[int]
    cfgs: list[SamplingConfig]
    logits: list[RowLogits | None]
    tools: list[dict] | None = None
    tool_choice: Any = None
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)
    score_top: int | None = None  # completions echo + logprobs: the prompt's own logprobs, this many alternatives
    think: thinking.ThinkFormat | None = None  # chat on a thinking model: the answers' reasoning is split out
    opened: bool = False  # the prompt opened the think block (the answers start inside it)
    dropped: int = 0  # the chat's oldest messages dropped to fit the context (--context-overflow shift)


_tables: dict[int, list[bytes]] = {}
_tables_lock = threading.Lock()
_longest: dict[tuple[int, int], int] = {}


def token_table(tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes of every token id (for logprobs' token and bytes fields), built once per tokenizer."""
    with _tables_lock:
        t = _tables.get(id(tokenizer))
        if t is None:
            t = _tables[id(tokenizer)] = token_bytes(tokenizer.tok.to_str(), vocab_size)[0]
        return t


def longest_token_bytes(tokenizer, vocab_size: int) -> int:
    """The longest token's bytes (at least 1), computed once per tokenizer: every request's length bound reads
    it, and a max over 49k entries per request cost ~1 ms of the event loop's time before each prefill."""
    key = (id(tokenizer), vocab_size)
    n = _longest.get(key)
    if n is None:
        n = _longest[key] = max(1, max(len(b) for b in token_table(tokenizer, vocab_size)))
    return n


def _seeds(seed: int | None, n: int) -> list[int | None]:
    return [None if seed is None else (seed + i) % (MAX_SEED + 1) for i in range(n)]


def _check_bias(bias: dict[int, float], vocab: int) -> None:
    bad = [t for t in bias if t >= vocab]
    if bad:
        raise BadRequest(f"'logit_bias' names token {bad[0]}, but this model's vocabulary has ids 0 to {vocab - 1}",
                         param="logit_bias")


def _row_logits(body, vocab: int, grammar, logprobs: int | None,
                think: thinking.ThinkState | None = None) -> RowLogits | None:
    bias = body.bias()
    _check_bias(bias, vocab)
    rl = RowLogits(grammar=grammar, logit_bias=bias, frequency_penalty=body.frequency_penalty or 0.0,
                   presence_penalty=body.presence_penalty or 0.0, logprobs=logprobs,
                   stop_ids=frozenset(body.stop_token_ids or ()), think=think)
    return rl if rl.active or logprobs is not None or rl.stop_ids else None


async def chat_rows(service, body: ChatCompletionRequest, answer_start: str = "") -> Rows:
    """The rows of a chat request: the prompt (tools rendered), the grammar (response_format or tools) and
    n configs. BadRequest / GrammarError (-> 400) for what cannot be served. `answer_start`: text the answer
    continues (Anthropic's final assistant message, edge.serve.anthropic_schema)."""
    gen = service.gen
    vocab = gen.decoder.dims.vocab_size
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    messages = body.conversation()
    params = body.sampling()
    max_tokens = params.pop("max_tokens")
    fit = None
    if service.context_overflow == "shift":  # only the system prompt and the last message must fit
        if max_tokens is not None and max_tokens >= gen.max_context:
            raise ContextOverflowError(f"this model's context is {gen.max_context} tokens and max_tokens asks for "
                                       f"{max_tokens}: lower max_tokens (the prompt takes some of the context too)")
        fit = (gen.max_context, max_tokens if max_tokens is not None else
               min(gen.sampling().max_new_tokens, gen.max_context // 2))
        messages = messages[:1] * (messages[0]["role"] == "system") + messages[-1:]
    surely_too_long(service, _chars(messages) + len(answer_start), "messages")
    rf = body.response_format
    named = rf.json_schema if rf is not None and rf.type == "json_schema" else None

    def compile_grammar():
        return conversation.constraint(
            gen.tokenizer, vocab, tools, choice, parallel_tool_calls=body.parallel_tool_calls is True,
            json_schema=named.schema_ if named else None, json_mode=rf is not None and rf.type == "json_object",
            what=f"response_format json_schema '{named.name}'" if named else "the JSON schema")

    needs = (tools and choice != "none") or (body.response_format is not None and body.response_format.type != "text")
    grammar = await asyncio.to_thread(compile_grammar) if needs else None  # a bad schema is named before the context
    fitted = await chat_prompt(service, body, answer_start, fit)
    prompt = fitted.ids
    n = body.n or 1
    cfgs = [service.sampling(max_tokens, len(prompt), **{**params, "seed": s}) for s in _seeds(body.seed, n)]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    fmt = gen.tokenizer.thinking
    budget = body.reasoning_budget if body.reasoning_budget is not None else service.reasoning_budget
    budget = None if budget is not None and budget < 0 else budget  # -1: no limit

    def row_logits() -> list[RowLogits | None]:
        return [_row_logits(body, vocab, grammar, logprobs,
                            thinking.row_state(fmt, fitted.opened, budget, grammar is not None)) for _ in range(n)]

    # a matcher per row parses the grammar again: off the event loop when there is one
    logits = await asyncio.to_thread(row_logits) if grammar is not None else row_logits()
    return Rows([prompt], [0] * n, cfgs, logits, tools=tools, tool_choice=choice if tools else None, think=fmt,
                opened=fitted.opened, dropped=fitted.dropped)


async def chat_prompt(service, body: ChatCompletionRequest, answer_start: str = "",
                      fit: tuple[int, int] | None = None) -> conversation.Prompt:
    """The prompt of a chat request (tools rendered; fitted to the context by dropping the oldest turns when `fit`
    is given; chat_template_kwargs to the template): edge.decode.conversation, off the event loop (a large body
    takes seconds to render and tokenize; /health and the streams run there). A bundle without a chat template
    (a base model) is a 400 naming what to do instead."""
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    convo = body.conversation()
    args = (service.gen.tokenizer, convo, tools)
    kw = dict(fit=fit, answer_start=answer_start, template_kwargs=body.chat_template_kwargs)
    try:
        if tools is None and _chars(convo) <= INLINE_PROMPT_CHARS:  # a thread hop costs more than the work
            return conversation.prompt(*args, **kw)
        return await asyncio.to_thread(conversation.prompt, *args, **kw)
    except NoChatTemplateError as e:
        raise BadRequest(str(e), param="messages") from None


def _chars(messages: list[dict]) -> int:
    """The characters of a conversation's text: contents and tool calls' arguments."""
    return sum(len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
               for m in messages)


def surely_too_long(service, chars: int, param: str) -> None:
    """ContextOverflowError, before tokenizing, for text that cannot fit the context whatever its tokens: a
    token holds at most `longest` bytes of text, a character at least one (a 4 MB body would otherwise be
    tokenized, seconds of work, only to be refused)."""
    gen = service.gen
    longest = longest_token_bytes(gen.tokenizer, gen.decoder.dims.vocab_size)
    if chars // longest >= gen.max_context:
        raise ContextOverflowError(f"the {param} hold {chars} characters, at least {chars // longest} tokens, but this "
                                   f"model's context is {gen.max_context} tokens: shorten them")


def completion_rows(service, body: CompletionRequest) -> Rows:
    """The rows of a text completion: each prompt as is (no template), n rows each. Tokenizes: callers on an
    event loop run it in a thread."""
    gen = service.gen
    vocab = gen.decoder.dims.vocab_size
    prompts, texts = [], []
    for i, p in enumerate(body.prompts()):
        if isinstance(p, str):
            surely_too_long(service, len(p), "prompt")
            ids = gen.tokenizer.encode_text(p)
            texts.append(p)
        else:
            bad = [t for t in p if t >= vocab]
            if bad:
                raise BadRequest(f"'prompt' has token id {bad[0]}, but this model's vocabulary has ids 0 to "
                                 f"{vocab - 1}", param="prompt")
            ids = list(p)
            texts.append(gen.tokenizer.decode(ids, skip_special_tokens=False))
        if not ids:
            raise BadRequest(f"prompt {i} is empty: send at least one token", param="prompt")
        prompts.append(ids)
    params = body.sampling()
    max_tokens = params.pop("max_tokens")
    max_tokens = DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens
    n = body.n or 1
    if len(prompts) * n > MAX_N:
        raise BadRequest(f"{len(prompts)} prompts x n={n} asks for {len(prompts) * n} answers; one request may ask "
                         f"for at most {MAX_N}: send fewer prompts per request", param="prompt")
    rows = Rows(prompts, [], [], [], echo=bool(body.echo), prompt_texts=texts,
                score_top=body.logprobs if body.echo and body.logprobs is not None else None)
    for i, ids in enumerate(prompts):
        for s in _seeds(body.seed, n):
            if max_tokens == 0:  # echo only: the prompt is scored, nothing generated
                service.sampling(None, len(ids))  # the context check
                continue
            rows.prompt_of.append(i)
            rows.cfgs.append(service.sampling(max_tokens, len(ids), **{**params, "seed": s}))
            rows.logits.append(_row_logits(body, vocab, None, body.logprobs))
    return rows


# -- logprobs in OpenAI's shapes -----------------------------------------------------------------------

def _tok(table: list[bytes], tok: int) -> tuple[str, list[int]]:
    b = table[tok] if tok < len(table) else b""
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(table: list[bytes], lps: list[TokenLogprob]) -> list[dict]:
    """Chat's logprobs.content entries: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    out = []
    for lp in lps:
        s, b = _tok(table, lp.token)
        top = [dict(zip(("token", "bytes"), _tok(table, t)), logprob=v) for t, v in lp.top]
        out.append({"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
    return out


def completion_logprobs(table: list[bytes], lps: list[TokenLogprob | None], offset: int = 0) -> dict:
    """Completions' logprobs: {tokens, token_logprobs, top_logprobs, text_offset} (None for a prompt's first
    token, which nothing predicts)."""
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for lp in lps:
        assert lp is not None
        s, _ = _tok(table, lp.token)
        tokens.append(s)
        values.append(None if np.isnan(lp.logprob) else lp.logprob)
        tops.append({_tok(table, t)[0]: v for t, v in lp.top} if lp.top or not np.isnan(lp.logprob) else None)
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def score_steps(gen, prompts: list[list[int]], top: int) -> Iterator[None]:
    """Each prompt token's logprob given the tokens before it (the first: NaN, nothing predicts it), from the very
    calls a prefill of the prompt runs (`Decoder.prefill_span`: fixed boundaries, so the numbers are a prefill's),
    one call per step: `Scheduler.call_steps` runs one step between two decode steps, as a long prompt's side
    prefill does, so the answers streaming meanwhile do not freeze; a hang-up or a timeout stops it between
    steps. Returns (StopIteration's value) one list per prompt."""
    dec = gen.decoder
    out: list[list[TokenLogprob]] = []
    for ids in prompts:
        cache = dec.new_cache(capacity=len(ids) + 1)
        arr = np.asarray(ids, dtype=np.int64)
        scored = [TokenLogprob(ids[0], float("nan"))]
        start = 0
        while start < len(arr):
            end = min(start + dec.prefill_span(start), len(arr))
            logits = np.asarray(dec.forward(arr[None, start:end], cache, last_only=False)[0])
            # position j's logits predict token j + 1
            scored += [token_logprob(logits[j - start], ids[j + 1], top) for j in range(start, min(end, len(ids) - 1))]
            start = end
            yield None
        out.append(scored)
    return out


async def merged_events(reqs: list, q: asyncio.Queue, n: int) -> AsyncIterator[tuple[int, Any]]:
    """(row, event) from every row until each has finished; leaving early cancels them all."""
    left = n
    try:
        while left:
            i, ev = await q.get()
            yield i, ev
            if ev.finish_reason:
                left -= 1
    finally:
        for r in reqs:
            r.cancel()
