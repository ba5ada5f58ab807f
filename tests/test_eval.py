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
