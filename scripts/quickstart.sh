#!/usr/bin/env bash
# A newcomer's first run: set up, plan the default model (SmolLM2-135M-Instruct) for a Jetson Orin Nano, build
# the one engine the plan recommends into a bundle with its report (fp32 measured beside it as the reference),
# and ask it a question. Extra arguments go to `edge-export build` (-q: no progress lines, -v: everything).
# The full recipe (fp32, fp16, int8-dynamic, int8-qdq, int4-weight; README says how long it takes):
#   .venv/bin/edge-export build --recipe recipes/smollm2-int8.toml -o smollm2.bundle
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=orin-nano-8gb
bash scripts/setup.sh
.venv/bin/edge-export plan --target "$TARGET"
# the plan's recommendation, as JSON: the precision and the build flags it needs (int4's block size, say)
REC=$(.venv/bin/edge-export plan --target "$TARGET" --json | .venv/bin/python -c '
import json, sys
rec = json.load(sys.stdin)["recommendation"]
if not rec["precision"]:
    sys.exit("the plan recommends nothing for this target: " + rec["reason"])
print(rec["precision"], rec.get("build_flags") or "")')
read -r PRECISION FLAGS <<< "$REC"
echo "building the plan's recommendation: $PRECISION $FLAGS"
# shellcheck disable=SC2086  # FLAGS is a list of flags
.venv/bin/edge-export build --recipe recipes/smollm2-int8.toml --precision "$PRECISION" $FLAGS -o smollm2.bundle "$@"
.venv/bin/edge-chat run smollm2.bundle "What is the capital of Japan?" --stats
echo "report: smollm2.bundle/report/report.html"
