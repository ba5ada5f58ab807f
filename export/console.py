"""What a build shows on the terminal: one line per stage, a summary at the end; the rest goes to logs.

torch, transformers, optimum and ONNX Runtime write warnings, INFO lines and progress bars to the
process's stdout/stderr, some of them from C++ straight to file descriptors 1 and 2. While a stage
runs, `captured` points both descriptors (and so Python's sys.stdout/stderr, logging and warnings,
which write through them) at the stage's `log.txt`; the terminal keeps a private copy of the original stderr for the
stage's progress line. `verbose` turns capturing off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, TextIO


class Terminal:
    """Writes to the real terminal even while fds 1/2 point at a log file."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def line(self, text: str) -> None:
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def status(self, text: str) -> None:
        """A line that the next status or line replaces (only on a TTY)."""
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()


@contextlib.contextmanager
def captured(log_path: Path, verbose: bool = False) -> Iterator[TextIO]:
    """Send everything written to fds 1/2 (and logging/warnings) to `log_path`; yield the terminal stream."""
    if verbose:
        yield sys.stderr
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr):
        s.flush()
    with open(log_path, "a", buffering=1) as log:  # opened first: nothing to undo if it cannot be
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        term = os.fdopen(os.dup(saved[2]), "w", buffering=1)
        root = logging.getLogger()
        old_handlers, old_level = root.handlers[:], root.level
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            root.handlers = [handler]
            root.setLevel(logging.INFO)
            yield term
        finally:
            for s in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    s.flush()
            root.handlers, root.level = old_handlers, old_level
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            term.close()


class Progress:
    """`with Progress(term, "export"):` keeps one line updated with the stage's elapsed time."""

    def __init__(self, term: Terminal, label: str) -> None:
        self.term, self.label = term, label
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        if self.term.tty:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            self.term.line(f"{self.label} ...")
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.term.status(f"{self.label} ... {fmt_seconds(time.perf_counter() - self.t0)}")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
            self.term.status("")  # clear the line, so what follows starts on a clean one


def fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)
