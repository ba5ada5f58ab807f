"""`edge-export eval`: every engine scored on the same token ids against a reference, llama.cpp included."""

import json

import pytest

from edge.errors import DataError
from export.bundle_eval import EvalRequest, evaluate_bundle
from export.cli import main
from tiny_gguf import write_llama_gguf


def test_eval_scores_every_engine_on_chats_and_prose(tiny_bundle, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_bundle.root), "--chats", "2", "--prose-tokens", "200", "--threads", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["sets"]) == {"chats", "prose"} and res["reference"] == "fp32"
    eng = res["engines"]
    assert set(eng) == {e.name for e in tiny_bundle.manifest.engines}
    assert eng["fp32"]["prose"]["kl_to_fp32"] == 0 and eng["fp32"]["chats"]["top1_agreement"] == 1
    for name in ("int8-dynamic", "int4-weight"):
        for s in ("chats", "prose"):
            assert eng[name][s]["kl_to_fp32"] > 0 and eng[name][s]["eval_tokens"] > 10
    # a random-init tiny model: 4 bits must move its distributions more than 8 do
    assert eng["int4-weight"]["prose"]["kl_to_fp32"] > eng["int8-dynamic"]["prose"]["kl_to_fp32"]
    table = capsys.readouterr().out
    assert "KL prose" in table and "int4-weight" in table


def test_eval_on_the_users_text_file_and_a_bad_reference(tiny_bundle, tmp_path):
    txt = tmp_path / "mine.txt"
    txt.write_text("The ocean is deep and blue.\n\nOctopuses have eight arms and three hearts.\n")
    res = evaluate_bundle(EvalRequest(tiny_bundle.root, data=str(txt), reference="int8-dynamic", threads=1))
    assert list(res["sets"]) == ["mine.txt"] and res["engines"]["int8-dynamic"]["mine.txt"]["kl_to_fp32"] == 0
    with pytest.raises(DataError, match="neither an engine"):
        evaluate_bundle(EvalRequest(tiny_bundle.root, data=str(txt), reference="int2", threads=1))


def test_a_gguf_of_the_same_weights_scores_like_the_fp32_graph(tiny_bundle, tiny_model_dir, tmp_path):
    """llama.cpp on our token ids: an F32 GGUF of the tiny model must agree with the fp32 ONNX graph."""
    from edge.errors import MissingDependencyError
    from export.eval_gguf import _llama_cpp

    try:
        _llama_cpp()
    except MissingDependencyError as e:
        pytest.skip(f"llama-cpp-python (the optional [bench] extra) is not usable here: {e}")
    gguf = write_llama_gguf(tiny_model_dir, tmp_path / "tiny-f32.gguf")
    res = evaluate_bundle(EvalRequest(tiny_bundle.root, ggufs=(str(gguf),), chats=2, prose_tokens=200, threads=1))
    row = res["engines"]["llama.cpp tiny-f32"]
    assert row["size_bytes"] == gguf.stat().st_size
    for s in ("chats", "prose"):
        assert row[s]["kl_to_fp32"] < 1e-4 and row[s]["top1_agreement"] > 0.98
    res = evaluate_bundle(EvalRequest(tiny_bundle.root, reference=str(gguf), chats=1, prose_tokens=100, threads=1))
    assert res["reference"] == "llama.cpp tiny-f32" and res["engines"]["fp32"]["prose"]["kl_to_fp32"] < 1e-4


def test_the_build_report_heads_each_engine_with_kl_on_chats_and_prose(tiny_bundle):
    q = tiny_bundle.manifest.engine("int4-weight").quality
    assert q["prose"]["kl_to_fp32"] > 0 and q["prose"]["eval_tokens"] > 100 and q["prose"]["bits_per_byte"] > 0
    assert q["kl_to_fp32"] > 0  # chats, as before
    report = (tiny_bundle.root / "report" / "report.md").read_text()
    head = next(line for line in report.splitlines() if line.startswith("| engine"))
    assert head.split("|")[2:4] == [" size ", " KL chats "] and "KL prose" in head
    assert "held-out texts" in report


@pytest.mark.parametrize("noise", [1e-3, 0.3, 3.0])  # fp16-like, int8-like, a different model
def test_the_fast_metrics_equal_the_float64_ones(noise):
    """token_metrics computes KL as E_p[t - s] - (lse_t - lse_s) in float32 with float64 sums (the evaluate stage's
    cost was mostly float64 log-softmaxes): it must give the float64 numbers, KL to ~1e-8 nats per token even
    where the KL itself is ~1e-6 (what an fp16 graph scores)."""
    import numpy as np

    from export.evaluate import Reference, token_metrics, token_metrics_f64

    rng = np.random.default_rng(1)
    t = (rng.standard_normal((97, 5003)) * 4).astype(np.float32)
    s = (t + rng.standard_normal(t.shape) * noise).astype(np.float32)
    y = rng.integers(0, t.shape[1], 97)
    fast, slow = token_metrics(s, Reference.of(t), y), token_metrics_f64(s, t, y)
    assert fast["agree"] == slow["agree"] and fast["n"] == slow["n"] == 97
    assert abs(fast["kl"] - slow["kl"]) / 97 < 1e-8 + 1e-5 * slow["kl"] / 97
    assert abs(fast["nll"] - slow["nll"]) / 97 < 1e-6
    assert token_metrics(t, Reference.of(t), y)["kl"] == 0  # the reference against itself: exactly 0


def test_kl_interval_is_a_bootstrap_over_texts():
    from export.evaluate import kl_interval, summarize

    same = [{"kl": 0.5, "n": 50, "nll": 100.0, "agree": 40}] * 8  # every text alike: no spread
    lo, hi = kl_interval(same)
    assert lo == pytest.approx(0.01) and hi == pytest.approx(0.01)
    mixed = [{"kl": k, "n": 10, "nll": 20.0, "agree": 9} for k in (0.0, 0.1, 0.2, 0.3, 2.0, 0.1, 0.05, 0.4)]
    q = summarize(mixed)
    lo, hi = q["kl_ci95"]
    assert lo < q["kl_to_fp32"] < hi and hi - lo > 0.01 and q["texts"] == 8


def test_the_evaluate_stage_records_what_each_engine_cost_and_how_it_was_scored(tiny_bundle):
    """Per engine: how it was run (the Q/DQ graph as written, said so) and the seconds each step took; the report
    says both, and the KL's interval over the texts."""
    rec = next(s for s in tiny_bundle.manifest.stages if s.name == "evaluate")
    eng = rec.metrics["engines"]
    for name in ("fp32", "int8-dynamic", "int8-qdq", "int4-weight"):
        t = eng[name]["timing"]
        assert t["scored_tokens"] > 0 and t["score_s"] > 0 and t["golden_s"] > 0 and t["speed_s"] > 0
        assert t["total_s"] >= t["score_s"] + t["golden_s"]
        assert eng[name]["scored_with"].startswith("ONNX Runtime ") and "CPU" in eng[name]["scored_with"]
    assert "disable_quant_qdq=1" in eng["int8-qdq"]["scored_with"]
    assert "disable_quant_qdq" not in eng["int8-dynamic"]["scored_with"]
    assert "timing" not in tiny_bundle.manifest.engine("int8-dynamic").quality  # the stage record holds it
    lo, hi = eng["int4-weight"]["kl_ci95"]
    assert lo <= eng["int4-weight"]["kl_to_fp32"] <= hi and eng["int4-weight"]["texts"] == 4
    report = (tiny_bundle.root / "report" / "report.md").read_text()
    assert "## How each engine was scored" in report and "95% interval" in report
    line = next(x for x in report.splitlines() if x.startswith("- int8-qdq: "))
    assert "Q/DQ run as written" in line and "tokens" in line and "s in all" in line
    row = next(x for x in report.splitlines() if x.startswith("| int4-weight "))
    assert f"({lo:.4f}–{hi:.4f})" in row
