"""A build's memory: measured per stage, and refused up front when the plan says it cannot fit."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import run_cli


def test_every_stage_records_its_peak_memory(tiny_bundle):
    for s in tiny_bundle.manifest.stages:
        m = s.memory
        assert m["peak_rss_bytes"] >= m["start_rss_bytes"] > 0, s.name
        assert m["peak_is_per_stage"], s.name  # Linux: VmHWM reset for each stage
    stage_json = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work") / "export" / "stage.json"
    assert '"peak_rss_bytes"' in stage_json.read_text()


def test_a_build_that_cannot_fit_is_refused_naming_what_would():
    from edge.errors import RecipeError
    from export.build_memory import build_peak_bytes, check_fits, largest_buildable
    from export.model_source import KNOWN_SIZES

    dims = KNOWN_SIZES["llama-3-8b"]
    with pytest.raises(RecipeError, match=r"needs about 98\.9 GB .* this machine has 24\.0 GB: it builds models up to "
                                          r"about 1\.79B parameters"):
        check_fits(dims, "llama-3-8b", ram=24_000_000_000)
    with pytest.raises(RecipeError, match=r"quantize-int8-qdq stage.*without int8-qdq.*up to about 1\.79B"):
        check_fits(KNOWN_SIZES["smollm2-1.7b"], "smollm2-1.7b", ("int8-dynamic", "int8-qdq"), ram=24_000_000_000)
    small = KNOWN_SIZES["smollm2-135m"]
    assert check_fits(small, "smollm2", ram=24_000_000_000)["planned_peak_bytes"] == build_peak_bytes(small)
    assert abs(build_peak_bytes(KNOWN_SIZES["qwen2.5-0.5b"]) - (3.0 * 4 * 494e6 + 2.5e9)) < 0.02e9
    # every measured build (docs/models.md, the stage records' bytes) is within its plan
    measured = {134_515_008: {"load": 1203462144, "export": 3064987648, "quantize-int8-qdq": 4190060544,
                              "evaluate": 4063993856},
                630_167_424: {"load": 3979235328, "export": 7184035840, "quantize-int8-qdq": 9801375744,
                              "evaluate": 8728670208},
                1_777_088_000: {"load": 9253167104, "export": 11312402432, "evaluate": 12881788928}}
    # the same 1.5B build rerun beside the streaming one (2026-12-07, docs/bench/build-qwen15-normal-vs-streamed-*.json)
    measured = [*measured.items(), (1_777_088_000, {"load": 9_251_352_576, "export": 15_786_364_928,
                                                    "evaluate": 7_919_603_712})]
    for params, stages in measured:
        dims = dataclasses.replace(small, num_parameters=params)
        plan = build_peak_bytes(dims, ("int8-qdq",) if "quantize-int8-qdq" in stages else ())
        assert max(stages.values()) <= plan, (params, stages, plan)
    assert largest_buildable(1e9) == 0


def test_the_cli_refuses_with_one_line_and_exit_2(tmp_path):
    r = run_cli("export.cli", "build", "llama-3-8b", "-o", str(tmp_path / "x.bundle"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "peak" in r.stderr and "--skip-ram-check" in r.stderr
    assert not (tmp_path / "x.bundle.work").exists()  # refused before any stage ran


def test_the_streaming_plan_is_a_base_plus_the_largest_tensor_and_covers_its_measured_builds():
    """The streaming build's plan grows with the largest tensor, not the model, while it writes the engines (its
    evaluate stage holds each engine, as the device will): an 8B model plans to build on a 32 GB workstation (on a
    16 GB one with --skip-eval); each measured streaming build (docs/models.md) is within its plan, stage by stage."""
    from edge.errors import RecipeError
    from export.build_memory import check_fits, largest_tensor_bytes, streaming_peak_bytes
    from export.model_source import KNOWN_SIZES

    dims = KNOWN_SIZES["llama-3-8b"]
    assert largest_tensor_bytes(dims) == 4 * 128256 * 4096  # the LM head (or embedding)
    assert streaming_peak_bytes(dims) < 0.85 * 32e9
    assert streaming_peak_bytes(dims, evaluate=False, gptq=False) < 0.85 * 16e9
    assert check_fits(dims, "llama-3-8b", ("int8-dynamic", "int4-weight"), ram=32_000_000_000,
                      streaming=True)["planned_peak_bytes"] == streaming_peak_bytes(dims)
    deeper = dataclasses.replace(dims, num_layers=4 * dims.num_layers, num_parameters=4 * dims.num_parameters)
    writing = dict(evaluate=False, gptq=False)
    assert streaming_peak_bytes(deeper, **writing) == streaming_peak_bytes(dims, **writing)  # depth costs nothing
    assert streaming_peak_bytes(deeper) > streaming_peak_bytes(dims)  # ...but the engine evaluated is larger
    with pytest.raises(RecipeError, match=r"streaming build of llama-3-8b needs about 13\.9 GB .* has 8\.0 GB.*"
                                          r"add --skip-eval"):
        check_fits(dims, "llama-3-8b", ram=8_000_000_000, streaming=True)
    with pytest.raises(RecipeError, match=r"needs about 7\.3 GB .* has 4\.0 GB: build on a larger machine, or pass"):
        check_fits(dims, "llama-3-8b", ram=4_000_000_000, streaming=True, evaluate=False, gptq=False)
    # measured: scripts/synthetic_checkpoint.py build (random Llama-3.2-3B shape, bf16 shards), peak RSS per engine
    llama32_3b = dataclasses.replace(dims, hidden_size=3072, num_layers=28, num_heads=24, head_dim=128,
                                     intermediate_size=8192, tie_word_embeddings=True)
    for peak in (4_472_340_480,):  # int8-dynamic, --skip-eval, round to nearest
        assert peak <= streaming_peak_bytes(llama32_3b, evaluate=False, gptq=False)
    # measured: Qwen2.5-Coder-1.5B-Instruct from its GGUF, --streaming, round to nearest, evaluated (docs/models.md)
    qwen15 = dataclasses.replace(dims, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                                 intermediate_size=8960, vocab_size=151936, num_parameters=1_777_088_000,
                                 tie_word_embeddings=True)
    # (2026-12-07: docs/bench/build-qwen15-streamed-2026-12-07.json; every stage under 4 GB)
    stages = {"load": 918_560_768, "quantize-int8-dynamic": 2_786_938_880, "quantize-int4-weight": 2_830_204_928,
              "evaluate": 3_790_692_352}
    plan = streaming_peak_bytes(qwen15, ("int8-dynamic", "int4-weight"), gptq=False)
    assert max(stages.values()) <= plan, (stages, plan)
    writing = streaming_peak_bytes(qwen15, evaluate=False, gptq=False)
    assert max(v for k, v in stages.items() if k != "evaluate") <= writing <= 4e9  # its engines written in < 4 GB
    assert max(stages.values()) <= 4e9 and plan <= 1.1 * max(stages.values())  # and evaluated: a plan that is not loose
    # ...and its int4-qdq, streamed from the plain graph written op by op, evaluated as its CPU twin (2026-12-07,
    # docs/bench/build-qwen15-streamed-int4-qdq-2026-12-07.json): 11.6 GB when ONNX Runtime folded it to fp32
    qdq = {"load": 920_121_344, "quantize-int4-qdq": 2_735_853_568, "evaluate": 4_700_246_016}
    plan = streaming_peak_bytes(qwen15, ("int4-qdq",), gptq=False)
    assert max(qdq.values()) <= plan <= 1.1 * max(qdq.values()), (qdq, plan)
    assert qdq["quantize-int4-qdq"] <= streaming_peak_bytes(qwen15, evaluate=False, gptq=False)


def test_plan_says_where_the_streaming_build_fits():
    r = run_cli("export.cli", "plan", "--model", "llama-3-8b", "--target", "agx-orin-64gb")
    assert r.returncode == 0, r.stderr
    assert "streaming build" in r.stdout and "builds on a 32 GB workstation" in r.stdout
