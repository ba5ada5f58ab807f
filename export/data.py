"""Chat data for calibration, distillation and evaluation.

Default: the `chitchat-dataset` package (BYU PCC Chit Chat Challenge, MIT).
Conversations are split deterministically by a hash of their id into
calibration (10%), distillation (80%) and held-out evaluation (10%), so the
evaluation never sees calibration text. Users may pass their own JSONL, one
chat per line: {"messages": [{"role": "user", "content": "..."}, ...]}.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Literal

from edge.errors import DataError, MissingDependencyError

Split = Literal["calibration", "distillation", "evaluation"]
SPLITS: dict[str, tuple[int, int]] = {"calibration": (0, 10), "distillation": (10, 90), "evaluation": (90, 100)}
# A user's file is usually small: half for calibration/distillation, half held out for evaluation.
USER_SPLITS: dict[str, tuple[int, int]] = {"calibration": (0, 50), "distillation": (0, 50), "evaluation": (50, 100)}
ROLES = ("system", "user", "assistant")


def _bucket(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100


def chitchat_path() -> Path:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or spec.origin is None:
        raise MissingDependencyError("chitchat-dataset", "calibration and evaluation data", "pip install chitchat-dataset")
    return Path(spec.origin).parent / "dataset.json"


def load_chitchat(split: Split, limit: int | None = None, max_turns: int = 6) -> list[list[dict]]:
    raw = json.loads(chitchat_path().read_text(encoding="utf-8"))
    lo, hi = SPLITS[split]
    chats = []
    for cid in sorted(raw):
        if not lo <= _bucket(cid) < hi:
            continue
        msgs = []
        for turn in raw[cid]["messages"][:max_turns]:
            text = " ".join(u["text"].strip() for u in turn if u.get("text", "").strip())
            if text:
                msgs.append({"role": "user" if len(msgs) % 2 == 0 else "assistant", "content": text})
        if len(msgs) >= 2:
            chats.append(msgs)
        if limit and len(chats) >= limit:
            break
    return chats


def load_jsonl(path: str | Path, split: Split | None = None, limit: int | None = None) -> list[list[dict]]:
    """Read a user's chats; with `split`, keep only that deterministic share of lines."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"chat data file {p} does not exist")
    chats = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n}: not valid JSON ({e.msg}); each line must be {{\"messages\": [...]}}") from None
        msgs = obj.get("messages") if isinstance(obj, dict) else obj
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{p}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(f"{p}:{n}: each message needs a role in {ROLES} and a string content, got {m!r}")
        if split is None or USER_SPLITS[split][0] <= _bucket(f"{n}:{line}") < USER_SPLITS[split][1]:
            chats.append(msgs)
    if not chats:
        raise DataError(f"{p} holds no chats" + (f" for the {split} split (it takes ~half of the lines; add more)" if split else ""))
    return chats[:limit] if limit else chats


def load_chats(source: str | None, split: Split, limit: int | None = None) -> list[list[dict]]:
    if source:
        return load_jsonl(source, split, limit)
    chats = load_chitchat(split, limit)
    if not chats:
        raise DataError(f"chitchat-dataset gave no {split} chats")
    return chats
