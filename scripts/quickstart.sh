#!/usr/bin/env bash
# Set up, build the default model (SmolLM2-135M-Instruct) into a bundle with fp32 + INT8, and ask it a question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/edge-export plan --target orin-nano-8gb
.venv/bin/edge-export build --recipe recipes/smollm2-int8.toml -o smollm2.bundle "$@"
.venv/bin/edge-chat run smollm2.bundle "What is the capital of Japan?" --stats
echo "report: smollm2.bundle/report/report.html"
