"""Check (and repair) the tokenizer transformers converts from a GGUF against the GGUF's own metadata.

A GGUF carries its BPE vocabulary and merges and names its pre-tokenizer (`tokenizer.ggml.pre`);
llama.cpp maps that name to the regular expressions that split text before BPE. transformers
rebuilds a tokenizer.json from the same file, and a wrong split regex tokenizes some text
differently from how the model was trained (digits, contractions, newlines), silently. The load
stage therefore builds a reference tokenizer from the GGUF alone (its tokens, merges and llama.cpp's
regexes for its pre-tokenizer type) and compares both on probe texts; on a difference it puts the
reference's split into the shipped tokenizer.json and checks again.

transformers 4.57.3-4.57.x also warns "incorrect regex pattern ... fix_mistral_regex=True" for every
local folder it saved itself, whatever the model: that warning is wrong for non-Mistral tokenizers,
and following it would break Qwen's tokenization. This check is what decides, not that warning.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge.errors import ModelSourceError

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split expressions applied in order, as llama.cpp's llama-vocab.cpp lists them
# (`regex_exprs` per LLAMA_VOCAB_PRE_TYPE_*). Types not listed here are not checked (and the report says so).
PRE_TOKENIZERS: dict[str, list[str]] = {
    "gpt2": [GPT2], "mpt": [GPT2], "olmo": [GPT2],
    "smollm": [r"\p{N}", GPT2], "starcoder": [r"\p{N}", GPT2], "refact": [r"\p{N}", GPT2],
    "qwen2": [QWEN2], "stablelm2": [QWEN2],
    "llama3": [LLAMA3], "llama-bpe": [LLAMA3], "smaug-bpe": [LLAMA3],
}
IGNORE_MERGES = {"llama3", "llama-bpe", "smaug-bpe"}
PROBES = [
    "Hello world! It's 2026-12-04, and I'll pay $1234.56 for 3 apples.",
    "What's the capital of Japan?\nThe capital of Japan is Tokyo.\n\n",
    "  leading spaces,\ttabs\r\nand CRLF line ends   ",
    "Naïve café, crème brûlée — 日本語のテキスト and emoji 🙂👍🏽.",
    "x=12345678; y = x**2 // 7  # comment\n    return {'a': [1, 2, 3]}",
    "I'M SHOUTING, YOU'RE LISTENING, WE'VE HEARD, THEY'D KNOW, SHE'LL SEE.",
    "camelCaseWords, HTTPServer and path/to/file.txt; a\n/b //c",
    "Numbers: 1, 22, 333, 4444, 55555 and 3.14159 or 1,000,000.",
]


def reference_tokenizer(gguf: Path):
    """A tokenizers.Tokenizer built from the GGUF's own vocabulary, merges and pre-tokenizer type,
    or None with the reason when the GGUF's tokenizer is not a byte-level BPE of a known type."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from export.gguf_meta import read_gguf_meta

    meta, _ = read_gguf_meta(gguf, keep_arrays=True)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        return None, f"tokenizer model {kind!r} is not byte-level BPE"
    if pre not in PRE_TOKENIZERS:
        return None, f"pre-tokenizer {pre!r} is not in the table of known ones"
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    # llama.cpp looks a whole pre-token up in the vocabulary before merging for Llama 3 (ignore_merges)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre


def differences(shipped, reference, probes: list[str] = PROBES) -> list[str]:
    out = []
    for text in probes:
        a = shipped.encode(text, add_special_tokens=False).ids
        b = reference.encode(text, add_special_tokens=False).ids
        if a != b:
            out.append(f"{text[:40]!r}: {len(a)} tokens vs the GGUF's {len(b)}")
    return out


def check_and_fix(tokenizer_json: Path, gguf: Path) -> dict:
    """Compare the converted tokenizer.json with the GGUF's own; repair its split if that is the difference."""
    from tokenizers import Tokenizer

    ref, pre = reference_tokenizer(gguf)
    if ref is None:
        return {"checked": False, "reason": pre}
    shipped = Tokenizer.from_file(str(tokenizer_json))
    diffs = differences(shipped, ref)
    result = {"checked": True, "pre_tokenizer": pre, "probes": len(PROBES), "differences": len(diffs)}
    if not diffs:
        return result
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    data["pre_tokenizer"] = json.loads(ref.to_str())["pre_tokenizer"]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    still = differences(Tokenizer.from_file(str(tokenizer_json)), ref)
    if still:
        raise ModelSourceError(f"the tokenizer converted from {gguf.name} does not tokenize like the GGUF itself "
                               f"({'; '.join(still[:2])}), even with the GGUF's pre-tokenizer {pre!r}: convert the "
                               "model to a Hugging Face folder with its original tokenizer.json and build from that")
    return result | {"repaired": True, "was": diffs[:3]}
