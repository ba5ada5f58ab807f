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
