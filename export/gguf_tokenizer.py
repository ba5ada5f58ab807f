"""Check (and repair) the tokenizer transformers converts from a GGUF against the GGUF's own metadata.

A GGUF carries its BPE vocabulary and merges and names its pre-tokenizer (`tokenizer.ggml.pre`);
llama.cpp maps that name to the regular expressions that split text before BPE. transformers
rebuilds a tokenizer.json from the same file, and a wrong split regex tokenizes some text
differently from how the model was trained (digits, contractions, newlines), silently. The load
stage therefore builds a reference tokenizer from the GGUF alone (its tokens, merges and llama.cpp's
regexes for its pre-tokenizer type) and compares both on probe texts; on a difference it puts the
reference's split into the shipped tokenizer.json and checks again.

SentencePiece GGUFs (`tokenizer.ggml.model = llama`: Gemma 3, Phi-3, Llama 2) hold tokens and scores, and
llama.cpp tokenizes them by merging, again and again, the adjacent pair whose joined text is the token of the
highest score (its `llm_tokenizer_spm`). transformers 4.57 converts a gemma3 GGUF to a Unigram model over those
scores instead, which cuts "the" into "t" + "he" (the Gemma 3 270M GGUF: an 87-token paragraph becomes 170
tokens, perplexity 193 instead of 8.1): the network is fed text it never saw. Here such a file is checked
against a port of llama.cpp's merge loop (`SpmReference`) and, on a difference, its model is replaced by a BPE
whose merges are every (left, right) pair of tokens that joins into a token, ranked by that token's score,
byte fallback on.

transformers 4.57.3-4.57.x also warns "incorrect regex pattern ... fix_mistral_regex=True" for every
local folder it saved itself, whatever the model: that warning is wrong for non-Mistral tokenizers,
and following it would break Qwen's tokenization. This check is what decides, not that warning.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

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
    "<start_of_turn>user\nWrite <b>bold</b>\t\tcode,   then\n\n\n<end_of_turn>\n<start_of_turn>model\n",
]


class SpmReference:
    """llama.cpp's SentencePiece tokenization of a GGUF's tokens and scores (`llm_tokenizer_spm`), in Python.
    Control and user-defined tokens (`<start_of_turn>`, runs of newlines or spaces) are cut out of the raw text
    first, the longest first (llama.cpp's special-token partition with parse_special on: how a rendered chat
    template is tokenized). Each other stretch: spaces as '▁' (and one in front of the text and after each
    cut-out token when `add_space_prefix`, as llama.cpp does), cut into characters, then the adjacent pair whose
    joined text is the highest-scoring token merged first (the leftmost on a tie) until none joins; a piece that
    is no token becomes its bytes' <0xXX> tokens. Quadratic: for the probe texts only."""

    UNKNOWN, CONTROL, USER_DEFINED, BYTE = 2, 3, 4, 6  # llama.cpp's token types

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool):
        self.tokens, self.scores, self.types, self.add_space_prefix = tokens, scores, types, add_space_prefix
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.specials = sorted((t for t, ty in zip(tokens, types) if ty in (self.CONTROL, self.USER_DEFINED)),
                               key=len, reverse=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        """`.ids` of `text`, as tokenizers.Tokenizer.encode gives them (no BOS)."""
        parts: list[tuple[str, bool]] = [(text, False)]
        for sp in self.specials:
            if sp not in text:
                continue
            cut: list[tuple[str, bool]] = []
            for frag, special in parts:
                if special or sp not in frag:
                    cut.append((frag, special))
                    continue
                for k, piece in enumerate(frag.split(sp)):
                    cut += ([(sp, True)] if k else []) + ([(piece, False)] if piece else [])
            parts = cut
        out: list[int] = []
        after_special = True  # llama.cpp puts the space prefix at the start and after every cut-out token
        for frag, special in parts:
            out += [self.ids[frag]] if special else self._merge(" " + frag if self.add_space_prefix and after_special
                                                                   else frag)
            after_special = special
        return SimpleNamespace(ids=out)

    def _merge(self, text: str) -> list[int]:
        pieces = list(text.replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(pieces) - 1):
                tid = self.ids.get(pieces[i] + pieces[i + 1])
                if tid is not None and (best is None or self.scores[tid] > self.scores[best[1]]):
                    best = (i, tid)
            if best is None:
                break
            i = best[0]
            pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        out: list[int] = []
        for p in pieces:
            out += [self.ids[p]] if p in self.ids else [self.ids[f"<0x{b:02X}>"] for b in p.encode("utf-8")]
        return out

    def repair(self, data: dict) -> None:
        """Make tokenizer.json `data` tokenize as this does: a BPE whose merges are every split of a token into
        two tokens, ranked by the joined token's score (highest first), byte fallback on; control and
        user-defined tokens added (matched in the raw text before the model)."""
        ids, merges = self.ids, []
        for i, t in enumerate(self.tokens):
            if self.types[i] in (self.CONTROL, self.USER_DEFINED, self.BYTE) or len(t) < 2:
                continue  # byte tokens come from byte fallback; the others are added tokens, never merged into
            merges += [(-self.scores[i], i, k) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
        merges.sort()
        unk = next((t for t, ty in zip(self.tokens, self.types) if ty == self.UNKNOWN), None)
        data["model"] = {"type": "BPE", "dropout": None, "unk_token": unk,
                         "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                         "byte_fallback": True, "ignore_merges": False, "vocab": ids,
                         "merges": [[self.tokens[i][:k], self.tokens[i][k:]] for _, i, k in merges]}
        space = [{"type": "Prepend", "prepend": "\u2581"}] if self.add_space_prefix else []
        data["normalizer"] = {"type": "Sequence", "normalizers": space + [
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        data["pre_tokenizer"] = None
        have = {a["content"] for a in data.get("added_tokens", [])}
        data["added_tokens"] = data.get("added_tokens", []) + [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": self.types[i] == self.CONTROL}
            for i, t in enumerate(self.tokens) if self.types[i] in (self.CONTROL, self.USER_DEFINED) and t not in have]


def reference_tokenizer(gguf: Path):
    """A tokenizers.Tokenizer built from the GGUF's own vocabulary, merges and pre-tokenizer type (an SpmReference
    for a SentencePiece GGUF), or None with the reason when the GGUF's tokenizer is of neither kind or its
    pre-tokenizer type is not known."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from export.gguf_meta import read_gguf_meta

    meta, _ = read_gguf_meta(gguf, keep_arrays=True)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind == "llama" and "tokenizer.ggml.scores" in meta:
        tokens = meta["tokenizer.ggml.tokens"]
        return SpmReference(tokens, meta["tokenizer.ggml.scores"], meta.get("tokenizer.ggml.token_type") or
                            [1] * len(tokens), bool(meta.get("tokenizer.ggml.add_space_prefix", True))), "sentencepiece"
    if kind != "gpt2":
        return None, f"tokenizer model {kind!r} is neither byte-level BPE nor SentencePiece"
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
    if isinstance(ref, SpmReference):
        ref.repair(data)
    else:
        data["pre_tokenizer"] = json.loads(ref.to_str())["pre_tokenizer"]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    still = differences(Tokenizer.from_file(str(tokenizer_json)), ref)
    if still:
        raise ModelSourceError(f"the tokenizer converted from {gguf.name} does not tokenize like the GGUF itself "
                               f"({'; '.join(still[:2])}), even with the GGUF's {pre!r} pre-tokenizer and merges: convert the "
                               "model to a Hugging Face folder with its original tokenizer.json and build from that")
    return result | {"repaired": True, "was": diffs[:3]}
