#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check.py): ONNX Runtime CUDA EP decode of the fp32 and int8 graphs
# with greedy parity against CPU and tok/s; one AMP distillation step on CUDA against CPU; TensorRT build +
# decode if tensorrt imports. Writes one JSON (default gpu_check.json). Meant to finish in under 8 minutes.
#
#   bash scripts/gpu_check.sh [--bundle B] [--out F]      # WHEELS=/path/to/wheels to install offline from there
#
# Uses .venv if there is one (scripts/setup.sh), else makes it. On a GPU machine onnxruntime-gpu replaces
# onnxruntime (never both) and cuda-python comes with it; tensorrt is installed only if a wheel for it is
# in $WHEELS (its PyPI package fetches from NVIDIA's index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
.venv/bin/python -c "import edge, export, torch" 2>/dev/null || "${PIP[@]}" -e ".[export,dev]"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  if ! .venv/bin/python -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    .venv/bin/python -m pip uninstall -y -q onnxruntime onnxruntime-gpu 2>/dev/null || true
    "${PIP[@]}" "onnxruntime-gpu==1.32.0" "cuda-python>=12.6" || echo "gpu_check: onnxruntime-gpu not installed" >&2
  fi
  if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/tensorrt* >/dev/null 2>&1; then
    "${PIP[@]}" tensorrt || echo "gpu_check: tensorrt not installed from $WHEELS" >&2
  fi
fi
exec timeout 480 .venv/bin/python scripts/gpu_check.py "$@"
