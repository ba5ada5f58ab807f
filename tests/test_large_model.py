"""Slow tier: a model past protobuf's 2 GB limit builds to every quantized engine, in bounded memory.

A random-init Llama with 2 wide layers (hidden 4096, MLP 20480, tied embedding: 588M parameters, 2.35 GB of fp32
weights) goes through `edge-export build` as a user runs it, with int8-dynamic, int8-qdq and
int4-weight; each engine then answers through `edge-chat run`. The build's peak resident memory
(the kernel's figure for the whole process) is held to a bound derived from the weights.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, make_tiny_model, run_cli

pytestmark = pytest.mark.slow

HIDDEN, INTERMEDIATE, LAYERS = 4096, 20480, 2
PRECISIONS = ("int8-dynamic", "int8-qdq", "int4-weight")


@pytest.fixture(scope="module")
def large_build(tmp_path_factory):
    src = make_tiny_model(tmp_path_factory.mktemp("large") / "wide-llama", layers=LAYERS, hidden=HIDDEN, heads=32,
                          kv_heads=8, intermediate=INTERMEDIATE, max_pos=512)
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    recipe = tmp_path_factory.mktemp("recipe") / "large.toml"
    recipe.write_text(f"[build]\nprecisions = {json.dumps(list(PRECISIONS))}\nmax_context = 256\n"
                      "[quantize]\ncalibration_samples = 4\nint4_rounding = \"minmax\"\nint8_rounding = \"minmax\"\n"
                      "qdq_float_ratio = 0\n"
                      "[evaluate]\nskip_eval = true\n")
    # CI time: the evaluate stage's memory on real models is in docs/models.md (Qwen2.5-Coder-1.5B: 12.9 GB for
    # 7.1 GB of weights). int4 and int8 round to nearest here: this test holds the streaming quantizer to its memory bound,
    # and GPTQ's statistics for this model's 20480-wide MLP input are a 3.4 GB matrix (plus its Cholesky factors),
    # which that bound does not count (docs/status.md)
    out = tmp_path_factory.mktemp("bundles") / "large.bundle"
    proc = subprocess.Popen([sys.executable, "-m", "export.cli", "build", str(src), "-o", str(out), "--recipe",
                             str(recipe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    # an independent look at the build's memory (the stage records come from the process itself; its
    # getrusage peak is reset by the per-stage measurement, so it is no check): sample RSS from outside
    peak, ps = 0, psutil.Process(proc.pid)
    deadline = time.time() + 3600
    while proc.poll() is None and time.time() < deadline:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, ps.memory_info().rss)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    output = proc.stdout.read()
    assert proc.wait() == 0, output[-5000:]
    assert "Traceback" not in output
    yield {"src": src, "bundle": out, "weights": weights, "peak": peak, "output": output}
    for d in (src.parent, out.parent):  # ~20 GB of graphs: pytest keeps its last runs' temporary folders
        shutil.rmtree(d, ignore_errors=True)


def test_the_fp32_weights_are_past_protobufs_limit(large_build):
    assert large_build["weights"] > 2.2e9


def test_every_engine_answers_through_the_cli(large_build):
    m = json.loads((large_build["bundle"] / "manifest.json").read_text())
    assert {e["name"] for e in m["engines"]} == set(PRECISIONS)  # what was asked for; no fp32 graph
    for e in m["engines"]:
        assert m["files"][e["file"]]["size"] < 2e9  # the graph file itself; weights in external data
        r = run_cli("edge.cli", "run", str(large_build["bundle"]), "What is the capital of Japan?", "--engine",
                    e["name"], "--max-new-tokens", "8", "--threads", "2", timeout=600)
        assert r.returncode == 0, f"{e['name']}: {r.stderr[-2000:]}"
        assert r.stdout.strip(), f"{e['name']} answered nothing"


def test_peak_memory_is_bounded_by_the_weights(large_build):
    """Each stage's peak is recorded; the whole build stays within 4.5x the fp32 weights (+1.5 GB for the
    interpreter, torch and ONNX Runtime themselves): no stage holds several copies of the model. The
    bound is the planner's (export ~3x, int8-qdq's calibration ~4x, measured) with some room."""
    m = json.loads((large_build["bundle"] / "manifest.json").read_text())
    w = large_build["weights"]
    stages = {s["name"]: s["memory"]["peak_rss_bytes"] for s in m["stages"]}
    assert set(stages) >= {"load", "export", *(f"quantize-{p}" for p in PRECISIONS)}
    bound = 4.5 * w + 1.5e9
    for name, peak in stages.items():
        assert peak < bound, f"{name}: peak {peak / 1e9:.2f} GB > {bound / 1e9:.2f} GB for {w / 1e9:.2f} GB of weights"
    # weight-only quantization streams one tensor at a time: far below the graph's size
    for name in ("quantize-int8-dynamic", "quantize-int4-weight"):
        assert stages[name] < 1.5 * w + 1.5e9, f"{name}: {stages[name] / 1e9:.2f} GB"
    assert 0 < large_build["peak"] < bound  # sampled from outside every 0.2 s
    assert large_build["peak"] >= 0.8 * max(stages.values())  # the records agree with what was seen
    print("peak memory per stage (GB):", {k: round(v / 1e9, 2) for k, v in stages.items()},
          f"weights {w / 1e9:.2f} GB")


def test_the_terminal_shows_stages_not_library_noise(large_build):
    out = large_build["output"]
    assert "[export] done in" in out and "peak memory" in out
    assert "TracerWarning" not in out and "matmul_nbits_quantizer" not in out
