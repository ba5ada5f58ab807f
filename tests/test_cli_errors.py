"""Every subcommand of both CLIs, given bad input, exits 2 with one line that says what is wrong.

The subcommands and their flags are read from the argparse parsers, so a new subcommand or a new numeric
flag is covered without touching this file (a new required argument needs a valid value in `_valid`).
Each case runs the CLI as a real subprocess.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT
from edge.cli import Bounded
from edge.cli import make_parser as edge_parser
from export.cli import make_parser as export_parser

TIMEOUT = 45  # s; a refusal takes under 5
CLIS = {"export.cli": export_parser(), "edge.cli": edge_parser()}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


SUBCOMMANDS = [(cli, name) for cli, p in CLIS.items() for name in _subcommands(p)]


def _args(cli: str, name: str) -> tuple[list[argparse.Action], list[argparse.Action]]:
    """(positionals, options) of a subcommand, help left out."""
    acts = [a for a in _subcommands(CLIS[cli])[name]._actions if not isinstance(a, argparse._HelpAction)]
    return [a for a in acts if not a.option_strings], [a for a in acts if a.option_strings]


def _numeric(a: argparse.Action) -> bool:
    return a.type in (int, float) or isinstance(a.type, Bounded)


def _valid(dest: str, tiny_bundle, tiny_model_dir, tmp_path) -> str:
    """A value that is fine for an argument a subcommand requires, so only the flag under test is bad."""
    return {"bundle": str(tiny_bundle.root), "model": str(tiny_model_dir), "prompt": "Hello",
            "host": "nobody@127.0.0.1", "target": "t4", "output": str(tmp_path / "out.bundle")}[dest]


# build-engine first asks which device this is (refused here, a machine without a GPU, before the bundle is
# opened); name the profile so the missing bundle is what gets refused
AVOID_OTHER_REFUSALS = {"build-engine": ["--profile", "t4"]}


def _required(cli: str, name: str, value) -> list[str]:
    pos, opts = _args(cli, name)
    argv = [value(a.dest) for a in pos if a.nargs != "?"]
    for a in opts:
        if a.required:
            argv += [a.option_strings[-1], value(a.dest)]
    return argv


def _run(cli: str, argv: list[str]) -> subprocess.CompletedProcess:
    try:  # stdin empty: a REPL that started on a bad value reads EOF and exits 0 instead of waiting
        return subprocess.run([sys.executable, "-m", cli, *argv], input="", capture_output=True, text=True,
                              timeout=TIMEOUT, cwd=ROOT)
    except subprocess.TimeoutExpired:  # e.g. a server that started on a bad value instead of refusing it
        return subprocess.CompletedProcess(argv, -1, "", f"timed out after {TIMEOUT} s: the bad value was not refused")


def _refusal_problem(r: subprocess.CompletedProcess, *names: str) -> str | None:
    """None if `r` is a clean refusal (exit 2, no traceback, one line naming one of `names`), else what is wrong."""
    lines = r.stderr.strip().splitlines()
    if r.returncode != 2 or "Traceback" in r.stderr or len(lines) != 1 or "error:" not in lines[0]:
        return f"exit {r.returncode}, stderr: {r.stderr.strip()[-1200:] or '(empty)'}"
    if names and not any(n in lines[0] for n in names):
        return f"the message does not name {' or '.join(names)}: {lines[0]}"
    return None


def _assert_refused(r: subprocess.CompletedProcess, what: str, *names: str) -> None:
    problem = _refusal_problem(r, *names)
    assert problem is None, f"{what}: {problem}"


def test_parsers_list_the_subcommands_people_use():
    """The lists the other tests walk are the real ones (a broken walk would make them vacuous)."""
    names = {n for _, n in SUBCOMMANDS}
    assert {"plan", "build", "engines", "deploy", "run", "repl", "serve", "build-engine", "golden", "info"} <= names
    numeric = [a.option_strings[-1] for cli, n in SUBCOMMANDS for a in _args(cli, n)[1] if _numeric(a)]
    assert "--context" in numeric and "--max-users" in numeric and "--keep" in numeric


@pytest.mark.parametrize("cli", CLIS)
def test_no_subcommand(cli):
    _assert_refused(_run(cli, []), f"{cli} with no arguments")


@pytest.mark.parametrize("cli, name", SUBCOMMANDS)
def test_no_arguments(cli, name):
    _assert_refused(_run(cli, [name]), f"{cli} {name}")


@pytest.mark.parametrize("cli, name", SUBCOMMANDS)
def test_missing_paths(cli, name, tmp_path):
    """Every positional and required option names something that does not exist; the message names it."""
    missing = tmp_path / "missing"
    argv = _required(cli, name, lambda dest: str(missing / dest))
    pos, _ = _args(cli, name)
    argv += [str(missing / a.dest) for a in pos if a.nargs == "?"]
    argv += AVOID_OTHER_REFUSALS.get(name, [])
    _assert_refused(_run(cli, [name, *argv]), f"{cli} {name} {argv}", str(missing))


@pytest.mark.parametrize("cli, name", SUBCOMMANDS)
def test_bad_flag_values(cli, name, tiny_bundle, tiny_model_dir, tmp_path):
    """-1 for every numeric flag and an unknown word for every flag with choices, the rest valid: each is
    refused before any work starts, in one line naming the flag (or its recipe key)."""
    def base(case: str) -> list[str]:  # each case its own output folder, should one start a build
        valid = lambda d: _valid(d, tiny_bundle, tiny_model_dir, tmp_path / case)  # noqa: E731
        return [name, *_required(cli, name, valid), *(valid(a.dest) for a in _args(cli, name)[0] if a.nargs == "?")]

    cases = []
    for a in _args(cli, name)[1]:
        flag = a.option_strings[-1]
        if _numeric(a):
            cases.append((a, [*base(a.dest), flag, "-1"]))
        elif a.choices:
            cases.append((a, [*base(a.dest), flag, "nope"]))
    if not cases:
        pytest.skip(f"{name} has no numeric or choice flags")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: _run(cli, c[1]), cases))
    problems = [f"{' '.join(argv[-2:])}: {p}" for (a, argv), r in zip(cases, results)
                if (p := _refusal_problem(r, a.option_strings[-1], a.dest))]
    assert not problems, f"{cli} {' '.join(cases[0][1][:-2])} ...\n" + "\n".join(problems)


def test_unwritable_output_is_one_line(tiny_model_dir, tmp_path):
    """An OSError the user can act on (here: the bundle's folder would be inside a file) is one line, exit 2."""
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "x.bundle"
    _assert_refused(_run("export.cli", ["build", str(tiny_model_dir), "-o", str(out)]), "build -o under a file",
                    str(out))


@pytest.mark.parametrize("cli", CLIS)
def test_help_documents_exit_codes(cli):
    r = _run(cli, ["--help"])
    assert r.returncode == 0
    assert "exit codes" in r.stdout and "2 " in r.stdout


def test_a_failing_step_in_the_cli_is_one_line_not_a_traceback(tiny_bundle, monkeypatch, caplog, capsys):
    """edge/errors.py: the CLIs turn an EdgeChatError into one line on stderr. Before issue 24 a decode error in
    `edge-chat run` was raised as it was; the one loop must not also log its traceback (at ERROR, which the CLI
    prints) when the caller gets the error raised."""
    import logging

    from edge.cli import main
    from edge.errors import BundleError
    from edge.backends.onnxruntime import OrtDecoder

    calls = {"n": 0}
    real = OrtDecoder.run

    def failing(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise BundleError("'input_ids' is outside the engine's shape profile; rebuild the engine")
        return real(self, *a, **kw)

    monkeypatch.setattr(OrtDecoder, "run", failing)
    caplog.set_level(logging.WARNING, logger="edgechat")
    rc = main(["run", str(tiny_bundle.root), "Hello!", "--engine", "fp32", "--threads", "1", "--max-new-tokens", "8",
               "--temperature", "0"])
    assert rc == 2 and "rebuild the engine" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING], \
        [r.getMessage() for r in caplog.records]
