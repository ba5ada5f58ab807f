#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check.py): ONNX Runtime CUDA EP decode of the fp32 and int8 graphs
# with greedy parity against CPU and tok/s; one AMP distillation step on CUDA against CPU; TensorRT build +
# decode if tensorrt imports. Writes one JSON (default gpu_check.json). Meant to finish in under 8 minutes.
#
#   bash scripts/gpu_check.sh [--bundle B] [--out F]      # WHEELS=/path/to/wheels to install offline from there
#
# Uses .venv if there is one (scripts/setup.sh), else makes it. On a GPU machine the pinned onnxruntime-gpu
# replaces onnxruntime (never both; the CPU build is removed only once the GPU wheels are fetched) and
# cuda-python comes with it; tensorrt is installed only if a wheel for it is
# in $WHEELS (its PyPI package fetches from NVIDIA's index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
.venv/bin/python -c "import edge, export, torch" 2>/dev/null || "${PIP[@]}" -e ".[export,dev]"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1 | cut -d. -f1)
  if ! .venv/bin/python -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    # the pinned GPU set for this driver (pyproject [gpu] = CUDA 12, [gpu-cuda13] = R580+). onnxruntime and
    # onnxruntime-gpu write the same module folder, so: fetch the GPU wheels first, and only once they are
    # here remove the CPU build and install them; if that install fails, put the CPU build back, so the
    # check never ends with no ONNX Runtime at all.
    extra=gpu; [ "${drv:-0}" -ge 580 ] && extra=gpu-cuda13
    mapfile -t gpu_reqs < <(.venv/bin/python -c "import sys, tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))" "$extra")
    cpu_ort=$(.venv/bin/python -c "from importlib.metadata import version as v; print(v('onnxruntime'))" 2>/dev/null || true)
    gpu_wheels=$(mktemp -d)
    DL=(.venv/bin/python -m pip download -q -d "$gpu_wheels")
    if [ -n "${WHEELS:-}" ]; then DL+=(--no-index --find-links "$WHEELS"); fi
    if "${DL[@]}" "${gpu_reqs[@]}"; then
      .venv/bin/python -m pip uninstall -y -q onnxruntime onnxruntime-gpu 2>/dev/null || true
      if ! .venv/bin/python -m pip install -q --no-index --find-links "$gpu_wheels" "${gpu_reqs[@]}"; then
        echo "gpu_check: the GPU ONNX Runtime did not install; putting onnxruntime ${cpu_ort:-1.32.0} (CPU) back" >&2
        "${PIP[@]}" "onnxruntime==${cpu_ort:-1.32.0}"
      fi
    else
      echo "gpu_check: could not fetch ${gpu_reqs[*]} (pyproject [$extra], driver $drv); keeping the CPU onnxruntime" >&2
    fi
    rm -rf "$gpu_wheels"
  fi
  if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/tensorrt* >/dev/null 2>&1; then
    trt="tensorrt-cu12>=10.8,<11"; [ "${drv:-0}" -ge 580 ] && trt="tensorrt-cu13>=10.13,<11"   # pyproject [tensorrt-cu12/13]
    "${PIP[@]}" "$trt" || echo "gpu_check: tensorrt not installed from $WHEELS" >&2
  fi
fi
exec timeout 480 .venv/bin/python scripts/gpu_check.py "$@"
