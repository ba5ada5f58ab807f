"""Runtime targets: the ONNX Runtime, TensorRT and cuda-python a user of each device actually has, as data
(`device_profiles/runtimes/targets.toml`, every fact with its source).

Why data: the right pins depend on the device's driver (CUDA 12 vs 13), its Python (JetPack 6 is 3.10) and
where TensorRT comes from (pip on x86, JetPack's apt on Jetson). `edge-export deploy` reads a target to
decide what to ship and what to check on the device before an engine build; the CI script
`scripts/resolve_device_requirements.py` proves each target's pins resolve for its platform with pip.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge.errors import ProfileError
from edge.device.profiles import profiles_dir

if TYPE_CHECKING:
    from edge.device.machine import Machine

KINDS = ("dgpu", "jetson", "cpu")
REQUIRED = ("description", "kind", "profiles", "platforms", "pythons", "onnxruntime", "onnxruntime_install")
REQUIRED_GPU = ("cuda_driver_major", "min_driver", "tensorrt", "tensorrt_from", "tensorrt_install",
                "tensorrt_wheels", "cuda_python")
TENSORRT_FROM = ("pip", "apt")


CUDA_PYTHON_ADVICE = ("pip install cuda-python (or pycuda) in the version the driver takes: 'cuda-python~=12.6.0' on "
                      "JetPack 6, 'cuda-python<13' on CUDA 12 drivers, 'cuda-python<14' on R580+ (docs/deploy.md)")


@dataclass(frozen=True)
class RuntimeTarget:
    """One runtime a device can have (e.g. JetPack 6: Python 3.10, CUDA 12.6, TensorRT 10.3 from apt)."""

    name: str
    description: str
    kind: str  # dgpu | jetson | cpu
    profiles: tuple[str, ...]  # device profiles it applies to
    platforms: tuple[str, ...]  # pip platform tags, e.g. manylinux_2_35_aarch64
    pythons: tuple[str, ...]  # "3.10", ...
    onnxruntime: tuple[str, ...]  # PEP 508 pins; empty: PyPI has none for this target
    onnxruntime_install: str  # what the user runs when the device has no ONNX Runtime
    cuda_driver_major: int | None = None
    min_driver: str | None = None
    tensorrt: str | None = None  # the TensorRT version users get ("10.3", or "10" for any 10.x)
    tensorrt_from: str | None = None  # pip | apt
    tensorrt_install: str | None = None
    tensorrt_wheels: tuple[str, ...] = ()  # the part of the TensorRT install that PyPI serves as wheels
    cuda_python: tuple[str, ...] = ()
    l4t_major: int | None = None  # Jetson: the R<major> of /etc/nv_tegra_release
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def arches(self) -> tuple[str, ...]:
        """Machine architectures of its platforms ('x86_64', 'aarch64')."""
        return tuple(dict.fromkeys(p.split("_", 3)[-1] for p in self.platforms))

    def requirements(self, python: str, arch: str, include_tensorrt: bool = True) -> list[str]:
        """This target's own pins (ONNX Runtime, cuda-python, TensorRT wheels) for one Python and arch,
        markers evaluated and removed."""
        return self.pins((*self.onnxruntime, *self.cuda_python, *(self.tensorrt_wheels if include_tensorrt else ())),
                         python, arch)

    @staticmethod
    def pins(texts: tuple[str, ...], python: str, arch: str) -> list[str]:
        """PEP 508 strings whose markers hold for this Python and arch on Linux, markers removed."""
        from packaging.markers import default_environment  # noqa: PLC0415
        from packaging.requirements import Requirement  # noqa: PLC0415

        env = default_environment() | {"python_version": ".".join(python.split(".")[:2]),
                                       "python_full_version": python if python.count(".") == 2 else python + ".0",
                                       "platform_machine": arch, "sys_platform": "linux", "extra": ""}
        out = []
        for text in texts:
            r = Requirement(text)
            if r.marker is None or r.marker.evaluate(env):
                r.marker = None
                out.append(str(r))
        return out


def targets_path(override: str | os.PathLike | None = None) -> Path:
    return Path(override) if override else profiles_dir() / "runtimes" / "targets.toml"


def load_targets(path: str | os.PathLike | None = None) -> dict[str, RuntimeTarget]:
    """Every runtime target, validated: a fact without a source or a missing fact is refused by name."""
    p = targets_path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"runtime targets file {p} not found (reinstall edgechat, or pass --targets FILE)") from None
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"runtime targets file {p} is not valid TOML: {e}") from None
    out = {}
    for name, table in raw.get("targets", {}).items():
        facts, sources = _split(table, p, name)
        need = REQUIRED + (REQUIRED_GPU if facts.get("kind") in ("dgpu", "jetson") else ())
        if facts.get("kind") == "jetson":
            need += ("l4t_major",)
        missing = [k for k in need if k not in facts]
        if missing:
            raise ProfileError(f"{p}: target '{name}' lacks {', '.join(missing)}")
        if facts["kind"] not in KINDS:
            raise ProfileError(f"{p}: target '{name}': kind must be one of {KINDS}, got {facts['kind']!r}")
        if facts.get("tensorrt_from") not in (None, *TENSORRT_FROM):
            raise ProfileError(f"{p}: target '{name}': tensorrt_from must be one of {TENSORRT_FROM}")
        tuples = {k: tuple(v) for k, v in facts.items() if isinstance(v, list)}
        out[name] = RuntimeTarget(name=name, sources=sources, **(facts | tuples))
    if not out:
        raise ProfileError(f"{p} defines no [targets.NAME] tables")
    return out


def _split(table: dict, path: Path, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    facts: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, val in table.items():
        if not (isinstance(val, dict) and "value" in val and isinstance(val.get("source"), str) and val["source"].strip()):
            raise ProfileError(f"{path}: targets.{name}.{key} must be {{ value = ..., source = \"...\" }}")
        if key not in RuntimeTarget.__dataclass_fields__ or key in ("name", "sources"):
            raise ProfileError(f"{path}: targets.{name}.{key} is not a runtime target fact")
        facts[key] = val["value"]
        sources[key] = val["source"]
    return facts, sources


def driver_major(driver: str | None) -> int | None:
    """CUDA major a Linux driver version supports: R580+ runs CUDA 13, R525+ CUDA 12 (CUDA release notes)."""
    try:
        branch = int(str(driver).split(".")[0])
    except ValueError:
        return None
    return 13 if branch >= 580 else 12 if branch >= 525 else 11


def target_for(kind: str, l4t: str | None = None, driver: str | None = None, has_gpu: bool = False,
               targets: dict[str, RuntimeTarget] | None = None) -> RuntimeTarget | None:
    """The target a machine is on: a Jetson by its L4T major, an x86 GPU by its driver's CUDA major,
    anything without a GPU the CPU target. None when no target fits (e.g. JetPack 5, a driver too old)."""
    ts = targets if targets is not None else load_targets()
    if kind == "jetson":
        major = int(l4t.split(".")[0]) if l4t and l4t.split(".")[0].isdigit() else None
        return next((t for t in ts.values() if t.kind == "jetson" and t.l4t_major == major), None)
    if has_gpu:
        cuda = driver_major(driver)
        if cuda is None:  # driver not read: the CUDA 12 set runs on CUDA 12 and 13 drivers alike
            cuda = 12
        fits = [t for t in ts.values() if t.kind == "dgpu" and t.cuda_driver_major == cuda]
        return fits[0] if fits else None
    return next((t for t in ts.values() if t.kind == "cpu"), None)


def target_of(m: Machine, targets: dict[str, RuntimeTarget] | None = None) -> RuntimeTarget | None:
    """The runtime target of a probed machine (see target_for)."""
    kind = "jetson" if m.jetson else "dgpu" if m.has_gpu else "cpu"
    return target_for(kind, m.l4t, m.driver, m.has_gpu, targets)


@dataclass(frozen=True)
class RuntimeVerdict:
    """What can serve the bundle on a device, and what the user must install when nothing can."""

    engine: bool  # a TensorRT engine can be built and run there
    onnxruntime: bool
    notes: tuple[str, ...]  # one line per component, for the deploy log
    to_install: tuple[str, ...]  # exact instructions, in the order they help

    @property
    def must_stop(self) -> bool:
        """Something the user must install first: nothing can serve, or TensorRT is there but CUDA won't open."""
        return bool(self.to_install)


def judge(target: RuntimeTarget | None, facts: dict[str, Any], has_gpu: bool, python: str, arch: str) -> RuntimeVerdict:
    """Decide from the device's facts (edge/device/probe.py, or the deploy's device check) whether TensorRT or ONNX
    Runtime can serve, before any engine is built. facts: tensorrt / tensorrt_error, cuda_python /
    cuda_error / cuda_driver (cuDriverGetVersion, e.g. 12060; None when not asked), onnxruntime."""
    notes, todo = [], []
    trt = facts.get("tensorrt")
    major = str(trt).split(".")[0] if trt else ""
    trt_ok = major.isdigit() and int(major) >= 10
    want_trt = target is not None and target.kind != "cpu"
    if trt and not trt_ok:
        notes.append(f"TensorRT {trt}: EdgeChat builds engines with TensorRT 10 or newer")
    elif trt:
        notes.append(f"TensorRT {trt} (python)")
    elif want_trt:
        notes.append(f"no TensorRT Python bindings ({facts.get('tensorrt_error') or 'import tensorrt failed'})")
    cuda_ok = True
    if trt_ok and has_gpu and "cuda_driver" in facts:
        drv, need = facts.get("cuda_driver"), (target.cuda_driver_major if target else None)
        if facts.get("cuda_error") or not facts.get("cuda_python"):
            cuda_ok = False
            notes.append(f"CUDA does not open with cuda-python {facts.get('cuda_python') or '(not importable)'}: "
                         f"{facts.get('cuda_error') or 'no cuda-python'}")
            if target:
                todo.append(f"pip install \"{' '.join(target.cuda_python)}\" (the cuda-python CUDA {target.cuda_driver_major} "
                            f"drivers take; this release ships it, so if that one fails, check the driver is "
                            f"{target.min_driver} or newer)")
            else:
                todo.append("pip install the cuda-python whose major is the driver's CUDA major (nvidia-smi)")
        elif need and drv and int(drv) // 1000 < need:
            cuda_ok = False
            notes.append(f"the driver runs CUDA {int(drv) // 1000}.{int(drv) % 1000 // 10}, but this target needs "
                         f"CUDA {need} (driver {target.min_driver if target else '?'} or newer)")
            todo.append(f"update the driver to {target.min_driver if target else 'a newer one'} or newer")
        else:
            ver = f"{int(drv) // 1000}.{int(drv) % 1000 // 10}" if drv else "version not read"
            notes.append(f"cuda-python {facts['cuda_python']} opens CUDA (driver {ver})")
    engine = trt_ok and cuda_ok and has_gpu
    ort = facts.get("onnxruntime")
    notes.append(f"onnxruntime {ort}" if ort else "no ONNX Runtime")
    if not engine and not ort:
        if want_trt and not trt_ok and target and target.tensorrt_install:
            todo.append(f"{target.tensorrt_install}   # TensorRT {target.tensorrt}'s Python bindings: EdgeChat builds "
                        "the engine on the device")
        if target is not None:
            todo.append(target.onnxruntime_install)
        else:
            todo.append(f"pip install onnxruntime (no EdgeChat runtime target fits this {arch} / Python {python} "
                        "machine: see docs/deploy.md)")
    return RuntimeVerdict(engine=engine, onnxruntime=bool(ort), notes=tuple(notes), to_install=tuple(todo))
