"""What a user sees from `edge-export build`: stage lines and a summary, not library noise; and a failure
is one error naming the stage, what to do and its log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import ROOT, run_cli

# a progress line written to a non-terminal: "[stage] what: n/total units (p%), rate, ~time left"
PROGRESS = re.compile(r"^\[(?P<stage>[\w-]+)\] (?P<what>[^:]+): (?P<n>\d+)/(?P<total>\d+) \w+ \((?P<pct>\d+)%\)")

# A stage that counts 50 texts with tqdm, as the evaluate stage does, run as the build runs it (export.stages)
STAGE = """
import sys, time
from pathlib import Path
from tqdm import tqdm
from export.stages import run_stage

def fn(dst):
    print("library noise")
    for _ in tqdm(range(50), desc="held-out chats", unit="text"):
        time.sleep(0.03)
    return {}

run_stage(Path(sys.argv[1]), "evaluate", {}, fn, quiet="-q" in sys.argv)
"""


def _stage_through_a_pipe(tmp_path, *flags: str) -> str:
    r = subprocess.run([sys.executable, "-c", STAGE, str(tmp_path), *flags], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout
    return r.stdout


def test_the_build_prints_few_lines_and_logs_the_rest(tiny_model_dir, tmp_path):
    out = tmp_path / "quiet.bundle"
    recipe = tmp_path / "r.toml"
    recipe.write_text('[build]\nprecisions = ["int8-dynamic", "int8-qdq", "int4-weight"]\nmax_context = 256\n'
                      "[quantize]\ncalibration_samples = 2\n[evaluate]\neval_samples = 2\n")
    r = run_cli("export.cli", "build", str(tiny_model_dir), "-o", str(out), "--recipe", str(recipe), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    progress = [ln for ln in lines if PROGRESS.match(ln)]
    assert len(lines) - len(progress) <= 40, "\n".join(lines)
    text = "\n".join(lines)
    # through a pipe, the evaluate stage's texts as plain lines (at most one per tenth of each count), ending at 100%
    ev = [PROGRESS.match(ln) for ln in progress if ln.startswith("[evaluate] ")]
    # one count per engine ("held-out texts (int8-dynamic)"): no colon inside, or the line is not a progress line
    assert any(m["what"].startswith("held-out texts (") and m["pct"] == "100" for m in ev), text
    assert any(m["what"].startswith("speed + golden prompts (") and m["n"] == m["total"] for m in ev), text
    assert all("\r" not in ln and "\033" not in ln for ln in lines)
    for noise in ("Warning", "WARNING", "[INFO]", "TracerWarning", "matmul_nbits_quantizer", "Traceback",
                  "pre-processing before quantization", "it/s]"):
        assert noise not in text, f"{noise!r} reached the terminal:\n{text}"
    for stage in ("load", "export", "quantize-int8-dynamic", "quantize-int8-qdq", "quantize-int4-weight", "evaluate"):
        assert f"[{stage}] done in" in text
    assert "peak memory" in text and "decode tok/s" in text  # the summary tables
    logs = {p.parent.name: p.read_text() for p in (tmp_path / "quiet.bundle.work").glob("*/log.txt")}
    # every stage has its log, where the libraries' output goes (the export writes Llama op by op since 2026-12-07:
    # no tracer warnings to find there any more)
    assert {"load", "export", "quantize-int8-dynamic", "quantize-int8-qdq", "quantize-int4-weight", "evaluate"} <= set(logs)
    shipped = {e["name"] for e in json.loads((out / "manifest.json").read_text())["engines"]}
    assert shipped == {"int8-dynamic", "int8-qdq", "int4-weight"}  # no fp32 graph unless asked for


def test_a_failing_stage_is_one_error_with_its_log(tmp_path):
    # a model folder whose weights cannot be read: the load stage fails inside transformers
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                                 "intermediate_size": 128, "vocab_size": 400}))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    r = run_cli("export.cli", "build", str(bad), "-o", str(tmp_path / "b.bundle"), timeout=300)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr, r.stderr
    assert "stage 'load' failed" in r.stderr and "what to do:" in r.stderr and "log: " in r.stderr
    log = r.stderr.split("log: ")[1].split()[0]
    assert "Traceback" in open(log).read() or "Error" in open(log).read()


def test_a_stage_through_a_pipe_writes_a_line_per_tenth(tmp_path):
    """Not a terminal (CI, a pipe): no redrawn bar, a plain line each time the count passes a tenth of its total."""
    out = _stage_through_a_pipe(tmp_path)
    lines = out.splitlines()
    assert lines[0] == "[evaluate] running ..."
    pcts = [int(m["pct"]) for m in map(PROGRESS.match, lines) if m]
    assert 5 <= len(pcts) <= 10 and pcts == sorted(set(pcts)) and pcts[-1] == 100, out
    assert len({p // 10 for p in pcts}) == len(pcts)  # one line per tenth
    assert "texts/s" in out and "left" in out and "\r" not in out and "\033[" not in out
    assert "library noise" not in out and "library noise" in (tmp_path / "evaluate" / "log.txt").read_text()
    assert "[evaluate] done in" in out


def test_quiet_shows_no_progress(tmp_path):
    out = _stage_through_a_pipe(tmp_path, "-q")
    assert not any(PROGRESS.match(ln) for ln in out.splitlines()) and "running" not in out, out
    assert "[evaluate] done in" in out


def test_a_terminal_gets_one_redrawn_line(tmp_path):
    """On a terminal (a pty here) the stage's line is redrawn in place: carriage return, clear, the new text."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: the stage with its stdout/stderr on the pty
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-c", STAGE, str(tmp_path)])
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        out += chunk
    assert os.waitpid(pid, 0)[1] == 0, out
    text = out.decode()
    redraws = re.findall(r"\r\x1b\[K\[evaluate\] held-out chats: (\d+)/50 texts \(\d+%\)[^\r\n]*\[[\d.]+ s\]", text)
    assert len(redraws) >= 2 and len(set(redraws)) >= 2, text
    assert "\n[evaluate] held-out chats" not in text  # redrawn, never a line of its own
    assert "[evaluate] done in" in text and "library noise" not in text


def test_the_cli_quiet_flag(tiny_model_dir, tmp_path):
    """`edge-export build -q`: each stage's result and the summary, no progress lines; -q with -v is refused."""
    out = tmp_path / "q.bundle"
    r = run_cli("export.cli", "build", str(tiny_model_dir), "-o", str(out), "--precision", "int8-dynamic",
                "--max-context", "128", "--eval-samples", "2", "--int8-rounding", "minmax", "-q", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert "[evaluate] done in" in text and "decode tok/s" in text
    assert "running ..." not in text and not any(PROGRESS.match(ln) for ln in text.splitlines()), text
    r = run_cli("export.cli", "build", "-o", str(tmp_path / "x.bundle"), "-q", "-v")
    assert r.returncode == 2 and "not allowed with" in r.stderr
