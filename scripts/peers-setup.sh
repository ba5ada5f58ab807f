#!/usr/bin/env bash
# Make the peers scripts/bench_decode.py and scripts/bench_serve.py measure us against, reproducibly:
#   1. llama.cpp's own tools (llama-server, llama-bench, llama-quantize, llama-perplexity, llama-cli), built with
#      cmake from the llama.cpp source vendored in the llama-cpp-python 0.3.36 sdist, with the instruction sets
#      /proc/cpuinfo lists except AMX (a VM may list AMX and still fault on its first tile instruction: the
#      2-core Xeon VM did, so -march=native builds died with SIGILL/SIGSEGV; EDGECHAT_LLAMA_NATIVE=1 builds native);
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

cpu_flags() {  # cmake flags: the x86 instruction sets this CPU lists, AMX left out (see the header)
  if [ "${EDGECHAT_LLAMA_NATIVE:-0}" = 1 ] || [ "$(uname -m)" != x86_64 ]; then echo "-DGGML_NATIVE=ON"; return; fi
  local have; have=$(grep -m1 '^flags' /proc/cpuinfo)
  local out="-DGGML_NATIVE=OFF" f opt
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512vbmi:AVX512_VBMI \
           avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    opt=${f#*:}
    if grep -qw "${f%%:*}" <<<"$have"; then out="$out -DGGML_$opt=ON"; else out="$out -DGGML_$opt=OFF"; fi
  done
  echo "$out"
}

llama() {
  local src="$PEERS/llama_cpp_python-$LLAMA_PY_VERSION/vendor/llama.cpp"
  local bin="$src/build/bin"
  local flags; flags=$(cpu_flags)
  if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-quantize" ] \
      && [ "$(cat "$src/build/edgechat-flags" 2>/dev/null)" = "$flags" ]; then
    echo "llama.cpp: $bin (already built: $flags)"; return
  fi
  if [ ! -d "$src" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_PY_VERSION" -d "$PEERS"
    tar -xzf "$PEERS/llama_cpp_python-$LLAMA_PY_VERSION.tar.gz" -C "$PEERS"
  fi
  command -v cmake >/dev/null || { echo "error: cmake is needed (apt-get install cmake, or pip install cmake)" >&2; exit 2; }
  local log="$PEERS/llama-build.log"
  echo "llama.cpp: building in $src/build (10-20 min on 2 cores; $flags; compiler output in $log)"
  rm -rf "$src/build"
  # shellcheck disable=SC2086
  if ! (cd "$src" && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF $flags -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
        && cmake --build build -j"$(nproc)" --target llama-server llama-quantize llama-perplexity llama-cli llama-bench) \
        >"$log" 2>&1; then
    tail -20 "$log" >&2; echo "error: the llama.cpp build failed (whole output: $log)" >&2; exit 1
  fi
  echo "$flags" > "$src/build/edgechat-flags"
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
