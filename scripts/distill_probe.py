"""Distill one pruned student with other [distill] options and score it on held-out prose: a short probe.

Reads a pruned build's work folder (load/, prune/, teacher-answers/ as `edge-export build` left them),
takes the recipe's [distill] section, overrides what --set names, distills for --steps into a scratch
folder and prints bits per UTF-8 byte on the held-out prose (export/prose.py's "eval" documents, each
document's first 512 teacher tokens up to 4096, as the evaluate stage counts them) beside the teacher's.
Several --set groups run one after another on the same inputs, so the rows compare.

    .venv/bin/python scripts/distill_probe.py --work smollm2-pruned.bundle.work \\
        --recipe recipes/smollm2-orin-nano-pruned.toml --steps 60 --set lr=5e-4 --set lr=1e-3
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import re
import shutil
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_set(text: str) -> dict:
    out = {}
    for part in filter(None, re.split(r",(?=\s*\w+\s*=)", text)):  # commas inside a JSON value stay
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--set takes key=value[,key=value], got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a pruned build's work folder (load/, prune/, teacher-answers/)")
    ap.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-orin-nano-pruned.toml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", type=parse_set, action="append", default=None, dest="sets",
                    help="DistillOptions overrides, key=value[,key=value]; repeat for more rows")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/distill-probe"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    for sub in ("load", "prune"):
        if not (a.work / sub / "config.json").is_file():
            ap.error(f"{a.work / sub} is not a stage output (no config.json): pass the build's work folder")
    if not a.recipe.is_file():
        ap.error(f"no recipe at {a.recipe}")

    from edge.errors import RecipeError
    from export.distill import DistillOptions, run
    from export.evaluate import prose_windows
    from export.load import chat_tokenizer
    from export.prose import prose_texts
    from prune_sweep import prose_bpb

    base = tomllib.loads(a.recipe.read_text()).get("distill", {})
    teacher, student = a.work / "load", a.work / "prune"
    answers = a.work / "teacher-answers" / "answers.jsonl"
    options = []
    for over in a.sets or [{}]:  # every row's options checked before anything runs
        try:
            options.append((over, DistillOptions(**(base | {"steps": a.steps, "max_minutes": None} | over))))
        except (TypeError, RecipeError) as e:  # an unknown key, a bad value
            ap.error(f"--set {over}: {e}")
    docs = len(prose_windows(chat_tokenizer(teacher), prose_texts("eval"), 512, 4096))
    rows = [{"name": "teacher", "bits_per_byte": prose_bpb(teacher, teacher, docs, 512)},
            {"name": "pruned only", "bits_per_byte": prose_bpb(student, teacher, docs, 512)}]
    for over, opts in options:
        dst = a.scratch / "student"
        shutil.rmtree(dst, ignore_errors=True)  # only what this script writes there
        t0 = time.time()
        rec = run(teacher, student, dst, dataclasses.replace(opts, checkpoint_every=10**6),
                  answers=answers if answers.is_file() else None)
        bpb = prose_bpb(dst, teacher, docs, 512)
        rows.append({"name": json.dumps(over) if over else "the recipe", "bits_per_byte": bpb, "minutes": round((time.time() - t0) / 60, 1),
                     "loss_first": rec["loss_first"], "loss_last": rec["loss_last"], "tokens_per_s": rec["tokens_per_s"],
                     "weights_sha256": rec["weights_sha256"]})
        print(json.dumps(rows[-1]), flush=True)
    t = rows[0]["bits_per_byte"]
    print(f"\n{'row':40s} {'bpb':>7s} {'x teacher':>9s}")
    for r in rows:
        print(f"{r['name'][:40]:40s} {r['bits_per_byte']:7.3f} {r['bits_per_byte'] / t:9.3f}")
    if a.json:
        a.json.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                                      "machine": platform.processor() or platform.machine(), "steps": a.steps,
                                      "recipe": str(a.recipe), "prose_docs": docs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
