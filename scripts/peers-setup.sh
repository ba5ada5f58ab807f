#!/usr/bin/env bash
# Make the peers scripts/bench_decode.py and scripts/bench_serve.py measure us against, reproducibly:
#   1. llama.cpp's own tools (llama-server, llama-bench, llama-quantize, llama-perplexity, llama-cli), built with
#      cmake from the llama.cpp source vendored in the llama-cpp-python 0.3.36 sdist (native CPU flags);
#   2. an onnxruntime-genai 0.18.0 venv (its model builder needs transformers 5, which our own venv cannot
#      have: optimum-onnx pins 4.57), with onnx_ir, onnxscript and the CPU torch wheel.
# Both live under $EDGECHAT_PEERS (default ~/.cache/edgechat/peers); a finished part is kept, not rebuilt.
# The benches find them there (or set EDGECHAT_LLAMA_BIN / EDGECHAT_GENAI_PYTHON).
#   bash scripts/peers-setup.sh            # both
#   bash scripts/peers-setup.sh llama      # or genai
set -euo pipefail
PEERS=${EDGECHAT_PEERS:-$HOME/.cache/edgechat/peers}
PY=${PYTHON:-python3}
LLAMA_PY_VERSION=0.3.36
GENAI_VERSION=0.18.0
what=${1:-all}
mkdir -p "$PEERS"

llama() {
  local src="$PEERS/llama_cpp_python-$LLAMA_PY_VERSION/vendor/llama.cpp"
  local bin="$src/build/bin"
  if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-quantize" ]; then
    echo "llama.cpp: $bin (already built)"; return
  fi
  if [ ! -d "$src" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_PY_VERSION" -d "$PEERS"
    tar -xzf "$PEERS/llama_cpp_python-$LLAMA_PY_VERSION.tar.gz" -C "$PEERS"
  fi
  command -v cmake >/dev/null || { echo "error: cmake is needed (apt-get install cmake, or pip install cmake)" >&2; exit 2; }
  echo "llama.cpp: building in $src/build (10-20 min on 2 cores)"
  (cd "$src" && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF >/dev/null \
    && cmake --build build -j"$(nproc)" --target llama-server llama-quantize llama-perplexity llama-cli llama-bench >/dev/null)
  echo "llama.cpp: $bin"
}

genai() {
  local venv="$PEERS/genai-venv"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import onnxruntime_genai, transformers, onnx_ir, onnxscript, torch" 2>/dev/null; then
    echo "onnxruntime-genai: $venv/bin/python (already made)"; return
  fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch: the same CPU wheel as our venv (pyproject pins it), so no CUDA wheels come in: pip finds it where
  # our venv's came from (here a local wheel folder; elsewhere set TORCH_INDEX=https://download.pytorch.org/whl/cpu).
  # genai 0.18 needs onnxruntime >= 1.31.
  "$venv/bin/python" -m pip install -q "torch==2.13.0+cpu" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
  "$venv/bin/python" -m pip install -q "onnxruntime-genai==$GENAI_VERSION" "onnxruntime>=1.31" "transformers>=5,<6" \
    onnx onnx_ir onnxscript "torch==2.13.0+cpu" numpy
  "$venv/bin/python" -c "import onnxruntime_genai as og, transformers as t; print('onnxruntime-genai', og.__version__, 'transformers', t.__version__)"
  echo "onnxruntime-genai: $venv/bin/python"
}

case "$what" in
  all) llama; genai ;;
  llama) llama ;;
  genai) genai ;;
  *) echo "usage: $0 [all|llama|genai]" >&2; exit 2 ;;
esac
