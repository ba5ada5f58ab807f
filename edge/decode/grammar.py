"""Constrained decoding: a JSON schema (or any JSON object) compiled into a per-token mask.

The engine is llguidance (chosen by `scripts/bench_grammar.py`: the lowest per-token mask cost on the default
model's 49k vocabulary, no torch, abi3 wheels for aarch64 such as a Jetson's). It lives behind three small
types so the sampler sees only numpy:

- `GrammarVocab`: the tokenizer's tokens as bytes, built once per tokenizer (about 0.1 s on 49k tokens);
- `Grammar`: one compiled schema (`compile_json`); a schema the engine cannot compile is a `GrammarError`
  naming why, which the server answers with a 400;
- `Matcher`: one answer's state: `mask(logits)` sets every token the grammar forbids to -inf, `advance(tok)`
  moves on. A matcher that fails mid-answer (its per-step work limit ran out) raises `GrammarError` from
  `mask`, which fails that answer only.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from edge.errors import EdgeChatError, MissingDependencyError

MAX_SCHEMA_CHARS = 64 * 1024  # a schema longer than this (as JSON) is refused before compiling
# JSON is written compact-ish and without free whitespace: a small model given free whitespace can emit
# newlines forever, and the answer is the same JSON either way.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(EdgeChatError):
    """A schema or grammar the engine cannot use (why in the message), or a matcher that failed mid-answer."""


def _llg():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise MissingDependencyError("llguidance", "constrained decoding (response_format, tools)",
                                     "pip install 'edgechat[serve]'") from None
    return llguidance


def _limits():
    """Per-request work limits: a hostile schema is refused at compile time or fails its own answer,
    never stalls the decode loop for the other users."""
    return _llg().LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                                 max_grammar_size=200_000, verbose_errors=False)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the characters of a byte-level token -> the bytes they stand for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _has(node: Any, kind: str) -> bool:
    """Whether a tokenizer.json component (or a Sequence of them) contains a part of type `kind`."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == kind:
        return True
    return any(_has(x, kind) for k in ("decoders", "pretokenizers", "normalizers") for x in node.get(k) or [])


def token_bytes(tokenizer_json: str, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(the bytes each token id stands for, the ids of special tokens), from a tokenizer.json.

    Byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen) maps its alphabet back to bytes; SentencePiece-style
    vocabularies use '▁' for a space and <0xNN> byte-fallback tokens. llguidance reads tokenizer.json itself
    only when the decoder is a plain ByteLevel one; GGUF-converted tokenizers have a Sequence, so the bytes are
    worked out here for every kind."""
    d = json.loads(tokenizer_json)
    byte_level = _has(d.get("pre_tokenizer"), "ByteLevel") or _has(d.get("decoder"), "ByteLevel")
    dec = _byte_decoder()
    out = [b""] * vocab_size
    for s, i in (d.get("model", {}).get("vocab") or {}).items():
        if not 0 <= i < vocab_size:
            continue
        if byte_level and all(c in dec for c in s):
            out[i] = bytes(dec[c] for c in s)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out[i] = bytes([int(s[3:5], 16)])
        else:
            out[i] = s.replace("▁", " ").encode()
    special = []
    for t in d.get("added_tokens") or []:
        if 0 <= t["id"] < vocab_size:
            out[t["id"]] = t["content"].encode()
            if t.get("special"):
                special.append(t["id"])
    return out, special


class _Wrapper:
    """What llguidance.LLTokenizer reads: token bytes, EOS/BOS, special ids, and an encode function."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, bos: int | None, encode) -> None:
        self.tokens, self.special_token_ids, self.eos_token_id, self.bos_token_id = tokens, special, eos, bos
        self._encode = encode

    def __call__(self, s: str) -> list[int]:
        return self._encode(s)


class GrammarVocab:
    """A tokenizer as the grammar engine sees it; build once per tokenizer (`for_tokenizer` caches it)."""

    _cache: dict[int, "GrammarVocab"] = {}
    _lock = threading.Lock()

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], bos_id: int | None = None) -> None:
        llg = _llg()
        from tokenizers import Tokenizer

        tk = Tokenizer.from_str(tokenizer_json)
        tokens, special = token_bytes(tokenizer_json, vocab_size)
        wrapper = _Wrapper(tokens, special, eos_ids[0], bos_id,
                           lambda s: tk.encode(s, add_special_tokens=False).ids)
        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int) -> "GrammarVocab":
        """The vocabulary of an `edge.decode.tokenizer.ChatTokenizer`, built on first use and kept."""
        key = id(tokenizer)
        with cls._lock:
            v = cls._cache.get(key)
            if v is None or v.vocab_size != vocab_size:
                v = cls(tokenizer.tok.to_str(), vocab_size, sorted(tokenizer.eos_ids), tokenizer.spec.bos_token_id)
                cls._cache[key] = v
            return v


class Grammar:
    """One compiled grammar: make a `Matcher` per answer."""

    def __init__(self, vocab: GrammarVocab, grammar: str, what: str) -> None:
        llg = _llg()
        self.vocab, self.grammar, self.what = vocab, grammar, what
        self._limits = _limits()
        err = llg.LLMatcher.validate_grammar(grammar, vocab.tok, limits=self._limits)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"{what} cannot be used for constrained decoding: {_short(err)}")
        self._start: Any = None
        first = self.matcher()  # compiles the lexer: a schema too costly for the limits fails here, not mid-answer
        try:  # and the first token's mask: a schema nothing satisfies (a required recursion) is a 400 now, not
            ok = first.allowed()  # a 500 at the first token after a slot was taken
        except GrammarError as e:
            raise GrammarError(f"{what} cannot be used for constrained decoding: "
                               f"{str(e).removeprefix('constrained decoding failed: ')}") from None
        self._start = first.m  # each answer's matcher is a copy of this one: n answers parse the grammar once
        if not ok.any():
            raise GrammarError(f"{what} cannot be used for constrained decoding: no answer can satisfy it "
                               "(no first token is allowed)")

    def matcher(self) -> "Matcher":
        return Matcher(self, self._start.deep_copy() if self._start is not None else None)


class Matcher:
    """One answer's grammar state."""

    def __init__(self, grammar: Grammar, started: Any = None) -> None:
        llg = _llg()
        self.g = grammar
        self.m = started if started is not None else llg.LLMatcher(grammar.vocab.tok, grammar.grammar, log_level=0,
                                                                   limits=grammar._limits)
        if self.m.is_error():
            raise GrammarError(f"{grammar.what} cannot be used for constrained decoding: {_short(self.m.get_error())}")
        self.bits = llg.numpy.allocate_token_bitmask(1, grammar.vocab.vocab_size)

    def allowed(self) -> np.ndarray:
        """Bool [vocab]: the tokens the grammar allows next (EOS once the answer is complete)."""
        _llg().numpy.fill_next_token_bitmask(self.m, self.bits, 0)
        if self.m.is_error():
            raise GrammarError(f"constrained decoding failed: {_short(self.m.get_error())}")
        return np.unpackbits(self.bits[0].view(np.uint8), bitorder="little")[: self.g.vocab.vocab_size].view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a logits row with every forbidden token at -inf (a longer row's tail, too)."""
        ok = self.allowed()
        if not ok.any():  # cannot happen with a sound grammar (EOS is allowed at its end): fail this answer only
            raise GrammarError("constrained decoding failed: the grammar allows no next token")
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        n = min(len(ok), logits.shape[-1])
        out[:n] = np.where(ok[:n], logits[:n], -np.inf)
        return out

    def advance(self, tok: int) -> None:
        """Move past a sampled token (it came from the mask, so the grammar accepts it)."""
        if not self.m.consume_token(int(tok)):
            raise GrammarError(f"constrained decoding failed: {_short(self.m.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the answer should end."""
        return self.m.is_stopped()

    def close(self) -> None:
        self.m = None  # type: ignore[assignment]


def _short(err: str, limit: int = 300) -> str:
    err = " ".join(err.split("<state>")[0].split())
    return err if len(err) <= limit else err[: limit - 3] + "..."


def _resolve(root: dict, ref: str) -> Any:
    """The node a local `$ref` ("#", "#/$defs/x", "#/definitions/x", any JSON pointer) points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def unsatisfiable_ref(schema: dict) -> str | None:
    """A `$ref` that every answer must follow forever (`n` requires `c`, which is an `n`), or None.

    Such a schema compiles, but no finite JSON satisfies it: the engine runs out of work at the first tokens.
    A fixed point over the referenced nodes: a node is finite when some answer of it needs no unending
    recursion (any branch of anyOf/oneOf, every required property and every part of allOf, items only where
    minItems > 0)."""
    refs: dict[str, Any] = {}

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in refs:
                refs[ref] = _resolve(schema, ref)
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(schema)
    if not refs:
        return None
    finite: dict[str, bool] = {r: False for r in refs}

    def ok(node: Any, depth: int = 0) -> bool:
        if depth > 64 or not isinstance(node, dict):
            return True  # true/false schemas, or too deep to judge: the engine decides
        ref = node.get("$ref")
        if isinstance(ref, str) and refs.get(ref) is not None and not finite[ref]:
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(ok(b, depth + 1) for b in node[key]):
                return False
        if isinstance(node.get("allOf"), list) and not all(ok(b, depth + 1) for b in node["allOf"]):
            return False
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in node.get("required") or []:
            if isinstance(name, str) and name in props and not ok(props[name], depth + 1):
                return False
        min_items = node.get("minItems", 0)
        if isinstance(min_items, int) and min_items > 0:
            items = node.get("items")
            if isinstance(items, dict) and not ok(items, depth + 1):
                return False
        return True

    changed = True
    while changed:
        changed = False
        for r, target in refs.items():
            if not finite[r] and (target is None or ok(target)):
                finite[r] = changed = True
    if ok(schema):
        return None
    return next((r for r, f in finite.items() if not f), "#")


def compile_json(vocab: GrammarVocab, schema: dict | None, what: str = "the JSON schema") -> Grammar:
    """A grammar for JSON that follows `schema` (None: any JSON object, as response_format json_object).

    GrammarError (-> 400) when the schema is not an object, is over MAX_SCHEMA_CHARS, uses a keyword the
    engine does not implement, or is too costly for the per-request limits."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters as JSON; the limit is {MAX_SCHEMA_CHARS}")
    endless = unsatisfiable_ref(schema)
    if endless is not None:
        raise GrammarError(f"{what} cannot be satisfied: every answer must follow '$ref': '{endless}' forever (a "
                           "required property or item that refers back to itself); make that property optional "
                           "or give it a non-recursive alternative (anyOf)")
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{what} cannot be used for constrained decoding: {_short(str(e))}") from None
    return Grammar(vocab, grammar, what)


def compile_lark(vocab: GrammarVocab, lark: str, what: str) -> Grammar:
    """A grammar in llguidance's Lark dialect (tool calls: a choice of JSON schemas inside fixed text)."""
    return Grammar(vocab, _llg().LLMatcher.grammar_from_lark(lark), what)
