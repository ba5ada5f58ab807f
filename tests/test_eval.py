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


def _built_engines(bundle):
    """The tiny build's load folder and its engines as the build passed them to the evaluate stage."""
    from export.package import EngineArtifact
    from export.recipe import FROM_FUSED

    work = bundle.root.with_name(bundle.root.name + ".work")
    engines = [EngineArtifact("fp32", work / "export", "fp32", reference=True)]
    for p in ("int8-dynamic", "int8-qdq", "int4-weight"):
        engines.append(EngineArtifact(p, work / f"quantize-{p}", p, variant="fused" if p in FROM_FUSED else "plain"))
    return work / "load", engines


def test_the_evaluate_stage_holds_one_engine_at_a_time_and_scores_as_all_in_memory(tiny_bundle, tmp_path, monkeypatch):
    """The evaluate stage loads one engine at a time (the reference's logits kept on disk between them), and its
    numbers are the ones scoring every engine side by side in memory gives (what it did before): each text in the
    runtime's prefill calls (a fused graph: 64, 64, 128 positions), the same logits, so the same numbers but for the
    order of their float sums (the stage adds up its calls' sums)."""
    import gc

    import numpy as np

    from edge.backends.onnxruntime import OrtDecoder
    from edge.io_contract import io_for_variant
    from export import evaluate
    from export.load import chat_tokenizer, model_dims

    alive, most = _count_decoders(monkeypatch, evaluate)
    hf_dir, engines = _built_engines(tiny_bundle)
    opts = evaluate.EvalOptions(samples=3, max_context=256, prose_tokens=150, threads=1, bench_runs=1, bench_tokens=4,
                                golden_tokens=4)
    read = _count_reference_rows(monkeypatch, evaluate)
    res = evaluate.run(hf_dir, engines, tmp_path, opts)
    gc.collect()
    assert most[0] == 1 and alive[0] == 0
    assert res["reference_logits_bytes"] > 0 and not list(tmp_path.glob("reference-logits*"))  # removed at the end
    assert list(res["engines"]) == [e.name for e in engines]
    assert [g["engine"] for g in res["golden"]] == [e.name for e in engines for _ in evaluate.GOLDEN]

    # the same texts scored the way the stage did before: every engine loaded at once, the reference in memory
    tok = chat_tokenizer(hf_dir)
    from export.data import load_chats
    from export.prose import prose_texts

    sets = {"chats": [tok.encode_chat(c, add_generation_prompt=False)[:256] for c in load_chats(None, "evaluation", 3)],
            "prose": evaluate.prose_windows(tok, prose_texts("eval"), 256, 150)}
    # a fused engine's text is scored one prefill call at a time: never more of the reference's rows than that
    assert max(n for fused, n in read if fused) <= 128 < max(len(ids) - 1 for seqs in sets.values() for ids in seqs)
    decs = {e.name: OrtDecoder(e.folder / "model.onnx", model_dims(hf_dir, 256), io_for_variant(e.variant), threads=1,
                               precision=e.precision) for e in engines}

    def logits(d, ids):
        x = np.array([ids[:-1]])
        return d.forward(x, d.new_cache(capacity=x.shape[1]), last_only=False)[0]

    for kind, seqs in sets.items():
        parts = {n: [] for n in decs}
        for ids in seqs:
            ref = evaluate.Reference.of(logits(decs["fp32"], ids))
            n_bytes = len(tok.decode(ids[1:], skip_special_tokens=False).encode("utf-8"))
            for n, d in decs.items():
                s = ref.logits if n == "fp32" else d.prefill(ids[:-1], d.new_cache(capacity=len(ids)), last_only=False)[0]
                parts[n].append(evaluate.token_metrics(s, ref, np.array(ids[1:])) | {"n_ref": len(ids) - 1, "bytes": n_bytes})
        for n in decs:
            got = res["engines"][n] if kind == "chats" else res["engines"][n]["prose"]
            want = evaluate.summarize(parts[n])
            for k in ("kl_to_fp32", "top1_agreement", "perplexity", "kl_ci95", "eval_tokens", "bits_per_byte"):
                assert got[k] == (want[k] if k in ("top1_agreement", "eval_tokens") else pytest.approx(want[k], rel=1e-12)), (n, kind, k)


def test_edge_export_eval_holds_one_model_at_a_time(tiny_bundle, tmp_path, monkeypatch):
    import gc

    import edge.backends.onnxruntime as ort_backend

    from export import evaluate

    alive, most = _count_decoders(monkeypatch, ort_backend)
    read = _count_reference_rows(monkeypatch, evaluate)  # as the build's stage
    res = evaluate_bundle(EvalRequest(tiny_bundle.root, chats=2, prose_tokens=300, threads=1), work=tmp_path)
    gc.collect()
    assert most[0] == 1 and alive[0] == 0 and set(res["engines"]) == {e.name for e in tiny_bundle.manifest.engines}
    assert not list(tmp_path.iterdir())  # the reference's logits are gone with the run
    assert max(n for fused, n in read if fused) <= 128 < max(n for _, n in read)  # a fused engine: a call at a time


def _count_reference_rows(monkeypatch, evaluate) -> list[tuple[bool, int]]:
    """(fused graph?, the reference's rows read at once) for each call `evaluate.scored` makes."""
    read, scored = [], evaluate.scored

    def counted(d, ids, reference_rows):
        def rows(a, b):
            read.append((d.io.fused, b - a))
            return reference_rows(a, b)
        return scored(d, ids, rows)

    monkeypatch.setattr(evaluate, "scored", counted)
    return read


def _count_decoders(monkeypatch, module) -> tuple[list[int], list[int]]:
    """`module.OrtDecoder` replaced by one that counts the decoders alive now and at most: ([alive], [most])."""
    from edge.backends.onnxruntime import OrtDecoder

    alive, most = [0], [0]

    class Counted(OrtDecoder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            alive[0] += 1
            most[0] = max(most[0], alive[0])

        def __del__(self):
            alive[0] -= 1

    monkeypatch.setattr(module, "OrtDecoder", Counted)
    return alive, most
