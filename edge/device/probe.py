"""What this machine has, as raw facts: architecture, Jetson identity files, memory, disk, TensorRT,
CUDA, GPU, ONNX Runtime, Python. Standard library only and no EdgeChat imports, so that
`edge-export deploy` can pipe this very file into `python3 -` on a device that has nothing installed
yet. `edge/device/machine.py` interprets the facts with the device profiles.

    python3 edge/device/probe.py [INSTALL_ROOT]      # prints one JSON object

`EDGECHAT_DEVICE_ROOT` (default "/") is where the identity files are read from; tests point it at a
folder with a fake /etc/nv_tegra_release and device-tree model. Everything else is the real machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "replace").replace("\x00", "").strip()
    except OSError:
        return None


def cpu_name(root: Path = Path("/")) -> str:
    """The CPU's model name, for the machine line of a benchmark's report."""
    import platform

    for line in (_read(root / "proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags(root: Path = Path("/")) -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features` in /proc/cpuinfo); empty where unreadable.
    ONNX Runtime picks its kernels by them, and some kernels' results depend on the batch size."""
    text = _read(root / "proc/cpuinfo") or ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    return flags


def _meminfo(root: Path) -> dict[str, int]:
    out = {}
    for line in (_read(root / "proc/meminfo") or _read(Path("/proc/meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "SwapFree") and rest.split():
            out[key] = int(rest.split()[0]) * 1024
    return out


def mem_total_bytes(root: Path = Path("/")) -> int | None:
    """This machine's RAM (MemTotal), or None where /proc/meminfo cannot be read."""
    return _meminfo(root).get("MemTotal")


def _importable(name: str) -> bool:
    """Whether `import name` could find the module; False (never an exception) when a finder refuses it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _dist_version(*names: str) -> str | None:
    """Installed version of the first of these distributions that is there (cuda-python's module is `cuda`)."""
    from importlib import metadata  # noqa: PLC0415

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _tensorrt(root: Path) -> tuple[str | None, str | None]:
    """(version, how it was found). The Python module first, then the C++ header JetPack installs."""
    if _importable("tensorrt"):
        try:
            import tensorrt  # noqa: PLC0415

            return tensorrt.__version__, "python"
        except Exception as e:  # a broken install: say so rather than guess
            return None, f"import tensorrt failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    for arch in ("aarch64-linux-gnu", "x86_64-linux-gnu", ""):
        text = _read(root / "usr/include" / arch / "NvInferVersion.h")
        if text:
            parts = [re.search(rf"#define NV_TENSORRT_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                return ".".join(p.group(1) for p in parts), "header (no Python bindings)"
    return None, None


def _cuda(root: Path) -> str | None:
    text = _read(root / "usr/local/cuda/version.json")
    if text:
        try:
            return json.loads(text)["cuda"]["version"]
        except (ValueError, KeyError, TypeError):
            pass
    text = _read(root / "usr/local/cuda/version.txt") or ""
    m = re.search(r"(\d+\.\d+(\.\d+)?)", text)
    return m.group(1) if m else None


def _gpu() -> dict:
    """Name and compute capability of GPU 0: nvidia-smi, else the CUDA driver through cuda-python."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                name, cap, driver = [x.strip() for x in out.stdout.splitlines()[0].split(",")][:3]
                return {"gpu_name": name, "gpu_sm": cap, "driver": driver, "gpu_source": "nvidia-smi"}
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        try:
            from cuda.bindings import driver as cu  # noqa: PLC0415  cuda-python >= 12.6
        except ImportError:
            from cuda import cuda as cu  # noqa: PLC0415  older cuda-python
    except ImportError:
        return {"gpu_error": "no nvidia-smi and no cuda-python to ask the driver"}
    try:
        err, = cu.cuInit(0)
        if int(err) != 0:
            return {"gpu_error": f"CUDA driver: {cu.cuGetErrorName(err)[1].decode() if hasattr(err, 'value') else err}"}
        err, dev = cu.cuDeviceGet(0)
        err, name = cu.cuDeviceGetName(64, dev)
        A = cu.CUdevice_attribute
        _, major = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        return {"gpu_name": name.split(b"\x00")[0].decode(), "gpu_sm": f"{major}.{minor}", "gpu_source": "cuda-python"}
    except Exception as e:  # no libcuda.so: cuda-python imports but the driver is absent
        return {"gpu_error": f"CUDA driver not usable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}


def _onnxruntime() -> dict:
    if not _importable("onnxruntime"):
        return {}
    try:
        import onnxruntime as ort  # noqa: PLC0415

        return {"onnxruntime": ort.__version__, "ort_providers": ort.get_available_providers()}
    except Exception as e:
        return {"onnxruntime_error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def _disk_free(path: Path) -> int | None:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def probe(install_root: str | None = None, root: str | None = None) -> dict:
    r = Path(root or os.environ.get("EDGECHAT_DEVICE_ROOT") or "/")
    mem = _meminfo(r)
    trt, trt_how = _tensorrt(r)
    facts = {
        "arch": platform.machine(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "glibc": platform.libc_ver()[1] or None,
        "nv_tegra_release": _read(r / "etc/nv_tegra_release"),
        "device_tree_model": _read(r / "proc/device-tree/model"),
        "mem_total_bytes": mem.get("MemTotal"),
        "mem_available_bytes": mem.get("MemAvailable"),
        "swap_free_bytes": mem.get("SwapFree"),
        "tensorrt": trt,
        "tensorrt_source": trt_how,
        "cuda": _cuda(r),
        "cuda_bindings": next((m for m, spec in (("cuda-python", "cuda"), ("pycuda", "pycuda")) if _importable(spec)), None),
        "cuda_python": _dist_version("cuda-python") if _importable("cuda") else None,
        "systemd": bool(shutil.which("systemctl")) and Path("/run/systemd/system").is_dir(),
    }
    facts |= _gpu() | _onnxruntime()
    if install_root:
        ir = Path(os.path.expanduser(install_root))
        facts["install_root"] = str(ir)
        facts["disk_free_bytes"] = _disk_free(ir)
    return facts


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1] if len(sys.argv) > 1 else None)))
