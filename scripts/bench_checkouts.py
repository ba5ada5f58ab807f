"""Decode speed of two EdgeChat checkouts on the same bundle, interleaved: did a change slow the runtime down?

    python scripts/bench_checkouts.py OLD_DIR NEW_DIR BUNDLE [--engine int8-dynamic] [--rounds 5] [--tokens 128]

OLD_DIR / NEW_DIR are source trees (e.g. `git worktree add /tmp/old 5694bf0`); each round runs one fresh
process per checkout (A B, then B A next round, so neither always goes first), which loads the bundle with that
checkout's `edge` and times greedy answers through `Generator.stream` (the one decode loop; EOS ignored) after
a warm-up. Prints a table (tok/s per round, medians, new/old per round with its spread) and writes JSON.
These machines vary 10-30% run to run: read the per-round ratios, not one number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edge.device.probe import cpu_name  # noqa: E402

# run inside each checkout's process: both layouts (edge/generate.py before the four floors, edge/decode/ after)
PROBE = r'''
import json, sys, time
try:
    from edge.decode.generate import Generator
except ImportError:
    from edge.generate import Generator
from edge.bundle import Bundle
bundle, engine, tokens, answers, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
gen = Generator.from_bundle(Bundle.open(bundle), engine=engine, threads=threads)
ids = gen.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the history of the city of Kyoto, its "
                                  "temples and gardens, and why so many people like to visit it in the autumn months."}])
cfg = gen.sampling(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
rates = []
for r in range(answers + 1):
    first = None
    for ev in gen.stream(ids, cfg):  # the first event hands over the first token; the last carries the stats
        if first is None:
            first = time.perf_counter()
        last = ev
    t1 = time.perf_counter()
    n = last.stats["completion_tokens"]
    if r:  # the first answer warms up
        rates.append((n - 1) / (t1 - first))
print(json.dumps({"tok_s": sorted(rates)[len(rates) // 2], "tokens": n}))
'''


def run_one(checkout: Path, bundle: str, engine: str, tokens: int, answers: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    r = subprocess.run([sys.executable, "-c", PROBE, bundle, engine, str(tokens), str(answers), str(threads)],
                       capture_output=True, text=True, env=env, cwd=checkout, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{checkout}: the probe failed: {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("bundle")
    ap.add_argument("--engine", default="int8-dynamic")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--answers", type=int, default=3, help="timed answers per process (their median is its figure)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("bench-checkouts.json"))
    a = ap.parse_args()
    for d in (a.old, a.new):
        if not (d / "edge" / "bundle.py").is_file():
            ap.error(f"{d} is not an EdgeChat source tree (no edge/bundle.py)")
    if a.rounds < 1 or a.tokens < 2 or a.answers < 1:
        ap.error("--rounds and --answers must be >= 1, --tokens >= 2")
    rows = []
    for r in range(a.rounds):
        order = (("old", a.old), ("new", a.new)) if r % 2 == 0 else (("new", a.new), ("old", a.old))
        got = {}
        for name, d in order:
            got[name] = run_one(d, a.bundle, a.engine, a.tokens, a.answers, a.threads)["tok_s"]
            print(f"  round {r + 1}/{a.rounds} {name:<3} {got[name]:7.1f} tok/s", flush=True)
        rows.append({"round": r + 1, "old": got["old"], "new": got["new"], "ratio": got["new"] / got["old"]})
    ratios = [x["ratio"] for x in rows]
    summary = {"old_median": statistics.median(x["old"] for x in rows),
               "new_median": statistics.median(x["new"] for x in rows),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(f"\n{'round':>5} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8}")
    for x in rows:
        print(f"{x['round']:>5} {x['old']:>10.1f} {x['new']:>10.1f} {x['ratio']:>8.3f}")
    print(f"median {summary['old_median']:>9.1f} {summary['new_median']:>10.1f} {summary['ratio_median']:>8.3f} "
          f"(per round {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f})")
    out = {"script": "scripts/bench_checkouts.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()},
           "old": str(a.old), "new": str(a.new), "bundle": a.bundle, "engine": a.engine, "tokens": a.tokens,
           "threads": a.threads, "rounds": rows, "summary": summary}
    a.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
