"""Will a build fit this workstation's RAM? Answered before any stage starts, from measured peaks.

The export stage is a build's peak: PyTorch traces the fp32 model into an ONNX graph (optimum's
exporter holds the model and the graph's weights at once), then the parity check runs it. Weight-only
quantization streams one tensor at a time and stays near 1x; the load stage ~1.6x. Measured on this
project's 2-core workstation (stage records of real builds, see docs/models.md):
Qwen2.5-Coder-0.5B (2.52 GB fp32): export 7.2 GB = 2.86x; a 2.35 GB-fp32 random Llama (tests/test_large_model.py)
and Qwen2.5-Coder-1.5B are recorded there too. The factor below is the largest ratio seen, rounded up.
"""

from __future__ import annotations

from pathlib import Path

from edge.bundle import ModelDims
from edge.errors import RecipeError

PEAK_PER_FP32_BYTE = 3.0  # peak resident memory / fp32 weight bytes, the export stage (measured, see above)
BASE_BYTES = 1.0e9  # the interpreter, torch, transformers and ONNX Runtime themselves


def build_peak_bytes(dims: ModelDims) -> float:
    return PEAK_PER_FP32_BYTE * 4 * dims.num_parameters + BASE_BYTES


def machine_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def largest_buildable(ram: float) -> float:
    """Parameters of the largest model whose build fits `ram` bytes."""
    return max(0.0, (ram - BASE_BYTES) / (PEAK_PER_FP32_BYTE * 4))


def check_fits(dims: ModelDims, name: str, ram: int | None = None) -> dict:
    """Raise a RecipeError before a build that would run out of memory; else the figures it checked."""
    ram = machine_ram_bytes() if ram is None else ram
    need = build_peak_bytes(dims)
    if ram is not None and need > ram:
        raise RecipeError(
            f"building {name} ({dims.num_parameters / 1e9:.2f}B parameters, {4 * dims.num_parameters / 1e9:.1f} GB in "
            f"fp32) needs about {need / 1e9:.1f} GB of RAM at its peak (the export stage: ~{PEAK_PER_FP32_BYTE:g}x the "
            f"fp32 weights, measured), and this machine has {ram / 1e9:.1f} GB: it builds models up to about "
            f"{largest_buildable(ram) / 1e9:.2f}B parameters. Build on a machine with at least {need / 1e9:.0f} GB "
            "(the bundle then runs on the device as planned), or pass --skip-ram-check to try anyway")
    return {"planned_peak_bytes": need, "machine_ram_bytes": ram}
