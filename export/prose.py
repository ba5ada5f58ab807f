"""Held-out general English prose, to see what quantization or pruning costs outside chat.

Chat data alone hides damage: chitchat's small talk has a reference perplexity near 48, where a
4-bit model's losses drown. Prose is where they show. The text is the Lee corpus of news articles
(Lee, Pincombe & Welsh 2005: 300 + 50 Australian Broadcasting Corporation articles, one per line in
`lee_background.cor` and `lee.cor`) that **gensim 4.4.0** ships inside its wheel as test data
(gensim is LGPL-2.1-only; the corpus is redistributed with it for research use). Installed with
`pip install --no-deps gensim==4.4.0`: only the two text files are read, gensim is never imported,
and nothing is fetched at run time.

Documents are split by a hash of their text, so the split never changes: "eval" (~20%, held out:
never used for calibration or distillation) and "train" (the rest, for calibration/distillation
mixtures). The two splits share no document.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from functools import lru_cache
from pathlib import Path

from edge.errors import DataError, MissingDependencyError

SPLITS: dict[str, tuple[int, int]] = {"eval": (0, 20), "train": (20, 100)}
FILES = ("lee_background.cor", "lee.cor")
PACKAGE = "gensim==4.4.0"
SOURCE = "Lee corpus (ABC news, 350 articles) shipped in gensim 4.4.0 (LGPL-2.1)"


def prose_dir() -> Path:
    """The folder holding the corpus files inside the installed gensim wheel (gensim is not imported)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise MissingDependencyError("gensim", "the held-out prose set", f"pip install --no-deps {PACKAGE}")
    folder = Path(spec.origin).parent / "test" / "test_data"
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise DataError(f"gensim at {folder.parent.parent} has no {', '.join(missing)}: "
                        f"reinstall it with pip install --force-reinstall --no-deps {PACKAGE}")
    return folder


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # lee.cor has a Latin-1 pound sign
        return raw.decode("cp1252")


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100


@lru_cache(maxsize=1)
def _documents() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for name in FILES:
        for line in _decode((prose_dir() / name).read_bytes()).splitlines():
            doc = " ".join(line.split())
            if len(doc) >= 200:
                seen.setdefault(doc, None)
    return tuple(seen)


def prose_texts(split: str) -> list[str]:
    """The documents of one split ("eval": held out; "train": for calibration/distillation), in file order."""
    if split not in SPLITS:
        raise DataError(f"prose split must be one of {sorted(SPLITS)}, got {split!r}")
    lo, hi = SPLITS[split]
    return [d for d in _documents() if lo <= _bucket(d) < hi]


def bits_per_byte(nll_nats: float, text_bytes: int) -> float:
    """Total negative log-likelihood (nats) per UTF-8 byte of the text scored, in bits.

    Unlike perplexity per token, this compares models whose tokenizers differ (a pruned vocabulary
    splits a word into more, easier tokens; per byte the total cost is what counts).
    """
    if text_bytes <= 0:
        raise ValueError(f"bits per byte needs a positive byte count, got {text_bytes}")
    return nll_nats / math.log(2) / text_bytes
