"""What a user sees from `edge-export build`: stage lines and a summary, not library noise; and a failure
is one error naming the stage, what to do and its log."""

from __future__ import annotations

import json

from conftest import run_cli


def test_the_build_prints_few_lines_and_logs_the_rest(tiny_model_dir, tmp_path):
    out = tmp_path / "quiet.bundle"
    recipe = tmp_path / "r.toml"
    recipe.write_text('[build]\nprecisions = ["int8-dynamic", "int8-qdq", "int4-weight"]\nmax_context = 256\n'
                      "[quantize]\ncalibration_samples = 2\n[evaluate]\neval_samples = 2\n")
    r = run_cli("export.cli", "build", str(tiny_model_dir), "-o", str(out), "--recipe", str(recipe), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) <= 40, "\n".join(lines)
    text = "\n".join(lines)
    for noise in ("Warning", "WARNING", "[INFO]", "TracerWarning", "matmul_nbits_quantizer", "Traceback",
                  "pre-processing before quantization", "it/s]"):
        assert noise not in text, f"{noise!r} reached the terminal:\n{text}"
    for stage in ("load", "export", "quantize-int8-dynamic", "quantize-int8-qdq", "quantize-int4-weight", "evaluate"):
        assert f"[{stage}] done in" in text
    assert "peak memory" in text and "decode tok/s" in text  # the summary tables
    logs = {p.parent.name: p.read_text() for p in (tmp_path / "quiet.bundle.work").glob("*/log.txt")}
    assert "TracerWarning" in logs["export"] or "DeprecationWarning" in logs["export"], "the export's noise is logged"
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
