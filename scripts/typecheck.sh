#!/usr/bin/env bash
# mypy over the TensorRT and CUDA modules against TensorRT's published type stubs (tensorrt-stubs, 10.x),
# so a wrong TensorRT method name, argument or enum fails CI here, where TensorRT cannot be installed.
#
# The stubs go into .typing/stubs, NOT into .venv: the wheel ships tensorrt/__init__.pyi with no
# __init__.py, so inside the venv `import tensorrt` would succeed as an empty namespace package and
# every "is TensorRT installed" check would say yes. They are installed with --no-deps because the
# wheel requires tensorrt==10.13 itself, whose pip package fetches from NVIDIA's index. Two lines of
# the generated stub are not valid Python (a parameter named `in`, a required parameter after a
# defaulted one); they are patched after install.
set -euo pipefail
cd "$(dirname "$0")/.."
STUBS=.typing/stubs
VERSION=10.13.0.35.1
if [ ! -f "$STUBS/.patched-$VERSION" ]; then
  rm -rf "$STUBS"
  .venv/bin/python -m pip install -q --no-deps --target "$STUBS" "tensorrt-stubs==$VERSION"
  .venv/bin/python - "$STUBS/tensorrt_bindings/tensorrt.pyi" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p, encoding="utf-8").read()
s = re.sub(r"\((self(?:: \w+)?), in: ", r"(\1, in_: ", s)
s = s.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
open(p, "w", encoding="utf-8").write(s)
PY
  touch "$STUBS/.patched-$VERSION"
fi
MYPYPATH="$STUBS" exec .venv/bin/python -m mypy --config-file pyproject.toml
