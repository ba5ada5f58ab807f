"""Device profiles: one TOML file per target device, every fact with its source.

The planner, the engine builder and the runtime read device facts only from
here. Profiles ship inside the wheel as `edge/device_profiles/` (mapped at build
time from the top-level `device_profiles/` folder); in a source checkout they are
read from that folder. `EDGECHAT_PROFILES` or an explicit path overrides both.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge.errors import ProfileError
from edge.precisions import BF16, FP8, FP32, INT8_DYNAMIC, INT8_QDQ

KINDS = ("dgpu", "jetson", "cpu")
REQUIRED = (
    "display_name", "kind", "compute_capability", "memory_gb", "usable_memory_gb", "unified_memory",
    "memory_bandwidth_gbs", "peak_tflops_fp32", "peak_tflops_fp16", "peak_tops_int8", "precisions",
    "tensorrt_versions", "cuda_version", "build_on_device", "host_ram_gb", "runtime_overhead_gb",
    "power_modes", "cpu_cores", "max_batch", "max_context",
)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    mode: str | None
    facts: dict[str, Any]
    sources: dict[str, str]
    path: Path
    modes: tuple[str, ...] = field(default_factory=tuple)

    def __getattr__(self, key: str) -> Any:  # profile.memory_gb etc.
        facts = object.__getattribute__(self, "facts")
        if key in facts:
            return facts[key]
        raise AttributeError(key)

    @property
    def id(self) -> str:
        return f"{self.name}@{self.mode}" if self.mode else self.name

    @property
    def is_gpu(self) -> bool:
        return self.facts["kind"] in ("dgpu", "jetson")

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s (or OP/s) for the math a precision runs on."""
        f = self.facts
        if precision in (INT8_QDQ,) and f.get("peak_tops_int8"):
            return f["peak_tops_int8"] * 1e12
        if precision == FP8 and f.get("peak_tflops_fp8"):
            return f["peak_tflops_fp8"] * 1e12
        if precision == FP32:
            return f["peak_tflops_fp32"] * 1e12
        # fp16/bf16 and weight-only quantization compute in fp16 on GPUs
        if self.is_gpu:
            return f.get("peak_tflops_bf16" if precision == BF16 else "peak_tflops_fp16", f["peak_tflops_fp16"]) * 1e12
        if precision == INT8_DYNAMIC:
            return f["peak_tops_int8"] * 1e12
        return f["peak_tflops_fp32"] * 1e12

    def supports(self, precision: str) -> bool:
        return precision in self.facts["precisions"]


def profiles_dir(override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override)
    if env := os.environ.get("EDGECHAT_PROFILES"):
        return Path(env)
    packaged = resources.files("edge").joinpath("device_profiles")
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "device_profiles"
    if checkout.is_dir():
        return checkout
    raise ProfileError("device profiles not found: reinstall edgechat, or set EDGECHAT_PROFILES to a folder of .toml profiles")


def available(directory: str | os.PathLike | None = None) -> list[str]:
    return sorted(p.stem for p in profiles_dir(directory).glob("*.toml"))


def load_profile(target: str, directory: str | os.PathLike | None = None) -> DeviceProfile:
    """Load `name` or `name@mode` (e.g. `orin-nano-8gb@super`), or a path to a .toml file."""
    name, _, mode = target.partition("@")
    path = Path(name)
    if path.suffix != ".toml":
        path = profiles_dir(directory) / f"{name}.toml"
    if not path.is_file():
        raise ProfileError(
            f"unknown target device '{name}': choose one of {', '.join(available(directory))} "
            "(or pass a path to a profile .toml)"
        )
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"device profile {path} is not valid TOML: {e}") from None
    facts, sources = _split(raw, path)
    missing = [k for k in REQUIRED if k not in facts]
    if missing:
        raise ProfileError(f"device profile {path} lacks {', '.join(missing)}")
    if facts["kind"] not in KINDS:
        raise ProfileError(f"device profile {path}: kind must be one of {KINDS}, got {facts['kind']!r}")
    modes = raw.get("modes", {})
    if mode:
        if mode not in modes:
            have = ", ".join(modes) or "none"
            raise ProfileError(f"device '{name}' has no power mode '{mode}' (modes: {have})")
        mfacts, msources = _split(modes[mode], path, prefix=f"modes.{mode}.")
        facts.update(mfacts)
        sources.update(msources)
    return DeviceProfile(raw.get("name", path.stem), mode or None, facts, sources, path, tuple(modes))


def _split(table: dict, path: Path, prefix: str = "") -> tuple[dict, dict]:
    facts: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, val in table.items():
        if key in ("name", "modes"):
            continue
        if not (isinstance(val, dict) and "value" in val and isinstance(val.get("source"), str) and val["source"].strip()):
            raise ProfileError(f"device profile {path}: fact '{prefix}{key}' must be {{ value = ..., source = \"...\" }}")
        facts[key] = val["value"]
        sources[key] = val["source"]
    return facts, sources
