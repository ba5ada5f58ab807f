"""The export report: report.md and report.html with static plots, viewable offline."""

from __future__ import annotations

import html
from pathlib import Path

from edge.precisions import FP32

# The headline per engine is KL to the reference (it sees every token's whole distribution, where perplexity
# on small talk can even improve while answers change); "prose." keys: the held-out prose set (export/prose.py).
COLUMNS = [("size_bytes", "size", lambda v: f"{v / 1e6:.1f} MB"),
           ("kl_to_fp32", "KL chats", lambda v: f"{v:.4f}"), ("prose.kl_to_fp32", "KL prose", lambda v: f"{v:.4f}"),
           ("top1_agreement", "top-1 chats", lambda v: f"{100 * v:.1f}%"),
           ("prose.top1_agreement", "top-1 prose", lambda v: f"{100 * v:.1f}%"),
           ("perplexity", "ppl chats", lambda v: f"{v:.3f}"),
           ("perplexity_delta_pct", "Δppl chats", lambda v: f"{v:+.2f}%"),
           ("prose.perplexity_delta_pct", "Δppl prose", lambda v: f"{v:+.2f}%"),
           ("perplexity_vs_teacher_pct", "Δppl vs teacher", lambda v: f"{v:+.1f}%"),
           ("golden_passed", "golden", str),
           ("decode_tok_s", "decode tok/s", lambda v: f"{v:.1f}"), ("ttft_ms", "TTFT", lambda v: f"{v:.0f} ms")]


def _get(q: dict, key: str):
    """q[key], or q["prose"]["kl_to_fp32"] for "prose.kl_to_fp32"; None when absent."""
    for part in key.split("."):
        q = q.get(part) if isinstance(q, dict) else None
    return q


def _columns(results: dict) -> list:
    return [c for c in COLUMNS if any(_get(q, c[0]) is not None for q in results["engines"].values())]


def _by_prompt(golden: list[dict]) -> list[tuple[str, list[dict]]]:
    """Golden answers grouped by prompt, the fp32 graph's first: each engine's answer beside the reference."""
    groups: dict[str, list[dict]] = {}
    for g in golden:
        groups.setdefault(g["prompt"], []).append(g)
    return [(p, sorted(rows, key=lambda g: g["engine"] != FP32)) for p, rows in groups.items()]


def _cell(q: dict, key: str, fmt) -> str:
    """A column's value; a KL with its 95% interval over the texts when there is one (and it is not 0)."""
    v = _get(q, key)
    if v is None:
        return "-"
    ci = _get(q, key.replace("kl_to_fp32", "kl_ci95")) if key.endswith("kl_to_fp32") else None
    return fmt(v) + (f" ({fmt(ci[0])}–{fmt(ci[1])})" if ci and ci[1] > 0 else "")


def _rows(results: dict) -> list[list[str]]:
    return [[name] + [_cell(q, k, fmt) for k, _, fmt in _columns(results)] for name, q in results["engines"].items()]


def _scoring_lines(results: dict) -> list[str]:
    """How each engine was scored and what it cost (the evaluate stage's time, engine by engine)."""
    out = []
    for name, q in results["engines"].items():
        t = q.get("timing")
        if not t or "scored_with" not in q:
            continue
        texts = f"{q.get('texts', '?')} chats" + (f" + {q['prose']['texts']} prose texts" if "prose" in q else "")
        rate = t["scored_tokens"] / t["score_s"] if t.get("score_s") else 0
        steps = [f"scoring {texts} ({t['scored_tokens']:,} tokens) {t['score_s']:.1f} s ({rate:.0f} tok/s)"]
        steps += [f"{label} {t[k]:.1f} s" for k, label in (("golden_s", "golden prompts"), ("speed_s", "speed"),
                                                           ("load_s", "session load")) if k in t]
        out.append(f"{name}: {q['scored_with']}; {', '.join(steps)}; {t['total_s']:.1f} s in all.")
    return out


def _stage_lines(results: dict) -> list[str]:
    """What prune and distill did, and how much of pruning's loss distillation won back."""
    st = results.get("stages") or {}
    out = []
    if "prune" in st:
        from export.prune import describe

        p = st["prune"]
        out.append(f"Prune ({p['method']} importance on {p['calibration_tokens']} calibration tokens): {describe(p)}; "
                   f"dropped layers {p['dropped_layers'] or 'none'}.")
    if "teacher-answers" in st:
        a = st["teacher-answers"]
        asked = (f"{a['asked']} questions it wrote itself ({a['questions_kept']} of {a['questions_written']} sampled "
                 "ended within the limit)" if a.get("prompts") == "teacher" else f"{a['asked']} distillation chats")
        out.append(f"Teacher answers (sequence-level distillation text): the teacher answered {asked} "
                   f"({a['answer_tokens']} tokens, sampled at T={a['sampling']['temperature']}, "
                   f"top-p {a['sampling']['top_p']}); {a['kept']} ended at EOS and were kept.")
    if "distill" in st:
        d = st["distill"]
        teacher = (f"read {d['teacher_rows']} of the {d['steps'] * d['batch_size']} rows"
                   if d.get("teacher_rows") is not None and d.get("batch_size")
                   else f"ran in {d.get('teacher_steps')} of the {d['steps']} steps")  # records before teacher_rows
        out.append(f"Distill on {d.get('text', 'chat text')}: {d['steps']} steps, {d['tokens_seen']} tokens in {d['seconds']:.0f} s on {d['device']} "
                   f"({d['tokens_per_s']} tok/s, AMP {d['amp']}), KD loss {d['loss_first']:.3f} -> {d['loss_last']:.3f}"
                   + (f"; KL over the teacher's top {d['teacher_topk']} tokens (holding {100 * d['teacher_topk_mass']:.1f}% "
                      f"of its mass at T={d['temperature']}) + the rest, cached: the teacher {teacher}" if d.get("teacher_topk") and d.get("teacher_topk_mass") is not None else "")
                   + (f"; weights {d['weights_sha256']}" if d.get("weights_sha256") else "") + ".")
        for name, m in (d.get("mixture") or {}).items():
            out.append(f"Distillation source {name}: share {m['share']:g}, {m['rows']} rows of {m['blocks']} blocks "
                       f"({m['epochs']:g} epochs), {m['loss_tokens']} tokens with loss.")
        if d.get("stopped_early"):  # loud: the bundle is not the model the recipe describes
            out.append(f"**WARNING: {d['stopped_early']}.**")
    if results.get("recovered") is not None:
        out.append(f"Distillation recovered {100 * results['recovered']:.0f}% of the perplexity increase pruning caused "
                   "on the held-out chats (teacher -> pruned-only -> fp32 rows).")
    bpb = {k: results["engines"][k]["prose"]["bits_per_byte"] for k in ("teacher", "pruned-only", FP32)
           if "bits_per_byte" in (results.get("engines", {}).get(k, {}).get("prose") or {})}
    if len(bpb) == 3 and bpb["pruned-only"] > bpb["teacher"]:
        t, p, f = bpb["teacher"], bpb["pruned-only"], bpb[FP32]
        out.append(f"On held-out general prose it recovered {100 * (p - f) / (p - t):.0f}% of the rise in bits per byte "
                   f"pruning caused (teacher {t:.3f} -> pruned-only {p:.3f} -> fp32 {f:.3f}: {f / t:.3f}x the teacher).")
    return out


def _save(fig, dst: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(dst / name, dpi=110)
    plt.close(fig)
    return name


# Where a point's label may go, tried in this order (unit offsets, scaled by the distances below): right,
# left, above, below, then the diagonals. A label farther out than the first ring gets a leader line.
_SPOTS = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, 1), (1, -1), (-1, -1))
_RINGS = (7, 16, 28, 44)  # points from the marker


def place_labels(ax, points: list[tuple[float, float, str]], colors: list | None = None) -> list:
    """Label each point where the text overlaps no other label or marker and stays inside the axes.

    A greedy search, like adjustText but small: for each point the first free spot of a few around it,
    farther out (with a leader line) when the near ones are taken; if none is free, the one that
    overlaps least. Each label takes its point's color (`colors`). Returns the annotations."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    r = 5 * fig.dpi / 72  # marker radius in pixels
    frame = ax.get_window_extent(renderer)
    taken = [Bbox.from_bounds(mx - r, my - r, 2 * r, 2 * r) for mx, my in
             (ax.transData.transform((x, y)) for x, y, _ in points)]
    out = []
    for i, (x, y, label) in enumerate(points):
        ann = ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 0), fontsize=9, va="center",
                          color=colors[i] if colors else None,
                          arrowprops={"arrowstyle": "-", "color": "0.55", "lw": 0.7, "shrinkA": 1, "shrinkB": 5})
        best = None
        for ring in _RINGS:
            for dx, dy in _SPOTS:
                ann.xyann = (dx * ring, dy * ring * 0.8)
                ann.set_ha("left" if dx > 0 else "right" if dx < 0 else "center")
                ann.update_positions(renderer)
                box = Text.get_window_extent(ann, renderer).padded(2)  # the text alone, not its leader line
                inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                cost = sum(_area(box, t) for t in taken) + (0 if inside else 1e6)
                if best is None or cost < best[0]:
                    best = (cost, ann.xyann, ann.get_ha(), box, ring)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        _, ann.xyann, ha, box, ring = best
        ann.set_ha(ha)
        ann.arrow_patch.set_visible(ring > _RINGS[0])  # a leader line only when the label sits away from its point
        taken.append(box)
        out.append(ann)
    return out


def _area(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _plots(results: dict, dst: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from export.planner import DEFAULT_MAX_KL

    eng = results["engines"]
    names = list(eng)
    ref = "the fp32 teacher" if results.get("reference") == "teacher" else "the fp32 graph"
    files = []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(names):
        ax.scatter(eng[n]["size_bytes"] / 1e6, eng[n]["perplexity"], s=50, color=colors[i % len(colors)], zorder=3)
    ax.margins(x=0.25, y=0.2)  # room for the labels inside the frame
    ax.set_xlabel("size on disk (MB)")
    ax.set_ylabel("perplexity on held-out chats\n(per token, lower is better)")
    ax.set_title("Size vs quality per engine")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    place_labels(ax, [(eng[n]["size_bytes"] / 1e6, eng[n]["perplexity"], n) for n in names],
                 [colors[i % len(colors)] for i in range(len(names))])
    files.append(_save(fig, dst, "size_vs_perplexity.png"))

    kl = [n for n in names if "kl_to_fp32" in eng[n]]
    if kl:
        fig, ax = plt.subplots(figsize=(7.4, 1.4 + 0.42 * len(kl)))
        vals = [eng[n]["kl_to_fp32"] for n in kl]
        ax.barh(range(len(kl)), vals, color=[colors[names.index(n) % len(colors)] for n in kl], height=0.6)
        ax.set_yticks(range(len(kl)), kl)
        ax.invert_yaxis()
        # the planner's bound is on what a precision loses against the fp32 model shipped: against a teacher,
        # that model's own KL comes on top (export.planner.bundle_quality)
        base = eng.get(FP32, {}).get("kl_to_fp32", 0.0) if results.get("reference") == "teacher" else 0.0
        bound = base + DEFAULT_MAX_KL
        top = max(max(vals), bound)
        ax.set_xlim(0, top * 1.25)
        ax.axvline(bound, color="0.4", ls="--", lw=1, zorder=0)
        for i, v in enumerate(vals):
            ax.text(v + top * 0.015, i, f"{v:.3g}" if v else "0 (reference)", va="center", fontsize=9,
                    bbox={"fc": "white", "ec": "none", "pad": 1})
        ax.set_xlabel(f"KL to {ref} (nats per token, held-out chats)")
        ax.set_title("Quality lost per engine (lower is better)\ndashed: edge-export plan's default bound, "
                     + (f"fp32 {base:.3g} + " if base else "") + f"--max-kl {DEFAULT_MAX_KL:g}", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        files.append(_save(fig, dst, "kl_per_engine.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = [n for n in names if "decode_tok_s" in eng[n]]
    ax.bar(names, [eng[n]["decode_tok_s"] for n in names], color="#4c72b0")
    ax.set_ylabel("decode speed (tokens/s, batch 1)")
    ax.set_xlabel("engine")
    ax.set_title("Decode speed per engine (this machine)")
    ax.tick_params(axis="x", labelrotation=20)
    for i, n in enumerate(names):
        ax.text(i, eng[n]["decode_tok_s"], f"{eng[n]['decode_tok_s']:.0f}", ha="center", va="bottom")
    ax.margins(y=0.12)
    files.append(_save(fig, dst, "tokens_per_second.png"))
    losses = (results.get("stages") or {}).get("distill", {}).get("losses")
    if losses:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        step = max(1, results["stages"]["distill"]["steps"] // len(losses))
        ax.plot([i * step for i in range(len(losses))], losses)
        ax.set_xlabel("training step")
        ax.set_ylabel("KD loss (KL x T², nats per token)")
        ax.set_title("Distillation loss")
        ax.grid(alpha=0.3)
        files.append(_save(fig, dst, "distill_loss.png"))
    return files


def write_report(results: dict, dst: Path) -> None:
    images = _plots(results, dst)
    head = ["engine"] + [c for _, c, _ in _columns(results)]
    rows = _rows(results)
    ref = "the fp32 teacher (the model before pruning)" if results.get("reference") == "teacher" else "the fp32 graph"
    stages = _stage_lines(results)
    scoring = _scoring_lines(results)
    ci = (" In brackets: the KL's 95% interval, a bootstrap over the texts." if any(
        "kl_ci95" in q for q in results["engines"].values()) else "")
    md = ["# EdgeChat export report", "",
          f"Held-out data: {results['data']} ({results['eval_chats']} chats)"
          + (f" and prose: {results['prose']['source']} ({results['prose']['texts']} held-out texts)" if results.get("prose") else "")
          + f". KL (the headline) and top-1 agreement are against {ref}, on the same token ids for every engine.{ci}", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ([""] + stages) if stages else []
    md += [""] + [f"![{i}]({i})" for i in images] + ["", "## Golden prompts (greedy)", ""]
    regressions = results.get("golden_regressions", [])
    if regressions:
        md += ["Golden prompts the fp32 graph passes and an engine fails:", ""]
        md += [f"- **{r['engine']}** fails \"{r['prompt']}\": {r['why']}" for r in regressions] + [""]
    elif results["golden"] and "golden_regressions" in results:
        md += ["Every engine passes every golden prompt the fp32 graph passes.", ""]
    for prompt, rows in _by_prompt(results["golden"]):
        md.append(f"- {prompt}")
        for g in rows:
            mark = "" if g["passed"] is None else (" ✅" if g["passed"] else " ❌")
            md.append(f"  - **{g['engine']}**{mark} {g['answer']}")
    abl = [n for n in results["engines"] if n.endswith("-no-smoothquant")]
    for n in abl:
        on, off = results["engines"][n.removesuffix("-no-smoothquant")], results["engines"][n]
        md += ["", f"SmoothQuant on vs off ({n.removesuffix('-no-smoothquant')}): perplexity {on['perplexity']:.3f} vs "
                   f"{off['perplexity']:.3f}, KL {on['kl_to_fp32']:.4f} vs {off['kl_to_fp32']:.4f}, top-1 "
                   f"{100 * on['top1_agreement']:.1f}% vs {100 * off['top1_agreement']:.1f}%"]
    if scoring:
        md += ["", "## How each engine was scored", ""] + [f"- {x}" for x in scoring]
    (dst / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    e = html.escape
    table = "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows) + "</table>"
    golden = "".join(f"<p><b>{e(r['engine'])}</b> fails “{e(r['prompt'])}”: {e(r['why'])}</p>" for r in regressions) + \
        "<ul>" + "".join(f"<li>{e(prompt)}<ul>" + "".join(
            f"<li><b>{e(g['engine'])}</b>{'' if g['passed'] is None else (' ✅' if g['passed'] else ' ❌')} <i>{e(g['answer'])}</i></li>"
            for g in rows) + "</ul></li>" for prompt, rows in _by_prompt(results["golden"])) + "</ul>"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>EdgeChat export report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:48%}}</style></head><body>
<h1>EdgeChat export report</h1><p>Held-out data: {e(results['data'])} ({results['eval_chats']} chats){
e(f" and prose: {results['prose']['source']} ({results['prose']['texts']} held-out texts)") if results.get("prose") else ""}.
KL (the headline) and top-1 agreement are measured against {e(ref)}, on the same token ids for every engine.{e(ci)}</p>{table}{''.join(f"<p>{e(x)}</p>" for x in stages)}
{''.join(f'<img src="{i}" alt="{i}">' for i in images)}<h2>Golden prompts (greedy)</h2>{golden}{
"<h2>How each engine was scored</h2><ul>" + "".join(f"<li>{e(x)}</li>" for x in scoring) + "</ul>" if scoring else ""}</body></html>"""
    (dst / "report.html").write_text(page, encoding="utf-8")
