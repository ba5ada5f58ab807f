"""Which shape to prune to: a small measured sweep, each shape scored on held-out general prose.

Every shape keeps the same share of the teacher's parameters (--ratio); they differ in what is cut
(vocabulary, attention groups, hidden channels, depth; the MLP width is then solved). Each is pruned,
scored, distilled for the same short fixed number of steps on the same mixture, and scored again, in
bits per UTF-8 byte on export/prose.py's held-out "eval" documents (comparable across vocabularies).
Prints a table and writes JSON (docs/pruning.md quotes it).

    .venv/bin/python scripts/prune_sweep.py --steps 40 --json docs/bench/prune-sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

SHAPES = {  # name -> PruneOptions fields (besides the target ratio); run in this order
    "vocab24k-kv2": dict(vocab_size=24576, kv_groups=2),
    "vocab16k-kv3": dict(vocab_size=16384, kv_groups=3),
    "vocab24k-depth24": dict(vocab_size=24576, drop_layers=6),
    "vocab16k-kv2": dict(vocab_size=16384, kv_groups=2),
    "vocab24k-hidden480": dict(vocab_size=24576, hidden_ratio=480 / 576),
}


def prose_bpb(model_dir: Path, teacher_dir: Path, docs: int, window: int) -> float:
    """Bits per byte on the held-out prose, as the evaluate stage counts them: each document's first
    `window` teacher tokens, the same text in the model's own tokens, NLL over the bytes after the first token."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.load import chat_tokenizer
    from export.prose import bits_per_byte, prose_texts

    ref_tok, tok = chat_tokenizer(teacher_dir), chat_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, n_bytes = 0.0, 0
    with torch.no_grad():
        for text in prose_texts("eval")[:docs]:
            ref_ids = ref_tok.encode(text)[:window]
            piece = ref_tok.decode(ref_ids, skip_special_tokens=False)
            ids = tok.encode(piece)
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].double(), -1)
            nll -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            n_bytes += len(ref_tok.decode(ref_ids[1:], skip_special_tokens=False).encode("utf-8"))
    return bits_per_byte(nll, n_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.6, help="share of the teacher's parameters kept")
    ap.add_argument("--steps", type=int, default=40, help="distillation steps per shape (same for all)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from SHAPES")
    ap.add_argument("--docs", type=int, default=32, help="held-out prose documents scored")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prune-samples", type=int, default=128, help="calibration chats for importance")
    ap.add_argument("--prose-samples", type=int, default=64, help="prose train documents for importance")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/prune-sweep"))
    ap.add_argument("--json", type=Path, default=Path("docs/bench/prune-sweep.json"))
    a = ap.parse_args()

    import torch

    from export import distill, load, prune
    from export.distill import DistillOptions
    from export.model_source import resolve

    torch.set_num_threads(a.threads)
    teacher = a.work / "load"
    if not (teacher / "config.json").is_file():
        teacher.mkdir(parents=True, exist_ok=True)
        load.run(resolve("default"), teacher)
    dopts = DistillOptions(steps=a.steps, batch_size=4, seq_len=256, lr=5e-4, warmup=5, temperature=1.0,
                           mixture={"chat": 0.3, "prose": 0.7}, teacher_topk=64, threads=a.threads)
    rows = [{"shape": "teacher", "params": prune.count_params(_cfg(teacher)),
             "bpb_pruned": None, "bpb_distilled": prose_bpb(teacher, teacher, a.docs, a.window)}]
    t_bpb = rows[0]["bpb_distilled"]
    print(f"teacher: {t_bpb:.4f} bits per byte", flush=True)
    for name in a.shapes.split(","):
        t0 = time.perf_counter()
        d = a.work / name
        popts = prune.PruneOptions(target_ratio=a.ratio, samples=a.prune_samples, prose_samples=a.prose_samples, vocab_prose=True,
                                   **SHAPES[name])
        pm = prune.run(teacher, d / "pruned", popts)
        before = prose_bpb(d / "pruned", teacher, a.docs, a.window)
        dm = distill.run(teacher, d / "pruned", d / "distilled", dopts)
        after = prose_bpb(d / "distilled", teacher, a.docs, a.window)
        rows.append({"shape": name, "params": pm["params_after"], "ratio": pm["ratio"], "layers": pm["layers"],
                     "heads": pm["heads"], "hidden": pm["hidden"], "intermediate": pm["intermediate"],
                     "vocab": pm["vocab"], "bpb_pruned": before, "bpb_distilled": after,
                     "distill_tokens_per_s": dm["tokens_per_s"], "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name}: pruned {before:.4f}, distilled {after:.4f} ({after / t_bpb:.3f}x the teacher), "
              f"{pm['ratio']:.1%} of the parameters, {rows[-1]['seconds']:.0f} s", flush=True)
        save(a, dopts, rows)  # after every shape: a sweep cut short keeps what it measured
    print()
    print(table(rows, t_bpb, a.steps))


def save(a: argparse.Namespace, dopts, rows: list[dict]) -> None:
    from edge.device.probe import cpu_name

    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "script": "scripts/prune_sweep.py", "date": datetime.date.today().isoformat(), "machine": cpu_name(),
        "threads": a.threads, "ratio": a.ratio, "distill": {"steps": a.steps, "batch_size": 4, "seq_len": 256,
                                                            "mixture": dopts.mixture, "teacher_topk": 64, "temperature": 1.0},
        "prune": {"samples": a.prune_samples, "prose_samples": a.prose_samples, "vocab_prose": True},
        "prose_eval": {"docs": a.docs, "window": a.window}, "rows": rows}, indent=2) + "\n")


def table(rows: list[dict], t_bpb: float, steps: int) -> str:
    out = [f"| shape | params | MLP | heads (q/kv) | hidden | layers | vocab | bpb pruned | bpb after {steps} steps | x teacher |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["shape"] == "teacher":
            out.append(f"| teacher | {r['params'] / 1e6:.1f}M | 1536 | 9/3 | 576 | 30 | 49152 | - | {t_bpb:.3f} | 1.000 |")
            continue
        after = lambda k: r[k].split(" -> ")[1].split(" ")[0]  # noqa: E731
        out.append(f"| {r['shape']} | {r['params'] / 1e6:.1f}M ({r['ratio']:.0%}) | {after('intermediate')} | {after('heads')} "
                   f"| {after('hidden')} | {after('layers')} | {after('vocab')} | {r['bpb_pruned']:.3f} "
                   f"| {r['bpb_distilled']:.3f} | {r['bpb_distilled'] / t_bpb:.3f} |")
    return "\n".join(out)


def _cfg(d: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(d)


if __name__ == "__main__":
    main()
