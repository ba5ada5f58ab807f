"""The reference's logits on the held-out texts, computed once and kept on disk while engines are scored.

Why: the evaluate stage (and `edge-export eval`) compares every engine with one reference on the same texts.
Holding every engine in ONNX Runtime at once, so that each text's reference logits could be shared, made the
stage's memory grow with the number of engines times the model. Instead the reference runs first, alone, and
writes its logits per text to one file; then each engine is loaded alone, and each text's reference logits are
read back (a private copy of that text's rows, not a memory map: mapped pages that were read stay in the
process's resident set until it unmaps, so a map would bring the whole file back into the peak).

Full float32 logits, not a top-k: the metrics stay bit-identical to scoring with the reference in memory (KL
needs the reference's whole distribution). What that costs on disk: tokens x vocabulary x 4 bytes (SmolLM2-135M
on the default 64 chats + 4096 prose tokens ~2 GB; docs/models.md), removed when the stage ends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from edge.errors import DataError


class ReferenceLogits:
    """Append-only store of float32 [rows, vocab] arrays by key in one file; read back one key at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "wb")
        self.index: dict[object, tuple[int, tuple[int, int]]] = {}  # key -> (byte offset, shape)
        self.bytes = 0

    @staticmethod
    def check_room(folder: Path, need_bytes: int) -> None:
        """Refuse up front, naming the numbers, when the folder's disk cannot hold the reference's logits."""
        free = shutil.disk_usage(folder).free
        if need_bytes > free:
            raise DataError(f"the reference's logits on the held-out texts need {need_bytes / 1e9:.1f} GB on disk in "
                            f"{folder}, which has {free / 1e9:.1f} GB free: free some space there, or score fewer "
                            "texts (--eval-samples, --prose-tokens)")

    def put(self, key: object, logits: np.ndarray) -> None:
        if key in self.index:
            raise KeyError(f"reference logits for {key!r} are already stored")
        a = np.ascontiguousarray(logits, dtype=np.float32)
        if a.ndim != 2:
            raise ValueError(f"reference logits must be [rows, vocab], got shape {a.shape}")
        self.index[key] = (self.bytes, a.shape)
        a.tofile(self._f)
        self.bytes += a.nbytes

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def get(self, key: object, rows: tuple[int, int] | None = None) -> np.ndarray:
        """That key's logits (`rows`: only rows [a, b)), read from the file into a fresh array (flushes what was
        written first)."""
        if not self._f.closed:
            self._f.flush()
        offset, (n, width) = self.index[key]
        a, b = rows if rows is not None else (0, n)
        if not 0 <= a <= b <= n:
            raise IndexError(f"rows {a}:{b} of reference logits {key!r}, which has {n}")
        out = np.fromfile(self.path, dtype=np.float32, count=(b - a) * width, offset=offset + a * width * 4)
        return out.reshape(b - a, width)

    def close(self) -> None:
        """Close and delete the file (the logits are only worth keeping while the engines are scored)."""
        if not self._f.closed:
            self._f.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "ReferenceLogits":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
