"""Calibration text by domain, from what an offline workstation already has or installs from a package registry.

GPTQ rounds each weight so the MatMul's output moves least *on its calibration text*; text of one or two kinds
(chat and news) fits the rounding to those kinds. These domains widen it, each freely licensed and installed
like any other dependency (nothing is fetched at run time):

- chat: the calibration split of `chitchat-dataset` (MIT) or the user's JSONL (export/data.py), through the chat
  template;
- news: the training split of the Lee corpus shipped in gensim 4.4.0 (export/prose.py);
- literature: Jane Austen's six novels, from Debian's `r-cran-janeaustenr` (MIT; the texts are public domain),
  read from the R package's data file without R;
- code: the Python standard library's own source (PSF-2.0), present wherever Python is;
- docs: Python's help topics (`pydoc_data.topics`: the language reference as plain text, PSF-2.0) - technical
  how-to and reference prose. Not instruction-following chats: no freely licensed set of those installs offline
  from the registries this project uses.

Every domain but chat is split by a hash of each document, like the prose set: "train" for calibration, "eval"
held out, so a domain can also be scored on text its own calibration never saw. Quotations and poems (Debian's
`fortunes`, the off-domain set docs/quality.md scores on) are deliberately no domain here.
"""

from __future__ import annotations

import hashlib
import struct
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

from edge.errors import DataError, MissingDependencyError, RecipeError

DOMAINS = ("chat", "news", "literature", "code", "docs")
SOURCES = {
    "chat": "chitchat-dataset calibration split (MIT), or the user's calibration JSONL",
    "news": "Lee corpus (ABC news) in gensim 4.4.0 (LGPL-2.1), training split",
    "literature": "Jane Austen's six novels in Debian's r-cran-janeaustenr (MIT; public-domain texts)",
    "code": "the Python standard library's source (PSF-2.0)",
    "docs": "Python's help topics, pydoc_data.topics (PSF-2.0)",
}
SPLITS: dict[str, tuple[int, int]] = {"eval": (0, 20), "train": (20, 100)}
DOC_CHARS = 4000  # a document: about 1,000 tokens of English, more than a calibration text's 512
AUSTEN_DIRS = ("/usr/lib/R/site-library", "/usr/local/lib/R/site-library", "/usr/lib/R/library")


def check_domains(domains: tuple[str, ...]) -> None:
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains or len(set(domains)) != len(domains):
        raise RecipeError(f"gptq_domains must be distinct names from {', '.join(DOMAINS)}, got {list(domains)}")


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100


def _chunks(paragraphs: list[str], size: int = DOC_CHARS) -> list[str]:
    """Consecutive paragraphs joined (blank line between) into documents of about `size` characters."""
    docs, cur, n = [], [], 0
    for p in paragraphs:
        cur.append(p)
        n += len(p)
        if n >= size:
            docs.append("\n\n".join(cur))
            cur, n = [], 0
    if cur and n >= size // 4:
        docs.append("\n\n".join(cur))
    return docs


def _r_strings(raw: bytes) -> list[str | None]:
    """The character strings of one R XDR-serialized object, in order (NA as None): a CHARSXP is a header word
    whose low byte is 9, then its length, then its bytes. Enough for a character vector of lines."""
    if raw[:2] != b"X\n":
        raise DataError("janeaustenr's data is not R's XDR serialization")
    out: list[str | None] = []
    i = 2
    while i + 8 <= len(raw):
        flags, n = struct.unpack(">ii", raw[i:i + 8])
        if flags & 0xFF == 9 and (n == -1 or 0 <= n <= len(raw) - i - 8):
            out.append(None if n == -1 else raw[i + 8:i + 8 + n].decode("utf-8", "replace"))
            i += 8 + max(n, 0)
        else:
            i += 4
    return out


def austen_rdb() -> Path:
    for root in AUSTEN_DIRS:
        p = Path(root) / "janeaustenr" / "data" / "Rdata.rdb"
        if p.is_file():
            return p
    raise MissingDependencyError("r-cran-janeaustenr", "the literature calibration domain",
                                 "apt-get install r-cran-janeaustenr (or, without R: apt-get download "
                                 "r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb /)")


def austen_novels(rdb: Path) -> list[list[str]]:
    """Each novel's paragraphs (its lines joined at blank lines), read from the R package's lazy-load database:
    a row of [4-byte length, zlib stream] records, one per data object (one per novel)."""
    data, pos, novels = rdb.read_bytes(), 0, []
    while pos + 4 < len(data):
        d = zlib.decompressobj()
        raw = d.decompress(data[pos + 4:])
        pos = len(data) - len(d.unused_data)
        paras, cur = [], []
        for line in _r_strings(raw):
            if line and line.strip():
                cur.append(line.strip())
            elif cur:
                paras.append(" ".join(cur))
                cur = []
        if cur:
            paras.append(" ".join(cur))
        if paras:
            novels.append(paras)
    if not novels:
        raise DataError(f"{rdb} holds no text")
    return novels


def _code_docs() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))  # top-level modules: stable
    docs = []
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        docs += _chunks([b for b in text.split("\n\n") if b.strip()])
    return docs


def _help_docs() -> list[str]:
    from pydoc_data.topics import topics

    return [d for name in sorted(topics) for d in _chunks([p.strip() for p in topics[name].split("\n\n") if p.strip()])]


@lru_cache(maxsize=None)
def _documents(domain: str) -> tuple[str, ...]:
    if domain == "news":
        from export.prose import _documents as lee

        return lee()
    if domain == "literature":
        return tuple(d for novel in austen_novels(austen_rdb()) for d in _chunks(novel))
    if domain == "code":
        return tuple(_code_docs())
    if domain == "docs":
        return tuple(_help_docs())
    raise DataError(f"no documents for domain {domain!r}: one of {', '.join(DOMAINS[1:])}")


def domain_texts(domain: str, split: str) -> list[str]:
    """One text domain's documents of a split ("train" for calibration, "eval" held out). News keeps
    export/prose.py's split and order (the calibration it always had); the others are ordered by their hash,
    so the first n mix the whole source (all six novels, many modules)."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if domain == "news":
        from export.prose import prose_texts

        return prose_texts("train" if split == "train" else "eval")
    lo, hi = SPLITS[split]
    docs = [d for d in _documents(domain) if lo <= _bucket(d) < hi]
    return sorted(docs, key=lambda d: hashlib.sha256(d.encode()).hexdigest())


def shares(domains: tuple[str, ...], samples: int, chat_share: float) -> dict[str, int]:
    """Texts per domain: chat gets `chat_share` of `samples` (at least 1) where it is listed, the other domains
    split the rest evenly (the earlier ones take the remainder). ("chat", "news") is the old half and half."""
    check_domains(domains)
    counts = {d: 0 for d in domains}
    rest = samples
    if "chat" in domains:
        counts["chat"] = max(1, round(samples * chat_share)) if len(domains) > 1 else samples
        rest -= counts["chat"]
    others = [d for d in domains if d != "chat"]
    for i, d in enumerate(others):
        counts[d] = rest // len(others) + (1 if i < rest % len(others) else 0)
    return counts

