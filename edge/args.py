"""What both CLIs (edge-chat, edge-export) share: bounded number flags, one-line usage errors, exit codes."""

from __future__ import annotations

import argparse
import sys

from edge.errors import EdgeChatError


class Bounded:
    """An argparse type for a number within limits: a bad value is refused by the parser, in one line that
    names the flag, before anything is loaded (the libraries check again for their own callers)."""

    def __init__(self, kind: type, low: float | None = None, high: float | None = None, above: bool = False) -> None:
        self.kind, self.low, self.high, self.above = kind, low, high, above  # above: low itself is not allowed

    def describe(self) -> str:
        low = "" if self.low is None else f"{'>' if self.above else '>='} {self.low}"
        return f"{low} and <= {self.high}" if low and self.high is not None else low or f"<= {self.high}"

    def __call__(self, text: str) -> int | float:
        try:
            v = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if self.kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (self.low is not None and (v <= self.low if self.above else v < self.low)) or \
                (self.high is not None and v > self.high):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return v

    def __repr__(self) -> str:  # argparse names the type in some messages
        return self.kind.__name__


EXIT_CODES = ("exit codes: 0 done; 2 bad input or a failed check (one line on stderr says what to do); "
              "130 interrupted; 1 an internal error (a bug: please report the traceback)")


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit 2), like every other refusal of the CLIs."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("epilog", EXIT_CODES)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def guarded(args: argparse.Namespace) -> int:
    """Run a subcommand; a problem the user can act on becomes one line on stderr and exit code 2."""
    try:
        return args.func(args)
    except EdgeChatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be read or written, a full disk, a port in use: the user can act
        where = f": {e.filename} (check the path and its permissions)" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
