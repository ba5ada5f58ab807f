"""Where the benchmark peers live (built by scripts/peers-setup.sh): llama.cpp's binaries and
onnxruntime-genai's venv. One place, read by bench_decode.py and bench_serve.py (so neither imports the other
for it)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(os.environ.get("EDGECHAT_CACHE", Path.home() / ".cache" / "edgechat"))
PEERS = Path(os.environ.get("EDGECHAT_PEERS", CACHE / "peers"))
LLAMA_BIN = Path(os.environ.get("EDGECHAT_LLAMA_BIN", PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"))
GENAI_PYTHON = Path(os.environ.get("EDGECHAT_GENAI_PYTHON", PEERS / "genai-venv" / "bin" / "python"))
