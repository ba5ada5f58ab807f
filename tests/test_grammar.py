"""edge.decode.grammar without a server: token bytes for both vocabulary kinds, a schema's mask walked token by token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge.decode.grammar import GrammarError, GrammarVocab, compile_json, token_bytes

pytest.importorskip("llguidance")


def test_token_bytes_of_byte_level_and_sentencepiece_vocabularies():
    byte_level = {"pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "Sequence", "decoders": []},
                  "model": {"vocab": {"Ġhi": 0, "Ċ": 1, "Ã©": 2}},
                  "added_tokens": [{"id": 3, "content": "<|im_end|>", "special": True}]}
    tokens, special = token_bytes(json.dumps(byte_level), 5)
    assert tokens[:4] == [b" hi", b"\n", "é".encode(), b"<|im_end|>"] and tokens[4] == b"" and special == [3]
    piece = {"pre_tokenizer": None, "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]},
             "model": {"vocab": {"▁hello": 0, "<0x0A>": 1, "é": 2}}, "added_tokens": []}
    tokens, _ = token_bytes(json.dumps(piece), 3)
    assert tokens == [b" hello", b"\n", "é".encode()]


def test_a_schema_mask_allows_exactly_a_valid_answer_then_eos(tiny_generator):
    gen = tiny_generator
    vocab = GrammarVocab.for_tokenizer(gen.tokenizer, gen.decoder.dims.vocab_size)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = compile_json(vocab, schema).matcher()
    for tok in gen.tokenizer.encode('{"ok": true}'):
        allowed = m.allowed()
        assert allowed[tok] and not allowed.all()
        m.advance(tok)
    assert m.done and set(np.flatnonzero(m.allowed())) <= set(gen.tokenizer.eos_ids)
    masked = m.mask(np.zeros(gen.decoder.dims.vocab_size, np.float32))
    assert np.isfinite(masked).sum() == len(set(np.flatnonzero(m.allowed())))
    # a token the grammar does not allow fails the matcher, with a GrammarError
    m2 = compile_json(vocab, schema).matcher()
    with pytest.raises(GrammarError):
        m2.advance(gen.tokenizer.encode("x")[0])
