"""Stage bookkeeping: every stage is `fn(dst: Path) -> metrics` run into its own folder.

A finished stage leaves `WORK/<name>/stage.json` (params, seconds, tool versions,
metrics, and a fingerprint of the edgechat source it ran). Re-running with the same
params and unchanged source reuses it, so an interrupted build resumes; a stage is written into a hidden partial folder and renamed when done,
so a half-run stage is never mistaken for a finished one.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import json
import shutil
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator

from edge.bundle import StageRecord
from edge.errors import EdgeChatError
from export.console import Progress, Terminal, captured, fmt_bytes, fmt_seconds
from export.memory import PeakRSS

OWN_PACKAGES = ("edge", "export")
TOOLS = ("edgechat", "torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt")


def tool_versions(names: tuple[str, ...] = TOOLS) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


CODE_KEY = "edgechat-code"  # in a stage's tool_versions: the fingerprint of the source that ran it


def _module_file(name: str) -> Path | None:
    """The source file of an edge/export module, found on disk (nothing is imported)."""
    spec = importlib.util.find_spec(name.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*name.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(tree: ast.AST, package: str, packages: tuple[str, ...]) -> set[str]:
    """edge.* / export.* modules a module imports (function-level imports too: stages import lazily)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from .x import y`
                base = ".".join(package.split(".")[: max(0, package.count(".") + 2 - node.level)])
                mod = ".".join(p for p in (base, node.module) if p)
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from export import load`: maybe a module
    return {m for m in found if m.split(".")[0] in packages}


@functools.lru_cache(maxsize=None)
def code_fingerprint(module: str, packages: tuple[str, ...] = OWN_PACKAGES) -> str:
    """SHA-256 (16 hex) over the source of `module` and every edge/export module it imports, transitively.

    Why: stage reuse keyed on params alone kept outputs an older edgechat wrote (a graph without an
    input the new runtime binds) after an upgrade; this key changes exactly when code the stage runs does."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue  # `from export import X` where X is not a module
        seen[name] = path
        todo.extend(_imports(ast.parse(path.read_bytes()), name.rpartition(".")[0], packages) - set(seen))
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + seen[name].read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_stage(work: Path, name: str, params: dict, fn: Callable[[Path], dict], fresh: bool = False,
              log: Callable[[str], None] = print, code: str | None = None,
              reuse_stale: bool = False, verbose: bool = False, quiet: bool = False) -> tuple[Path, StageRecord]:
    """Run `fn` into WORK/name, or reuse a finished run with the same params and (when `code` names the
    stage's module) the same source fingerprint; `reuse_stale` accepts a different fingerprint.

    Third-party output goes to WORK/name/log.txt (all of it on the terminal with `verbose`), the stage's
    progress to the terminal (none with `quiet`: export.console.Progress); the stage's peak resident memory is measured and recorded. Any failure becomes a StageError naming the stage,
    the problem, what to do and the log."""
    out = work / name
    rec_path = out / "stage.json"
    now = code_fingerprint(code) if code else None
    if not fresh and rec_path.is_file():
        rec = json.loads(rec_path.read_text())
        if rec.get("params") == _jsonable(params):
            then = rec.get("tool_versions", {}).get(CODE_KEY)
            if now is None or then == now or reuse_stale:
                stale = " (other edgechat code ran it: --reuse-stale)" if now is not None and then != now else ""
                log(f"[{name}] done earlier ({rec['seconds']:.0f}s), reusing {out}{stale}")
                return out, StageRecord(**rec)
            log(f"[{name}] finished earlier, but the edgechat code it runs has changed since "
                f"({then or 'not recorded'} -> {now}): running it again (--reuse-stale keeps it)")
    tmp = work / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    with guarded(name, tmp / LOG, verbose, quiet=quiet) as mem:
        metrics = fn(tmp) or {}
    rec = StageRecord(name=name, params=_jsonable(params), seconds=round(time.perf_counter() - t0, 2),
                      tool_versions=tool_versions() | ({CODE_KEY: now} if now else {}), metrics=_jsonable(metrics),
                      finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), memory=mem.to_dict())
    (tmp / "stage.json").write_text(json.dumps(rec.__dict__, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"[{name}] done in {fmt_seconds(rec.seconds)}, peak memory {fmt_bytes(mem.peak_bytes)}")
    return out, rec


LOG = "log.txt"  # a stage's captured third-party output, inside its folder


@contextlib.contextmanager
def guarded(name: str, log_path: Path, verbose: bool = False, progress: bool = True,
            quiet: bool = False) -> Iterator[PeakRSS]:
    """Run a build step with its output in `log_path`, its progress on the terminal (`progress`, unless
    `quiet`; with `verbose` the stage line alone, the libraries' own bars being on the terminal), its peak
    memory measured (the yielded PeakRSS), and any failure turned into one StageError (the traceback of an
    unexpected one goes to the log only)."""
    mode = "off" if quiet or not progress else "plain" if verbose else "auto"
    with PeakRSS() as mem, captured(log_path, verbose) as stream:
        with Progress(Terminal(stream), f"[{name}]", mode):
            try:
                yield mem
            except KeyboardInterrupt:
                raise
            except EdgeChatError as e:
                raise StageError(name, str(e), log_path) from None
            except Exception as e:  # a bug or a third-party failure
                traceback.print_exc()
                raise StageError(name, f"{type(e).__name__}: {e}", log_path, unexpected=True) from None


class StageError(EdgeChatError):
    """A build stage failed: which stage, the problem in one paragraph, what to do, and its log."""

    def __init__(self, stage: str, problem: str, log_path: Path, unexpected: bool = False) -> None:
        self.stage, self.log_path = stage, log_path
        problem = " ".join(problem.split())  # one paragraph
        todo = ("this looks like a bug or a problem in a library: the traceback is in the log; run again with -v "
                "to see all output, and report it with the log" if unexpected else
                "fix what the message names and run the same command again (finished stages are reused)")
        super().__init__(f"stage '{stage}' failed: {problem}\n  what to do: {todo}\n  log: {log_path}")


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))
