"""The tokenizer converted from a GGUF splits text as the GGUF's own metadata says (llama.cpp's regexes for
its `tokenizer.ggml.pre`), and a wrong split is repaired: checked on the default model's GGUF."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from export.model_source import default_gguf

    gguf = default_gguf()
    out = tmp_path_factory.mktemp("gguf-tok")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return gguf, out / "tokenizer.json"


def test_the_converted_tokenizer_matches_the_ggufs_own(converted):
    from export.gguf_tokenizer import check_and_fix

    gguf, tok = converted
    before = tok.read_bytes()
    r = check_and_fix(tok, gguf)
    assert r == {"checked": True, "pre_tokenizer": "smollm", "probes": r["probes"], "differences": 0}
    assert tok.read_bytes() == before  # nothing to repair: the file is left as it was


def test_a_wrong_split_is_found_and_repaired(converted, tmp_path):
    from tokenizers import Tokenizer

    from export.gguf_tokenizer import QWEN2, check_and_fix, differences, reference_tokenizer

    gguf, good = converted
    bad = tmp_path / "tokenizer.json"
    shutil.copy(good, bad)
    data = json.loads(bad.read_text())
    # the split a wrong conversion would ship: Qwen2's (whole numbers stay one piece; SmolLM splits digits)
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    bad.write_text(json.dumps(data))
    ref, _ = reference_tokenizer(gguf)
    assert differences(Tokenizer.from_file(str(bad)), ref)  # the probes see it
    r = check_and_fix(bad, gguf)
    assert r["repaired"] and r["differences"] > 0
    assert not differences(Tokenizer.from_file(str(bad)), ref)


def test_unknown_pre_tokenizers_are_reported_not_guessed(tmp_path, monkeypatch):
    from export import gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "PRE_TOKENIZERS", {})
    from export.model_source import default_gguf

    r = gguf_tokenizer.check_and_fix(tmp_path / "unused.json", default_gguf())
    assert r == {"checked": False, "reason": "pre-tokenizer 'smollm' is not in the table of known ones"}


# A SentencePiece vocabulary as a gemma3 GGUF stores it: scores are merge priorities (highest first), so "the"
# is reached by th (-1) + e, and " the" by ▁ + the. A Unigram over the same scores (transformers 4.57's
# conversion of a gemma3 GGUF) prefers the many high-scoring short pieces instead: ▁ + th + e.
SPM_PIECES = {"\u2581": -0.5, "t": 0.0, "h": 0.0, "e": 0.0, "a": 0.0, "n": 0.0, "d": 0.0, "th": -1.0, "he": -2.0,
              "the": -5.0, "\u2581the": -6.0, "an": -3.0, "and": -7.0, "\u2581and": -8.0, "\u2581a": -4.0}


def _spm_gguf(path, add_space_prefix: bool = False):
    import gguf
    from tiny_gguf import write_out

    specials = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3),
                ("<end_of_turn>", 3), ("\n", 4), ("  ", 4)]
    tokens = specials + [(f"<0x{b:02X}>", 6) for b in range(256)] + [(t, 1) for t in SPM_PIECES]
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("attention.head_count_kv", 1),
                       ("attention.key_length", 4), ("attention.value_length", 4)):
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", 10000.0)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in tokens])
    w.add_token_scores([SPM_PIECES.get(t, 0.0) for t, _ in tokens])
    w.add_token_types([ty for _, ty in tokens])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(add_space_prefix)
    w.add_file_type(0)
    return write_out(w, path)


@pytest.mark.parametrize("prefix", [False, True])
def test_a_sentencepiece_gguf_is_tokenized_as_llama_cpp_does_and_repaired(tmp_path, prefix):
    """transformers 4.57 makes a Unigram of a gemma3 GGUF's merge scores (Gemma 3 270M: 'the' cut into t + he,
    perplexity 193 on prose instead of 8.1): the check finds it against llama.cpp's merge loop and ships a BPE
    that merges in the scores' order, special and user-defined tokens matched whole; with add_space_prefix
    (Llama 2, Phi-3 files) a space goes in front of the text and after each special token, as llama.cpp puts it."""
    pytest.importorskip("gguf")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from export.gguf_tokenizer import SpmReference, check_and_fix, differences, reference_tokenizer

    gguf = _spm_gguf(tmp_path / "spm.gguf", prefix)
    ref, kind = reference_tokenizer(gguf)
    assert isinstance(ref, SpmReference) and kind == "sentencepiece"
    ids = {t: i for i, t in enumerate(ref.tokens)}
    # llama.cpp's order: th, then the, then ▁the; "and" likewise; two spaces and the turn markers whole
    the = ids["\u2581the"] if prefix else ids["the"]
    assert ref.encode("the and").ids == [the, ids["\u2581and"]]
    assert ref.encode("<start_of_turn>x  the\n").ids == [ids["<start_of_turn>"]] + (
        [ids["\u2581"]] if prefix else []) + [ids["<0x78>"], ids["  "], the, ids["\n"]]
    out = tmp_path / "hf"
    AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf").save_pretrained(out)
    converted = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert converted.encode("the", add_special_tokens=False).ids != ref.encode("the").ids  # what transformers makes
    r = check_and_fix(out / "tokenizer.json", gguf)
    assert r["checked"] and r["repaired"] and r["pre_tokenizer"] == "sentencepiece" and r["differences"] > 0
    fixed = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert not differences(fixed, ref)
    for text in ("the and a then", "<start_of_turn>user\nthe  and<end_of_turn>\n", "Naïve café 🙂"):
        assert fixed.encode(text, add_special_tokens=False).ids == ref.encode(text).ids, text
    assert fixed.decode(fixed.encode("the and a", add_special_tokens=False).ids) == "the and a"


def test_the_end_of_turn_token_the_template_writes_stops_generation(tmp_path):
    """A gemma3 GGUF records one EOS (<eos>); with Gemma's template (recipes/templates/gemma3.jinja, for a base
    checkpoint) the model ends its turn with <end_of_turn>, which llama.cpp also stops on: the load stage's EOS
    ids hold both, and only the end-of-turn tokens the template writes."""
    pytest.importorskip("gguf")
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from export.load import eos_ids, read_chat_template

    _spm_gguf(tmp_path / "spm.gguf")
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=1), config=SimpleNamespace(eos_token_id=1))
    assert eos_ids(model, tok) == [1]  # no template: the GGUF's EOS alone
    tok.chat_template = read_chat_template(Path(__file__).resolve().parent.parent / "recipes/templates/gemma3.jinja")
    assert eos_ids(model, tok) == [1, tok.convert_tokens_to_ids("<end_of_turn>")]
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    assert eos_ids(model, tok) == [1]  # <|im_end|> is no token of this vocabulary
