"""Distillation data: a fixed mixture of sources, each packed into blocks with a loss mask.

Why a mixture: a student distilled on one corpus (chitchat) learned to chat like it and lost the
teacher's general language (+50% bits per byte on held-out prose, issue 28). The teacher's range is
carried by (a) its own questions and answers (export/teacher_answers.py), (b) the user's chats and
(c) general prose (export/prose.py, its "train" documents: never the held-out ones); the recipe gives
each one's share of the training rows and the manifest records what each contributed.

Loss mask: on teacher-written chats the loss is where the teacher's answer is (the prompt is context,
not a target); on chat and prose text, every token (the student must model that text as the teacher
does). Schedule: the block of every row of every step is fixed by the seed, the shares and the step
count, so a resumed run sees what a straight one would, and two runs of a recipe see the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.errors import RecipeError

SOURCES = ("teacher", "chat", "prose")


@dataclass
class Packed:
    """One source's blocks: `ids` [n, seq_len + 1] (inputs and shifted targets), `mask` [n, seq_len]:
    where the loss is taken (target positions)."""
    name: str
    ids: np.ndarray
    mask: np.ndarray


def check_mixture(mixture: dict) -> None:
    bad = set(mixture) - set(SOURCES)
    if bad:
        raise RecipeError(f"distill mixture has unknown sources {sorted(bad)}: choose from {', '.join(SOURCES)}")
    if any(not isinstance(w, (int, float)) or w < 0 for w in mixture.values()) or sum(mixture.values()) <= 0:
        raise RecipeError(f"distill mixture shares must be >= 0 and not all 0, got {mixture}")


def chat_sample(tok, chat: list[dict], answer_only: bool) -> tuple[list[int], list[bool]]:
    """A chat's ids and loss mask: the last (assistant) turn only with `answer_only`, else every token."""
    ids = tok.encode_chat(chat, add_generation_prompt=False)
    if not answer_only:
        return ids, [True] * len(ids)
    prefix = tok.encode_chat(chat[:-1], add_generation_prompt=True)
    if chat[-1]["role"] != "assistant" or ids[: len(prefix)] != prefix:
        raise RecipeError("a teacher-answer chat does not end in an assistant turn that extends its prompt's "
                          "tokens: this chat template cannot mask the prompt (use mixture without teacher)")
    return ids, [False] * len(prefix) + [True] * (len(ids) - len(prefix))


def prose_sample(tok, text: str, sep: int) -> tuple[list[int], list[bool]]:
    """A document's ids then a separator; no loss on predicting the separator."""
    ids = tok.encode(text)
    return ids + [sep], [True] * len(ids) + [False]


def pack(name: str, samples: list[tuple[list[int], list[bool]]], seq_len: int) -> Packed:
    """Samples end to end, cut into blocks of seq_len + 1 tokens (the tail that does not fill one is dropped)."""
    flat = np.fromiter((t for s, _ in samples for t in s), dtype=np.int64)
    m = np.fromiter((b for _, ms in samples for b in ms), dtype=bool)
    n = len(flat) // (seq_len + 1)
    if n < 1:
        raise RecipeError(f"the {name} distillation data has {len(flat)} tokens, fewer than one block of "
                          f"{seq_len + 1}: give more text or a smaller seq_len")
    ids = flat[: n * (seq_len + 1)].reshape(n, seq_len + 1)
    mask = m[: n * (seq_len + 1)].reshape(n, seq_len + 1)[:, 1:]  # loss where the *target* is masked in
    return Packed(name, ids, mask)


def shares(weights: dict[str, float], rows: int) -> dict[str, int]:
    """Rows per source, proportional to its weight (largest remainders; sums to `rows`)."""
    total = sum(weights.values())
    exact = {k: rows * w / total for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], k))[: rows - sum(out.values())]:
        out[k] += 1
    return out


def schedule(sizes: dict[str, int], weights: dict[str, float], steps: int, batch: int, seed: int) -> np.ndarray:
    """[steps, batch] global block ids (sources in `sizes` order, concatenated). Each source's rows walk
    through seeded permutations of its blocks (an epoch each, so a block repeats only after all of its
    source's blocks have been seen); the sources' rows are then merged in a seeded random order that keeps
    each source's own order."""
    rng = np.random.default_rng(seed)
    offsets = np.cumsum([0] + list(sizes.values()))
    rows = shares({k: weights[k] for k in sizes}, steps * batch)
    walks = []
    for off, (name, n) in zip(offsets, sizes.items()):
        epochs = [rng.permutation(n) for _ in range(-(-rows[name] // n))]
        walks.append(off + (np.concatenate(epochs)[: rows[name]] if epochs else np.zeros(0, dtype=np.int64)))
    label = rng.permutation(np.repeat(np.arange(len(walks)), [len(w) for w in walks]))
    order = np.empty(steps * batch, dtype=np.int64)
    for i, w in enumerate(walks):
        order[label == i] = w  # the i-th slot of source i gets its i-th row: each source keeps its order
    return order.reshape(steps, batch)


def load_sources(tok, mixture: dict[str, float], seq_len: int, eos: int, answers: Path | None,
                 chat_data: str | None, samples: int | None) -> list[Packed]:
    """Each source with a share > 0, packed: teacher answers (answer-only loss), chats, prose."""
    from export.data import load_chats, load_jsonl

    out = []
    for name in SOURCES:
        if not mixture.get(name):
            continue
        if name == "teacher":
            if answers is None:
                raise RecipeError("the distill mixture has a teacher share but no teacher answers were written: "
                                  "set teacher_answers = N (> 0) or drop teacher from the mixture")
            smp = [chat_sample(tok, c, answer_only=True) for c in load_jsonl(answers, limit=samples)]
        elif name == "chat":
            smp = [chat_sample(tok, c, answer_only=False) for c in load_chats(chat_data, "distillation", samples)]
        else:
            smp = [prose_sample(tok, t, eos) for t in prose_train(samples)]
        out.append(pack(name, smp, seq_len))
    return out


def prose_train(limit: int | None = None) -> list[str]:
    """General prose for distillation: the "train" documents of export/prose.py (disjoint from its held-out set)."""
    try:
        from export.prose import prose_texts
    except ImportError as e:
        raise RecipeError(f"the distill mixture has a prose share but the general-prose set is unavailable ({e}): "
                          "drop prose from the mixture") from None
    texts = prose_texts("train")
    return texts[:limit] if limit else texts


def describe(sources: list[Packed], order: np.ndarray, weights: dict[str, float]) -> dict:
    """What each source contributed: blocks, rows trained on, epochs, loss tokens: for the manifest."""
    out, off = {}, 0
    flat = order.ravel()
    for p in sources:
        n = len(p.ids)
        rows = flat[(flat >= off) & (flat < off + n)] - off
        out[p.name] = {"share": weights[p.name], "blocks": n, "rows": int(len(rows)),
                       "epochs": round(len(rows) / n, 2), "loss_tokens": int(p.mask[rows].sum()),
                       "unique_blocks_seen": int(len(np.unique(rows)))}
        off += n
    return out
