"""Vocabulary pruning: keep the tokens chat text uses, drop the rest of the embedding and LM head.

Why: SmolLM2's tied 49,152 x 576 embedding is 21% of its parameters, and the chat data uses ~13k
of those tokens. Dropping the others frees parameters for the blocks, which is where pruning hurts.

The kept set is the base alphabet and every added/special token (always), then the tokens the
calibration and distillation chats use (most used first), each with the BPE merge parts it is built
from, then the earliest merges (BPE's own frequency order) until `size` is reached. Kept tokens keep
their relative order, so the trimmed tokenizer is a standard BPE `tokenizer.json`: a word whose
tokens were all kept tokenizes exactly as before, any other word falls back to smaller kept pieces.
`vocab_map.json` beside the model maps each new id to the teacher's id; distillation and evaluation
read it to compare the student with the teacher token for token.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from edge.errors import RecipeError

VOCAB_MAP = "vocab_map.json"


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def _bpe(tok_json: dict) -> dict:
    model = tok_json.get("model", {})
    if model.get("type") != "BPE":
        raise RecipeError(f"vocabulary pruning supports BPE tokenizers; this tokenizer.json is "
                          f"{model.get('type')!r}: leave prune vocab_size unset")
    return model


def choose(tok_json: dict, counts: Counter, size: int) -> list[int]:
    """Sorted old ids of the `size` tokens kept (see the module docstring for the order)."""
    model = _bpe(tok_json)
    vocab: dict[str, int] = model["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    parts: dict[int, tuple[int, int]] = {}
    for a, b in _merge_pairs(model):
        if a in vocab and b in vocab and a + b in vocab:
            parts.setdefault(vocab[a + b], (vocab[a], vocab[b]))
    added = {t["id"] for t in tok_json.get("added_tokens", [])}
    always = added | {i for i in by_id if i not in parts}  # specials + the base alphabet
    total = max(vocab.values(), default=-1) + 1
    total = max(total, max(added, default=-1) + 1)
    if not len(always) <= size <= total:
        raise RecipeError(f"prune vocab_size={size} must lie between {len(always)} (the base alphabet and special "
                          f"tokens, always kept) and {total} (the whole vocabulary)")
    kept = set(always)

    def closure(i: int) -> set[int]:
        out, todo = set(), [i]
        while todo:
            j = todo.pop()
            if j in kept or j in out:
                continue
            out.add(j)
            todo.extend(parts.get(j, ()))
        return out

    for i, _ in counts.most_common():
        if i in kept or i >= total:
            continue
        new = closure(i)
        if len(kept) + len(new) > size:
            continue  # too big with its parts: a rarer token may still fit
        kept |= new
    for i in sorted(by_id):  # fill in BPE merge order (earliest merges are the most frequent in its corpus)
        if len(kept) >= size:
            break
        if i not in kept:
            new = closure(i)
            if len(kept) + len(new) <= size:
                kept |= new
    return sorted(kept)


def _remap_specials(node, new_id: dict[int, int]):
    """Special-token ids inside a post-processor (TemplateProcessing, Roberta/Bert-style), remapped."""
    if isinstance(node, list):
        return [_remap_specials(n, new_id) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "ids" and isinstance(v, list) and all(isinstance(i, int) for i in v):
            out[k] = [new_id[i] for i in v]
        elif k in ("sep", "cls") and isinstance(v, list) and len(v) == 2 and isinstance(v[1], int):
            out[k] = [v[0], new_id[v[1]]]
        else:
            out[k] = _remap_specials(v, new_id)
    return out


def trim_tokenizer(tok_json: dict, kept: list[int]) -> dict:
    """The tokenizer.json holding only `kept` (old ids), renumbered 0..len-1 in the old order."""
    model = _bpe(tok_json)
    new_id = {old: new for new, old in enumerate(kept)}
    vocab = {t: new_id[i] for t, i in model["vocab"].items() if i in new_id}
    merges = [m for m, (a, b) in zip(model["merges"], _merge_pairs(model)) if a in vocab and b in vocab and a + b in vocab]
    out = dict(tok_json)
    out["model"] = {**model, "vocab": vocab, "merges": merges}
    out["added_tokens"] = [{**t, "id": new_id[t["id"]]} for t in tok_json.get("added_tokens", [])]
    if out.get("post_processor"):
        out["post_processor"] = _remap_specials(out["post_processor"], new_id)
    return out


def remap_id(value, new_id: dict[int, int], what: str):
    """An id (or list of ids) from a config, in the trimmed numbering; None stays None."""
    if value is None:
        return None
    if isinstance(value, list):
        return [remap_id(v, new_id, what) for v in value]
    if value not in new_id:
        raise RecipeError(f"{what} {value} is not among the kept tokens: raise prune vocab_size")
    return new_id[value]


def write_trimmed(dst: Path, kept: list[int], teacher_map: list[int] | None = None) -> None:
    """Rewrite dst's tokenizer files (copied from the model being pruned) for `kept`, and write the map
    from new ids to the teacher's (composed with an earlier map when the model was already trimmed)."""
    from export.load import META

    new_id = {old: new for new, old in enumerate(kept)}
    tok_json = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    (dst / "tokenizer.json").write_text(json.dumps(trim_tokenizer(tok_json, kept), ensure_ascii=False), encoding="utf-8")
    tc_path = dst / "tokenizer_config.json"
    if tc_path.is_file():
        tc = json.loads(tc_path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in tc:
            tc["added_tokens_decoder"] = {str(new_id[int(k)]): v for k, v in tc["added_tokens_decoder"].items()}
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")
    for name in ("generation_config.json", "config.json"):
        p = dst / name
        if p.is_file():
            cfg = json.loads(p.read_text())
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "decoder_start_token_id"):
                if k in cfg:
                    cfg[k] = remap_id(cfg[k], new_id, f"{name} {k}")
            p.write_text(json.dumps(cfg, indent=2))
    meta = json.loads((dst / META).read_text())
    meta["eos_token_ids"] = remap_id(meta["eos_token_ids"], new_id, "EOS token")
    (dst / META).write_text(json.dumps(meta, indent=2))
    teacher_ids = [teacher_map[i] for i in kept] if teacher_map else kept
    (dst / VOCAB_MAP).write_text(json.dumps({"teacher_ids": teacher_ids}))


def teacher_ids(model_dir: Path) -> np.ndarray | None:
    """New id -> teacher id for a vocabulary-pruned model, None when its vocabulary is the teacher's."""
    p = model_dir / VOCAB_MAP
    return np.asarray(json.loads(p.read_text())["teacher_ids"], dtype=np.int64) if p.is_file() else None


def token_counts(hf_dir: Path, source: str | None, splits: tuple[str, ...] = ("calibration", "distillation")) -> Counter:
    """How often each token id occurs in the chats the student will be calibrated and taught on."""
    from export.data import load_chats
    from export.load import chat_tokenizer

    tok = chat_tokenizer(hf_dir)
    counts: Counter = Counter()
    for split in splits:
        for chat in load_chats(source, split, None):
            counts.update(tok.encode_chat(chat, add_generation_prompt=False))
    return counts
