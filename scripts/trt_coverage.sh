#!/usr/bin/env bash
# Coverage of the TensorRT/CUDA modules by the fast tier's TensorRT tests (against the TensorRT stand-in,
# tests/fake_tensorrt): a line table, then every function never entered. Exits 1 if there is one.
# Run by .ci/run after the tests; ~40 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
MODULES=(edge.backends.tensorrt.builder edge.backends.tensorrt.runtime edge.backends.tensorrt.settings edge.backends.tensorrt.cuda_mem edge.backends.choose export.trt_compat)
export COVERAGE_FILE=.coverage.tensorrt
.venv/bin/python -m pytest -p no:cacheprovider -q -m "not slow" -W ignore tests/test_tensorrt.py \
  tests/test_tensorrt_engine.py tests/test_tensorrt_runtime.py "${MODULES[@]/#/--cov=}" --cov-report=term-missing --cov-report=json:.coverage.tensorrt.json
exec .venv/bin/python - <<'PY'
import json, sys
files = json.load(open(".coverage.tensorrt.json"))["files"]
never = [f"{path}: {name}" for path, v in sorted(files.items()) for name, fn in v["functions"].items()
         if name and fn["summary"]["num_statements"] and not fn["summary"]["covered_lines"]]
total = sum(1 for v in files.values() for name in v["functions"] if name)
print(f"functions entered: {total - len(never)}/{total} in {len(files)} TensorRT/CUDA modules")
for line in never:
    print(f"  never entered: {line}")
sys.exit(1 if never else 0)
PY
