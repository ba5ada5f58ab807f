"""The CLIs end to end as subprocesses, and the light side's independence from torch."""

import subprocess
import sys

from conftest import ROOT, run_cli


def test_edge_chat_run(tiny_bundle):
    r = run_cli("edge.cli", "run", str(tiny_bundle.root), "Hello!", "--max-new-tokens", "8", "--stats")
    assert r.returncode == 0, r.stderr
    assert "tokens, TTFT" in r.stderr


def test_edge_chat_repl(tiny_bundle):
    r = subprocess.run([sys.executable, "-m", "edge.cli", "repl", str(tiny_bundle.root), "--max-new-tokens", "4"],
                       input="Hello\nHow are you?\n/quit\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("bot> ") == 2


def test_edge_chat_info(tiny_bundle):
    r = run_cli("edge.cli", "info", str(tiny_bundle.root), "--verify")
    assert r.returncode == 0, r.stderr
    assert "int8-qdq" in r.stdout and "would run" in r.stdout


def test_edge_chat_bad_bundle_is_one_line(tmp_path):
    r = run_cli("edge.cli", "run", str(tmp_path / "missing.bundle"), "hi")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_flags():
    r = run_cli("edge.cli", "run", "--help")
    assert "--temperature" in r.stdout and "--stop" in r.stdout
    r = run_cli("export.cli", "build", "--help")
    assert "--precision" in r.stdout and "--recipe" in r.stdout


BLOCK = ("import sys\n"
         "class Block:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name.split('.')[0] in ('torch', 'transformers', 'export', 'optimum'):\n"
         "            raise ImportError('blocked: ' + name)\n"
         "sys.meta_path.insert(0, Block())\n")


def test_edge_runs_without_torch_transformers_or_export(tiny_bundle):
    code = BLOCK + (
        "from edge.bundle import Bundle\nfrom edge.decode.generate import Generator\nfrom edge.decode.chat import Chat\n"
        "import edge.cli, edge.device.profiles\n"
        f"g = Generator.from_bundle(Bundle.open({str(tiny_bundle.root)!r}))\n"
        "c = Chat(g)\nprint(''.join(e.text for e in c.ask('Hello', g.sampling(max_new_tokens=5))) is not None)\n"
        "assert not any(m.split('.')[0] in ('torch', 'transformers', 'export') for m in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "True" in r.stdout
