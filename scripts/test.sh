#!/usr/bin/env bash
# Set up and run every test (fast tier on tiny models + slow tier on the real default model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
bash scripts/typecheck.sh   # mypy: the TensorRT/CUDA modules against TensorRT's type stubs
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
