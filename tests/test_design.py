"""The architecture's rules, checked on the source (docs/design.md): no import circles (not even for a type
checker), `edge` free of the export side, edge/ in four floors that import only downward, backends that do
not know each other, precision names only from their table, and a design page that names only real files."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edge", "export")
# edge/'s floors, lowest first: a module imports its own floor, the floors below it, and the contract
FLOORS = ("device", "backends", "decode", "serve")
CONTRACT = {"edge", "edge.bundle", "edge.io_contract", "edge.precisions", "edge.errors", "edge.args"}
CLI = {"edge.cli", "edge.engine_command"}  # the commands: above every floor


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(test: ast.expr) -> bool | None:
    """True for `if TYPE_CHECKING:` (its body runs only under a type checker), False for `if not TYPE_CHECKING:`
    (its else branch does), None for any other test."""
    names = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    if ast.unparse(test) in names:
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and ast.unparse(test.operand) in names:
        return False
    return None


def _names(node: ast.stmt, mod: str, is_package: bool) -> set[str]:
    """Modules an import statement in module `mod` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parts = mod.split(".") if is_package else mod.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(p for p in [*parts, node.module or ""] if p)
    out = {base} if base else set()
    out.update(f"{base}.{a.name}" if base else a.name for a in node.names)
    return out


def _outside_functions(tree: ast.AST):
    """Every node that runs when the module is imported: module level, `try`/`if` blocks and class bodies
    included, function bodies not."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _runtime_imports(path: Path, top_level_only: bool = False, type_only: bool = False) -> set[str]:
    """Modules `path` imports when it runs: module level and inside functions (unless `top_level_only`),
    relative imports resolved; what only a type checker reads (`if TYPE_CHECKING:`) too when `type_only`."""
    tree = ast.parse(path.read_text(), str(path))
    mod, is_package = _module(path), path.name == "__init__.py"
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_only and isinstance(node, ast.If) and (kind := _type_only(node.test)) is not None:
            skip.update(id(n) for b in (node.body if kind else node.orelse) for n in ast.walk(b))
    nodes = _outside_functions(tree) if top_level_only else ast.walk(tree)
    out: set[str] = set()
    for node in nodes:
        if id(node) not in skip:
            out |= _names(node, mod, is_package)
    return out


def _graph(top_level_only: bool, type_only: bool = False, folders: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = {_module(p): p for pkg in folders for p in (ROOT / pkg).rglob("*.py")}

    def resolve(n: str) -> str:  # scripts import their siblings by bare name (`from bench_serve import ...`)
        return n if n in files or "scripts" not in folders else f"scripts.{n}"

    return {mod: {m for n in _runtime_imports(path, top_level_only, type_only) if (m := resolve(n)) in files
                  and m != mod} for mod, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-lazy-imports"])
def test_no_import_circle(top_level_only):
    """Not even through an import inside a function: a circle there is a layering mistake waiting to fail."""
    cycle = _cycle(_graph(top_level_only))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("folders", [PACKAGES, ("scripts",)], ids=["edge+export", "scripts"])
def test_no_import_circle_even_for_the_type_checker(folders):
    """`if TYPE_CHECKING:` imports count too: a type-only circle is two modules that each need the other."""
    cycle = _cycle(_graph(False, type_only=True, folders=folders))
    assert cycle is None, "import circle (type-only imports counted): " + " -> ".join(cycle)


def _floor(mod: str) -> int | None:
    parts = mod.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def test_edge_is_four_floors_that_import_only_downward():
    """edge/ holds the contract (bundle, I/O contract, precisions, errors), the CLI, and four folders, lowest
    first: device/ (this machine), backends/ (decoders and the choice between them), decode/ (the loop, caches,
    sampling, tokenizer), serve/ (HTTP, page, API shapes). A module imports only its floor and those below."""
    edge = ROOT / "edge"
    top = {_module(p) for p in edge.glob("*.py")}
    assert top <= CONTRACT | CLI, f"modules at edge/'s top level outside the contract and the CLI: {top - CONTRACT - CLI}"
    assert {p.name for p in edge.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FLOORS)
    modules = {_module(p) for p in edge.rglob("*.py")}
    bad = []
    for path in edge.rglob("*.py"):
        mod = _module(path)
        here = _floor(mod)
        for n in _runtime_imports(path, type_only=True):
            n = n if n in modules else n.rsplit(".", 1)[0]  # `from edge.x import Name` names edge.x.Name too
            if n not in modules or n in CONTRACT or n == mod:
                continue
            if mod in CONTRACT and n not in CONTRACT:
                bad.append(f"{mod} (contract) imports {n}")
            elif here is not None and n not in CLI and (f := _floor(n)) is not None and f > here:
                bad.append(f"{mod} ({FLOORS[here]}) imports {n} ({FLOORS[f]})")
            elif here is not None and n in CLI:
                bad.append(f"{mod} imports the CLI {n}")
    assert not bad, "imports that go up a floor:\n" + "\n".join(sorted(bad))


def test_edge_imports_nothing_of_the_export_side():
    heavy = ("export", "torch", "transformers", "optimum", "onnx", "datasets")
    for path in (ROOT / "edge").rglob("*.py"):
        bad = sorted(n for n in _runtime_imports(path) if n.split(".")[0] in heavy)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: edge must run without the export side"


def test_backends_do_not_import_each_other():
    backends = {"edge.backends.onnxruntime", "edge.backends.tensorrt.runtime"}
    for mod in backends:
        path = ROOT / (mod.replace(".", "/") + ".py")
        other = {n for n in _runtime_imports(path) if any(n == b or n.startswith(b + ".") for b in backends - {mod})}
        assert not other, f"{mod} imports {other}: only edge.backends.choose knows every backend"
    users = [p for p in (ROOT / "edge").rglob("*.py") if _module(p) not in backends | {"edge.backends.choose"}]
    for p in users:  # the loop and the caches reach a backend only through the Decoder interface
        if _module(p) in ("edge.backends.tensorrt.builder", "edge.engine_command"):
            continue  # the builder loads the engine it just built to re-ask the golden prompts
        direct = {n for n in _runtime_imports(p) if n in backends or n.startswith("edge.backends.tensorrt.runtime")}
        assert not direct, f"{_module(p)} imports backend {direct}"


def test_precision_names_come_from_the_table():
    """Code names a precision through edge.precisions (its constants or its table), never as a bare string,
    so adding or reordering one is one edit. Docstrings and comments may say the names; a string that only
    looks like one (a CPU flag named bf16) carries `# noqa: precision` on its line."""
    from edge import precisions

    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path == ROOT / "edge" / "precisions.py":
                continue
            text = path.read_text()
            exempt = {i + 1 for i, line in enumerate(text.splitlines()) if "noqa: precision" in line}
            tree = ast.parse(text)
            docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                          if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                        and node.value in precisions.NAMES and node.lineno not in exempt:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, "precision names as literals (use edge.precisions):\n" + "\n".join(offenders)


def test_design_page_names_only_files_that_exist():
    """Every path docs/design.md names (in backticks or links) is a file or folder of this checkout."""
    import re

    text = (ROOT / "docs" / "design.md").read_text()
    named = set(re.findall(r"`((?:edge|export|scripts|tests|docs|device_profiles|recipes)/[\w./*-]*)`", text))
    named |= set(re.findall(r"\]\(((?:\.\./)?[\w./-]+\.(?:md|py|toml))\)", text))
    missing = []
    for name in sorted(named):
        rel = name.replace("../", "")
        path = (ROOT / "docs" / name) if name.endswith(".md") and "/" not in name else ROOT / rel
        if "*" in rel:
            if not list(ROOT.glob(rel)):
                missing.append(name)
        elif not path.exists():
            missing.append(name)
    assert len(named) > 20, f"docs/design.md names only {len(named)} paths: is the pattern right?"
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


def test_messages_become_a_prompt_in_one_place():
    """The CLI's chat, the page and the API write a conversation (tools included) into prompt ids through
    edge/decode/conversation.py alone: no other module of edge/ calls the template or the tool format."""
    callers = []
    for path in (ROOT / "edge").rglob("*.py"):
        if _module(path) in ("edge.decode.conversation", "edge.decode.tokenizer", "edge.decode.tools"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("encode_chat", "prompt_messages"):
                callers.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not callers, "conversation -> prompt outside edge/decode/conversation.py:\n" + "\n".join(callers)


def test_openai_answer_shapes_are_written_in_one_place():
    """The envelope (system_fingerprint), the object kinds and the finish-reason mapping of OpenAI answers are
    written in edge/serve/openai_writer.py alone, for whole and streamed answers."""
    # a dict keyed "cancelled": the loop's finish -> OpenAI's finish_reason mapping
    found = _shape_marks("openai_writer.py", ("system_fingerprint", "chat.completion", "text_completion"), "cancelled")
    assert not found, "OpenAI answer shapes written outside edge/serve/openai_writer.py:\n" + "\n".join(found)


def _shape_marks(skip: str, marks: tuple[str, ...], dict_key: str, dict_value: str | None = None) -> list[str]:
    """Places outside edge/serve/`skip` that write one of `marks` (docstrings aside) or a dict literal keyed
    `dict_key` (with the value `dict_value` when given)."""
    found = []
    for path in (ROOT / "edge").rglob("*.py"):
        if path.name == skip:
            continue
        tree = ast.parse(path.read_text())
        doc = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef,
               ast.AsyncFunctionDef, ast.ClassDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in marks and id(node) not in doc:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == dict_key and
                    (dict_value is None or isinstance(v, ast.Constant) and v.value == dict_value)
                    for k, v in zip(node.keys, node.values)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} a dict keyed {dict_key!r}")
    return found


def test_anthropic_answer_shapes_are_written_in_one_place():
    """Anthropic's message envelope, its stream's event names, its stop reasons and its error object
    ({"type": "error", ...}) are written in edge/serve/anthropic_writer.py alone, whole, streamed and errors."""
    marks = ("message_start", "message_delta", "message_stop", "content_block_start", "content_block_delta",
             "content_block_stop", "text_delta", "input_json_delta", "end_turn", "overloaded_error",
             "cache_read_input_tokens")
    found = _shape_marks("anthropic_writer.py", marks, "type", "error") + \
        _shape_marks("anthropic_writer.py", (), "type", "message")
    assert not found, "Anthropic answer shapes written outside edge/serve/anthropic_writer.py:\n" + "\n".join(found)


# ----------------------------------------------------------------------------- the design checks can fail


def _plant(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("files", [
    {"edge/__init__.py": "", "edge/a.py": "def f():\n    from . import b\n", "edge/b.py": "from edge import a\n"},
    {"edge/__init__.py": "", "edge/t/__init__.py": "", "edge/t/a.py": "def f():\n    from .b import g\n",
     "edge/t/b.py": "import edge.t.a\n"},
    {"edge/__init__.py": "", "edge/a.py": "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n    import edge.b\n",
     "edge/b.py": "def f():\n    import edge.a\n"},
], ids=["relative-lazy", "relative-from-module", "not-TYPE_CHECKING"])
def test_the_circle_check_finds_a_planted_circle(tmp_path, monkeypatch, files):
    test_design = sys.modules[__name__]

    _plant(tmp_path, {"export/__init__.py": "", **files})
    monkeypatch.setattr(test_design, "ROOT", tmp_path)
    assert test_design._cycle(test_design._graph(False)) is not None


def test_the_edge_side_check_sees_a_relative_import_of_export(tmp_path, monkeypatch):
    test_design = sys.modules[__name__]

    _plant(tmp_path, {"edge/__init__.py": "", "edge/a.py": "def f():\n    from .. import export\n"})
    monkeypatch.setattr(test_design, "ROOT", tmp_path)
    assert "export" in test_design._runtime_imports(tmp_path / "edge" / "a.py")


def test_the_module_level_circle_check_sees_imports_in_try_blocks(tmp_path, monkeypatch):
    test_design = sys.modules[__name__]

    _plant(tmp_path, {"export/__init__.py": "", "edge/__init__.py": "",
                      "edge/a.py": "try:\n    import edge.b\nexcept ImportError:\n    pass\n",
                      "edge/b.py": "import edge.a\n"})
    monkeypatch.setattr(test_design, "ROOT", tmp_path)
    assert test_design._cycle(test_design._graph(True)) is not None
