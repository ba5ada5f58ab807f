"""GPTQ's input statistics for a build: collected once, kept on disk in the build's work folder, shared by its engines.

int8-dynamic and int4-weight both round by GPTQ from the same statistics (X^T X of every weight MatMul's input
on the same calibration texts, export/hessians.py). Collected per engine they cost the same pass twice (the 0.5B
Qwen2.5-Coder: most of a 29-minute int8 stage, then again for int4). Here the first engine's quantize stage
writes each matrix to `OUT.work/gptq-statistics-KEY/` as it is collected, and a later stage with the same KEY
loads it instead. KEY covers what the matrices depend on: the plain graph's weights (path, size and mtime of
the graph and its data: a new export is a new key), the calibration token ids (texts, counts, lengths, chat
share, the user's file) and hessians.py, the code that collects them. A changed key recomputes, and the folders of other keys are
removed then (each is K x K float64 per distinct input: SmolLM2-135M 0.8 GB, Qwen2.5-0.5B 4.5 GB); where the
disk has not twice that free, nothing is stored and each engine collects its own, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from edge.errors import RecipeError
from export.stages import code_fingerprint

log = logging.getLogger("edgechat")
PREFIX = "gptq-statistics-"


def statistics_key(plain: Path | list[Path], feeds: list[dict]) -> str:
    """What the statistics depend on, hashed: the plain graph's weights (or, for the streaming build, the
    checkpoint's files), the calibration tokens, the code that collects them (export.stages.code_fingerprint, as
    stage reuse keys its code)."""
    files = plain if isinstance(plain, list) else [plain, plain.with_name(plain.name + ".data")]
    weights = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]
    code = code_fingerprint("export.hessians")  # hessians.py and the project modules it imports
    tokens = hashlib.sha256()
    for f in feeds:
        tokens.update(np.ascontiguousarray(f["input_ids"], np.int64).tobytes() + b"|")
    return hashlib.sha256(json.dumps([weights, code, tokens.hexdigest()]).encode()).hexdigest()[:16]


class StoredStatistics:
    """The statistics interface of `Hessians` / `LayerHessians` (`input_of`, `__call__(node)`, `rows`, `passes`,
    `method`, `close`) over a folder of .npy files: a matrix on disk is loaded, one that is not is collected by
    `make()` (built on first need) and every matrix that pass produced is written, so the next engine finds it."""

    def __init__(self, folder: Path, make: Callable[[], object], input_of: dict[str, str], rows: int,
                 key_of: dict[str, str] | None = None) -> None:
        """`key_of`: an input's name on disk, where not its graph name (the streaming build's engines of both graphs
        name one input differently: `streamed_statistics`)."""
        self.folder, self._make, self.input_of, self.rows = folder, make, input_of, rows
        self.key_of = key_of or {}
        folder.mkdir(parents=True, exist_ok=True)
        self._inner = None
        self._passes = 0  # of inners already closed
        self._last: tuple[str, np.ndarray] | None = None  # q, k and v ask for the same input in a row
        self.loaded_from_disk = 0  # matrices this stage read back
        self.computed = 0  # ...and collected itself
        meta = folder / "method.txt"
        self.method = meta.read_text().strip() if meta.is_file() else None

    @property
    def passes(self) -> int:
        """Passes over the calibration texts this stage ran (0: every matrix came from disk)."""
        return self._passes + (self._inner.passes if self._inner is not None else 0)

    def _file(self, x: str) -> Path:
        return self.folder / (hashlib.sha256(self.key_of.get(x, x).encode()).hexdigest()[:24] + ".npy")

    def __call__(self, node: str) -> np.ndarray:
        x = self.input_of[node]
        if self._last is not None and self._last[0] == x:
            return self._last[1]
        f = self._file(x)
        if self._inner is not None and x in self._inner.loaded:  # collected by this stage's pass: in memory
            h = self._inner.loaded[x]
        elif f.is_file():
            h = np.load(f)
            self.loaded_from_disk += 1
        else:
            if self._inner is None:
                self._inner = self._make()
                self.method = self._inner.method
                (self.folder / "method.txt").write_text(self.method + "\n")
            h = self._inner(node)
            for y, m in self._inner.loaded.items():  # the whole pass's matrices, each written once
                g = self._file(y)
                if not g.is_file():
                    tmp = g.with_suffix(".tmp.npy")
                    np.save(tmp, m)
                    os.replace(tmp, g)
                    self.computed += 1
        self._last = (x, h)
        return h

    def close(self) -> None:
        self._last = None
        if self._inner is not None:
            self._passes += self._inner.passes
            self._inner.close()
            self._inner = None


def _shared_folder(key: str, dst: Path, need: int) -> Path | None:
    """The build's folder for statistics of `key` (other keys' folders removed), or None where the disk has not
    twice `need` bytes free (then each engine collects its own)."""
    folder = dst.parent / f"{PREFIX}{key}"
    if not folder.is_dir() and 2 * need > shutil.disk_usage(dst.parent).free:
        log.warning("GPTQ statistics are not kept for the next engine: they need %.1f GB and %s has %.1f GB free",
                    need / 1e9, dst.parent, shutil.disk_usage(dst.parent).free / 1e9)
        return None
    for old in dst.parent.glob(PREFIX + "*"):  # another export's or calibration's: never asked for again
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def streamed_statistics(source, files: list[Path], dst: Path, feeds: list[dict], input_of: dict[str, str],
                        widths: dict[str, int], shared: bool = True):
    """GPTQ's statistics for the streaming build (export/stream_build.py): collected one decoder block at a time
    with that block's weights read from `source` (export/hessians.py `StreamedLayerHessians`), asked for by the streamed
    graph's MatMul names (`input_of`: name -> input; `widths`: input -> K). `shared`: kept on disk as
    `gptq_statistics` keeps them, keyed by the checkpoint's `files` instead of a graph."""
    from export.hessians import StreamedLayerHessians

    if not sum(int(np.prod(f["input_ids"].shape)) for f in feeds):
        raise ValueError("GPTQ needs calibration text: no tokens were given")

    def collect():
        return StreamedLayerHessians(source, input_of, feeds)

    folder = _shared_folder(statistics_key(files, feeds), dst, sum(k * k * 8 for k in widths.values())) \
        if shared else None
    if folder is None:
        return collect()
    return StoredStatistics(folder, collect, input_of, sum(int(np.prod(f["input_ids"].shape)) for f in feeds),
                            key_of=module_keys(source.config, input_of))


def module_keys(config: dict, input_of: dict[str, str]) -> dict[str, str]:
    """Each MatMul input of a streamed graph -> the first Linear module (in the model's order) that reads it: one
    key for the fused graph's packed q/k/v input and the plain graph's q, k and v inputs (gate/up alike), so a
    streaming build's fused engines (int8-dynamic, int4-weight) and plain one (int4-qdq) share one pass."""
    from export.hessians import linear_modules
    from export.weight_source import empty_model

    model = empty_model(config)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    keys: dict[str, str] = {}
    for node, module in linear_modules(model, input_of).items():
        x = input_of[node]
        if x not in keys or order[module] < order[keys[x]]:
            keys[x] = module
    return {x: "input of " + m for x, m in keys.items()}


def gptq_statistics(plain: Path, fused: bool, hf_dir: Path, dst: Path, feeds: list[dict], shared: bool = True):
    """GPTQ's input statistics on `feeds` over the plain graph `plain`, asked for by the quantized graph's MatMul
    names (`fused`: the fused graph's, mapped by export/sensitivity.py). Returns (statistics, by_name).
    `shared`: kept on disk in `dst`'s parent (the build's work folder) under their key and loaded from there
    when an earlier engine of the build collected them (`StoredStatistics`)."""
    from export import hessians
    from export.hessians import Hessians, LayerHessians, statistics_bytes
    from export.onnx_weights import GraphWeights, untie_lm_head, weight_matmuls
    from export.sensitivity import target_name

    need = statistics_bytes(plain)

    def collect():
        hess = None
        if need > hessians.ONE_PASS_BYTES:  # more than one pass of the whole graph: block by block
            try:
                hess = LayerHessians(hf_dir, plain, feeds)
            except (ValueError, TypeError, RuntimeError) as e:  # names that do not map, blocks that cannot run alone
                log.warning("GPTQ statistics block by block are not possible here (%s): passes of the whole graph", e)
        return hess or Hessians(plain, dst, feeds)

    hess = None
    if shared:
        folder = _shared_folder(statistics_key(plain, feeds), dst, need)
        if folder is not None:
            gw = GraphWeights(plain)
            untie_lm_head(gw)
            input_of = {n.name: n.input[0] for n in weight_matmuls(gw.model)}
            del gw
            rows = sum(int(np.prod(f["input_ids"].shape)) for f in feeds)
            if not rows:
                raise ValueError("GPTQ needs calibration text: no tokens were given")
            hess = StoredStatistics(folder, collect, input_of, rows)
    hess = hess or collect()
    plain_of = {target_name(p, fused): p for p in hess.input_of}

    def by_name(name: str) -> np.ndarray:
        if name in hess.input_of:
            return hess(name)
        if name not in plain_of:
            raise RecipeError(f"gptq: no plain-graph MatMul maps to {name} (export/sensitivity.py FUSED)")
        return hess(plain_of[name])

    return hess, by_name
