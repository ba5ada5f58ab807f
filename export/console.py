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
from dataclasses import dataclass
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
        """A line that the next status or line replaces (only on a TTY); cut to the terminal's width, since a
        line that wraps can no longer be redrawn in place."""
        if self.tty:
            try:
                width = os.get_terminal_size(self.stream.fileno()).columns or 80  # 0: a pty nobody sized
            except (OSError, ValueError, AttributeError):
                width = 80
            if len(text) >= width:
                text = text[: max(0, width - 4)] + "..."
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
    """`with Progress(term, "[export]"):` shows what a stage is doing while it runs.

    Stages count their work with tqdm (texts scored, GPTQ blocks, distillation steps), whose bars go to the
    stage's log with the rest of the libraries' output. While a Progress is active, every tqdm bar's updates
    (`_watch_tqdm`) also reach it: on a terminal one line is redrawn twice a second (the latest bar's count,
    rate, time left, and the stage's elapsed time); elsewhere (CI, a pipe, a file) a plain line is written
    when the bar passes each tenth of its total, and at least every `HEARTBEAT_S` seconds while a bar moves,
    instead of a redrawn line. `mode`: "auto" (by the stream), "live", "lines", "plain" (the stage line
    alone: -v, where the bars themselves are on the terminal) or "off" (-q).
    """

    HEARTBEAT_S = 30.0
    REDRAW_S = 0.5

    def __init__(self, term: Terminal, label: str, mode: str = "auto") -> None:
        self.term, self.label = term, label
        self.mode = ("live" if term.tty else "lines") if mode == "auto" else mode
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._bar = None  # the tqdm bar that moved last (read again at each redraw: its rate and time left move on)
        self._tenths: dict[int, int] = {}  # bar id -> tenths of its total already written ("lines")
        self._last_line = self.t0

    def __enter__(self) -> "Progress":
        if self.mode == "off":
            return self
        if self.mode != "live":
            self.term.line(f"{self.label} running ...")
        if self.mode in ("live", "lines"):
            _watch_tqdm(self)
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def bar_moved(self, bar, closed: bool = False) -> None:
        """A tqdm bar was updated (or closed): remember it; in "lines" mode write a line at each new tenth."""
        state = BarState.of(bar)
        with self._lock:
            self._bar = None if closed else bar  # a finished bar is not shown (or repeated) any more
            if self.mode != "lines" or not state.total:
                return
            tenth = min(10, int(10 * state.n / state.total))
            if tenth > self._tenths.get(id(bar), 0):
                self._tenths[id(bar)] = tenth
                self._write(state)
            if closed:
                self._tenths.pop(id(bar), None)

    def _write(self, state: "BarState") -> None:
        self._last_line = time.perf_counter()
        self.term.line(f"{self.label} {state.describe()}")

    def _run(self) -> None:
        wait = self.REDRAW_S if self.mode == "live" else 1.0
        while not self._stop.wait(wait):
            with self._lock:
                now, bar = time.perf_counter(), self._bar
                try:
                    bar = bar and BarState.of(bar)
                except Exception:  # a bar being torn down by its thread
                    bar = None
                if self.mode == "live":
                    text = f"{self.label} " + (bar.describe() + f" [{fmt_seconds(now - self.t0)}]" if bar else
                                               f"running ... {fmt_seconds(now - self.t0)}")
                    self.term.status(text)
                elif bar is not None and now - self._last_line >= self.HEARTBEAT_S:
                    self._write(bar)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        _unwatch_tqdm(self)
        if self._thread:
            self._thread.join()
        if self.mode == "live":
            self.term.status("")  # clear the line, so what follows starts on a clean one


@dataclass(frozen=True)
class BarState:
    """What a tqdm bar has counted, read once (its fields change under another thread)."""

    desc: str
    n: float
    total: float | None
    unit: str
    elapsed: float

    @classmethod
    def of(cls, bar) -> "BarState":
        elapsed = max(0.0, getattr(bar, "_time", time.time)() - bar.start_t)
        return cls(str(bar.desc or "").rstrip(": "), bar.n, bar.total, str(bar.unit), elapsed)

    def describe(self) -> str:
        """`held-out chats: 32/64 texts (50%), 2.4 s/text, ~1 min 17 s left`."""
        n = f"{self.n:g}" if isinstance(self.n, float) else str(self.n)
        units = self.unit if self.unit in ("it", "B") or self.unit.endswith("s") or not self.unit.isalpha() else self.unit + "s"
        text = (f"{self.desc}: " if self.desc else "") + (
            f"{n}/{self.total:g} {units} ({int(100 * self.n / self.total)}%)" if self.total else f"{n} {units}")
        if self.n and self.elapsed > 0:
            rate = self.n / self.elapsed
            text += f", {rate:.1f} {units}/s" if rate >= 1 else f", {1 / rate:.1f} s/{self.unit}"
            if self.total and self.n < self.total:
                text += f", ~{fmt_seconds((self.total - self.n) / rate)} left"
        return text


_watchers: list[Progress] = []  # active Progress objects (one per running stage), told of every tqdm bar's moves
_hooked = False


def _watch_tqdm(p: Progress) -> None:
    """Have every tqdm bar's update() and close() also tell `p` (tqdm's own output is untouched)."""
    global _hooked
    from tqdm import std

    if not _hooked:
        update, close = std.tqdm.update, std.tqdm.close

        def hooked_update(self, n=1):
            out = update(self, n)
            _tell(self, False)
            return out

        def hooked_close(self):
            was_open = not getattr(self, "disable", True)
            close(self)
            if was_open:
                _tell(self, True)

        std.tqdm.update, std.tqdm.close = hooked_update, hooked_close
        _hooked = True
    _watchers.append(p)


def _unwatch_tqdm(p: Progress) -> None:
    with contextlib.suppress(ValueError):
        _watchers.remove(p)


def _tell(bar, closed: bool) -> None:
    if not closed and getattr(bar, "disable", False):  # a bar its code turned off is not shown either
        return
    for p in list(_watchers):
        try:
            p.bar_moved(bar, closed)
        except Exception:  # progress display must never break the work it shows
            pass


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
