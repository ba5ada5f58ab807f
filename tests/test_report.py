"""The export report's plots: a KL plot per engine, and labels on the size-vs-perplexity plot that do not overlap."""

from __future__ import annotations

import pytest

from export.report import place_labels, write_report

# The README's 'Quality kept' table (SmolLM2-135M, recipes/smollm2-int8.toml): int4-weight and int8-dynamic
# sit close together, which is where the labels used to overlap.
README = {"fp32": (539e6, 48.30, 0.0, 40.0), "int8-dynamic": (154e6, 48.99, 0.0061, 105.0),
          "int8-qdq": (256e6, 49.22, 0.097, 12.0), "int8-qdq-no-smoothquant": (256e6, 74.69, 0.986, None),
          "int4-weight": (102e6, 48.72, 0.443, 120.0)}


def _results(engines: dict) -> dict:
    res = {"engines": {}, "golden": [], "eval_chats": 64, "reference": "fp32", "data": "chitchat-dataset:evaluation"}
    for n, (size, ppl, kl, tok) in engines.items():
        res["engines"][n] = {"size_bytes": size, "perplexity": ppl, "kl_to_fp32": kl, "top1_agreement": 0.9,
                             **({"decode_tok_s": tok} if tok else {})}
    return res


def test_report_has_a_kl_plot(tmp_path):
    write_report(_results(README), tmp_path)
    png = tmp_path / "kl_per_engine.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "![kl_per_engine.png](kl_per_engine.png)" in (tmp_path / "report.md").read_text()
    assert 'src="kl_per_engine.png"' in (tmp_path / "report.html").read_text()


def test_build_report_has_the_kl_plot(tiny_bundle):
    report = tiny_bundle.root / "report"
    assert (report / "kl_per_engine.png").is_file() and "kl_per_engine.png" in (report / "report.md").read_text()


def _boxes(points: list[tuple[float, float, str]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    ax.margins(x=0.25, y=0.2)
    fig.tight_layout()
    anns = place_labels(ax, points)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(a, renderer) for a in anns]
    frame = ax.get_window_extent(renderer)
    plt.close(fig)
    return boxes, frame


@pytest.mark.parametrize("points", [
    [(size / 1e6, ppl, n) for n, (size, ppl, _, _) in README.items()],
    # a cluster: eight engines within a few MB and a tenth of a perplexity point
    [(100 + i % 3, 48.0 + 0.05 * i, f"engine-{i}") for i in range(8)],
], ids=["readme", "cluster"])
def test_labels_do_not_overlap_and_stay_inside(points):
    boxes, frame = _boxes(points)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1, points[i][2]
        for j, b in enumerate(boxes[:i]):
            assert not a.overlaps(b), f"{points[i][2]} overlaps {points[j][2]}"


class _Tok:
    def encode_chat(self, messages):
        return [100, len(messages[0]["content"])]

    def decode(self, ids):
        return {5: " The", 6: " Paris", 9: " L", 7: "."}.get(ids[0], f"<{ids[0]}>")


def test_golden_regressions_say_which_engine_fails_what_fp32_passes_and_why(tmp_path):
    """The report names each golden prompt an engine fails where fp32 passes, the token where the answers part
    and fp32's own probabilities there (a near tie, or not); the answers are grouped by prompt, fp32 first."""
    import numpy as np

    from export.evaluate import golden_regressions

    def row(engine, prompt, passed, ids, answer):
        return {"engine": engine, "prompt": prompt, "passed": passed, "token_ids": ids, "answer": answer, "expect": ["x"]}

    golden = [row("int8-dynamic", "capital of France?", False, [5, 9, 7], "The L."),
              row("fp32", "capital of France?", True, [5, 6, 7], "The Paris."),
              row("int4-weight", "capital of France?", True, [5, 6, 7], "The Paris."),
              row("fp32", "hard one", False, [5, 7], "The."), row("int8-dynamic", "hard one", False, [5, 9], "The L"),
              row("int4-weight", "capital of Japan?", False, [5, 9], "The L"), row("fp32", "capital of Japan?", True, [5, 6], "The Paris")]
    seen = []

    def next_logits(ids):
        seen.append(ids)
        p = np.full(16, 1e-3)
        p[6], p[9] = (0.40, 0.35) if ids[1] == len("capital of France?") else (0.9, 0.02)
        return np.log(p)

    regs = golden_regressions(golden, _Tok(), next_logits)
    assert [(r["engine"], r["prompt"]) for r in regs] == [("int8-dynamic", "capital of France?"), ("int4-weight", "capital of Japan?")]
    fr, jp = regs
    assert fr["position"] == 1 and fr["fp32_token"] == " Paris" and fr["engine_token"] == " L" and fr["engine_token_fp32_rank"] == 2
    assert fr["fp32_p"] == pytest.approx(0.40 / (0.75 + 14e-3)) and "near tie" in fr["why"] and "token 2" in fr["why"]
    assert "not a near tie" in jp["why"]
    assert seen[0] == [100, len("capital of France?"), 5]  # fp32's logits after the prompt and the shared prefix

    res = _results(README) | {"golden": golden, "golden_regressions": regs}
    write_report(res, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert '**int8-dynamic** fails "capital of France?": its answer leaves fp32\'s at token 2' in md
    france = md[md.index("- capital of France?"):]
    assert france.index("**fp32**") < france.index("**int8-dynamic**") < france.index("**int4-weight**")
    assert "fails “capital of France?”" in (tmp_path / "report.html").read_text()
    write_report(_results(README) | {"golden": [g for g in golden if g["passed"] is not False], "golden_regressions": []}, tmp_path)
    assert "Every engine passes every golden prompt the fp32 graph passes." in (tmp_path / "report.md").read_text()


def test_golden_regression_when_the_engine_stops_early():
    import numpy as np

    from export.evaluate import golden_regressions

    golden = [{"engine": "fp32", "prompt": "p", "passed": True, "token_ids": [5, 6, 7]},
              {"engine": "int8-dynamic", "prompt": "p", "passed": False, "token_ids": [5], "finish_reason": "stop"}]
    p = np.full(16, 1e-3)
    p[6] = 0.9
    (r,) = golden_regressions(golden, _Tok(), lambda ids: np.log(p))
    assert r["position"] == 1 and "start of fp32's and ends at token 2 (stop)" in r["why"] and "' Paris' p=0.9" in r["why"]
