"""Read a GGUF file's metadata and tensor shapes without loading any weights.

A few dozen lines instead of `gguf.GGUFReader`, which maps and indexes every
tensor (seconds on a small model): the planner must answer in well under 5 s.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from edge.errors import ModelSourceError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ModelSourceError(f"GGUF file {f.name} is truncated")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, typ: int, keep_arrays: bool) -> Any:
    if typ in _SCALARS:
        return _read(f, _SCALARS[typ])
    if typ == _STRING:
        return _string(f)
    if typ == _ARRAY:
        sub, n = _read(f, "<I"), _read(f, "<Q")
        if sub in _SCALARS and not keep_arrays:
            f.seek(n * struct.calcsize(_SCALARS[sub]), 1)
            return n
        items = [_value(f, sub, keep_arrays) for _ in range(n)]
        return items if keep_arrays else n
    raise ModelSourceError(f"GGUF file {f.name} has an unknown value type {typ}")


def read_gguf_meta(path: str | Path, keep_arrays: bool = False) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Return (metadata, {tensor name: shape}). Arrays become their length unless keep_arrays."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelSourceError(f"cannot read GGUF file {path}: {e.strerror}") from None
    with f:
        if f.read(4) != b"GGUF":
            raise ModelSourceError(f"{path} is not a GGUF file (bad magic)")
        version = _read(f, "<I")
        if version < 2:
            raise ModelSourceError(f"{path}: GGUF version {version} is too old; convert it with a recent llama.cpp")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(f)
            meta[key] = _value(f, _read(f, "<I"), keep_arrays)
        shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(n_tensors):
            name = _string(f)
            ndim = _read(f, "<I")
            shapes[name] = tuple(_read(f, "<Q") for _ in range(ndim))
            _read(f, "<I"), _read(f, "<Q")  # type, offset
    return meta, shapes
