"""Stage bookkeeping: every stage is `fn(dst: Path) -> metrics` run into its own folder.

A finished stage leaves `WORK/<name>/stage.json` (params, seconds, tool versions,
metrics). Re-running with the same params reuses it, so an interrupted build
resumes; a stage is written into a hidden partial folder and renamed when done,
so a half-run stage is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

from edge.bundle import StageRecord

TOOLS = ("edgechat", "torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt")


def tool_versions(names: tuple[str, ...] = TOOLS) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_stage(work: Path, name: str, params: dict, fn: Callable[[Path], dict], fresh: bool = False,
              log: Callable[[str], None] = print) -> tuple[Path, StageRecord]:
    out = work / name
    rec_path = out / "stage.json"
    if not fresh and rec_path.is_file():
        rec = json.loads(rec_path.read_text())
        if rec.get("params") == _jsonable(params):
            log(f"[{name}] done earlier ({rec['seconds']:.0f}s), reusing {out}")
            return out, StageRecord(**rec)
    tmp = work / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log(f"[{name}] running ...")
    t0 = time.perf_counter()
    metrics = fn(tmp) or {}
    rec = StageRecord(name=name, params=_jsonable(params), seconds=round(time.perf_counter() - t0, 2),
                      tool_versions=tool_versions(), metrics=_jsonable(metrics),
                      finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (tmp / "stage.json").write_text(json.dumps(rec.__dict__, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"[{name}] finished in {rec.seconds:.1f}s")
    return out, rec


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))
