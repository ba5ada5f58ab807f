"""scripts/gpu_check.py on this CPU machine: the JSON is written and valid, every CUDA part says "no GPU"."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_json_on_a_machine_without_gpu(tiny_bundle, tmp_path, capsys):
    from edge.device.machine import detect

    if detect().has_gpu:
        pytest.skip("this machine has a GPU: run scripts/gpu_check.sh instead")
    gc = _gpu_check()
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--bundle", str(tiny_bundle.root), "--out", str(out), "--new-tokens", "4"]) == 0, \
        capsys.readouterr().err
    report = json.loads(out.read_text())
    assert gc.validate(report) == []
    assert report["schema"] == "edgechat-gpu-check/1" and report["bundle"] == str(tiny_bundle.root)
    assert report["ort_cuda"]["status"] == "no GPU" and "onnxruntime-gpu" in report["ort_cuda"]["reason"]
    assert report["distill_amp"]["status"] == "no GPU"
    assert report["tensorrt"]["status"] == "no GPU"
    assert report["machine"]["gpu_sm"] is None and report["machine"]["gpu_error"]


def test_gpu_check_schema_refuses_what_a_gpu_run_must_have():
    gc = _gpu_check()
    ok = {"schema": gc.SCHEMA, "date": "2026-12-05T01:00:00Z", "seconds": 1.0, "machine": {}, "bundle": "b",
          "ort_cuda": {"status": "ok", "reason": "", "engines": {"fp32": {
              "status": "ok", "reason": "", "tok_s_cpu": 10.0, "tok_s_gpu": 90.0,
              "parity": {"identical_prompts": 3, "prompts": 3, "first_difference": [None, None, None]}}}},
          "distill_amp": {"status": "ok", "reason": "", "cpu": {}, "cuda": {}, "loss_rel_diff": 0.01,
                          "grad_norm_rel_diff": 0.02},
          "tensorrt": {"status": "no TensorRT", "reason": "tensorrt does not import"}}
    assert gc.validate(ok) == []
    bad = json.loads(json.dumps(ok))
    del bad["ort_cuda"]["engines"]["fp32"]["parity"]
    bad["distill_amp"].pop("loss_rel_diff")
    bad["tensorrt"]["status"] = "fine"
    problems = gc.validate(bad)
    assert len(problems) == 3 and any("parity" in p for p in problems) and any("tensorrt" in p for p in problems)
    assert gc._parity([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {"identical_prompts": 1, "prompts": 2,
                                                                    "first_difference": [None, 1]}
