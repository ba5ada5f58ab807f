"""scripts/resolve_device_requirements.py against the real registry: a real target's pins resolve for its
platform and Python with pip's dry run, and a pin that does not exist (onnxruntime-gpu 1.32.0, issue #38)
fails it. Needs the package index; skipped, saying so, only when pip reaches none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "resolve_device_requirements.py"
sys.path.insert(0, str(ROOT / "scripts"))

import resolve_device_requirements as rdr  # noqa: E402


@pytest.fixture(scope="module")
def index():
    if not rdr.index_reachable(rdr.INDEX):
        pytest.skip(f"pip cannot reach {rdr.INDEX} (no network to the package index)")
    return rdr.INDEX


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_jetpack6_resolves_for_aarch64_python310(index, tmp_path):
    out = tmp_path / "r.json"
    r = _run("--only", "jetpack6", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    [res] = json.loads(out.read_text())
    assert (res["python"], res["platform"]) == ("3.10", "manylinux_2_35_aarch64")
    assert res["versions"]["cuda-python"].startswith("12.6.")  # not 13.x, which JetPack 6's driver refuses
    assert "onnxruntime" not in res["versions"]  # PyPI has none for JetPack 6: never requested
    assert "jetpack6    py3.10  manylinux_2_35_aarch64   ok" in r.stdout


def test_a_pin_that_does_not_exist_fails(index, tmp_path):
    src = (ROOT / "device_profiles/runtimes/targets.toml").read_text()
    bad = tmp_path / "targets.toml"
    bad.write_text(src.replace("onnxruntime-gpu==1.26.0; python_version >= '3.11'", "onnxruntime-gpu==1.32.0; python_version >= '3.11'"))
    r = _run("--targets", str(bad), "--only", "x86-cuda12")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "x86-cuda12  py3.11  manylinux_2_28_x86_64    FAILED" in r.stdout and "onnxruntime-gpu==1.32.0" in r.stdout
    assert "x86-cuda12  py3.10  manylinux_2_28_x86_64    ok" in r.stdout  # 3.10 keeps its own pin (1.23.2)
    assert "do not resolve" in r.stderr
