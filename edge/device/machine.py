"""This machine as EdgeChat sees it: raw facts from `edge.device.probe`, interpreted with the device profiles
and the JetPack release table (`device_profiles/jetpack/releases.toml`).

On a Jetson, the module (Orin Nano 8GB, NX 16GB, AGX 32/64GB) comes from the device-tree model and
MemTotal, the JetPack / TensorRT / CUDA versions from /etc/nv_tegra_release, and the GPU's SM from the
module's profile when the driver cannot be asked.
"""

from __future__ import annotations

import os

import re
import sys
from dataclasses import asdict, dataclass, field

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge.errors import ProfileError
from edge.device.profiles import available, load_profile, profiles_dir

GB = 1e9


@dataclass(frozen=True)
class Machine:
    arch: str
    python: str
    jetson: bool = False
    l4t: str | None = None
    jetpack: str | None = None
    module: str | None = None  # device-tree model string
    profile: str | None = None  # matching device profile (name or name@mode)
    profile_error: str | None = None
    tensorrt: str | None = None
    tensorrt_source: str | None = None
    cuda: str | None = None
    cuda_bindings: str | None = None
    cuda_python: str | None = None  # version of an importable cuda-python
    driver: str | None = None  # NVIDIA driver version (nvidia-smi), e.g. "550.54.15"
    gpu_name: str | None = None
    gpu_sm: str | None = None
    gpu_error: str | None = None
    onnxruntime: str | None = None
    ort_providers: list[str] = field(default_factory=list)
    mem_total_gb: float | None = None
    mem_available_gb: float | None = None
    disk_free_gb: float | None = None
    systemd: bool = False
    glibc: str | None = None  # for the manylinux tags of wheels shipped to the device

    @property
    def has_gpu(self) -> bool:
        return self.gpu_sm is not None

    def to_dict(self) -> dict:
        return asdict(self)


def physical_cores(sys_root: str = "/sys/devices/system/cpu") -> int:
    """CPU cores, not SMT threads: the intra-op thread count that decodes fastest (a second thread on
    a core only fights the first for the same vector units and memory bandwidth)."""
    import glob

    cores = set()
    for path in glob.glob(os.path.join(sys_root, "cpu[0-9]*", "topology", "core_id")):
        topo = os.path.dirname(path)
        try:
            with open(path) as f, open(os.path.join(topo, "physical_package_id")) as g:
                cores.add((g.read().strip(), f.read().strip()))
        except OSError:
            continue
    n = len(cores) or (os.cpu_count() or 1)
    try:  # never more than this process may run on (containers, taskset)
        n = min(n, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        pass
    return max(1, n)


def parse_tegra_release(text: str) -> str:
    """'# R36 (release), REVISION: 4.3, GCID: ...' -> '36.4.3'."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text or "")
    if not m:
        raise ProfileError(f"cannot read the L4T release from /etc/nv_tegra_release ({(text or '').strip()[:80]!r})")
    return f"{m.group(1)}.{m.group(2)}"


def jetpack_releases() -> dict[str, dict]:
    path = profiles_dir() / "jetpack" / "releases.toml"
    return tomllib.loads(path.read_text(encoding="utf-8"))["l4t"]


def jetpack_for(l4t: str) -> dict | None:
    """The release row for an L4T version: exact, else its major.minor (36.4.0 -> '36.4')."""
    rows = jetpack_releases()
    if l4t in rows:
        return rows[l4t]
    short = ".".join(l4t.split(".")[:2])
    return rows.get(short)


def match_jetson_profile(model: str, mem_total_gb: float | None) -> str:
    """Device profile for a Jetson from its device-tree model and memory. Raises if none fits."""
    cands = []
    for name in available():
        p = load_profile(name)
        key = p.facts.get("device_tree_model")
        if p.facts["kind"] == "jetson" and key and key.lower() in model.lower():
            cands.append(p)
    if not cands:
        raise ProfileError(f"no EdgeChat device profile for '{model}': supported Jetson modules are "
                           "Orin Nano 8GB, Orin NX 16GB, AGX Orin 32GB/64GB (pass --profile to choose one)")
    if mem_total_gb is not None:
        # MemTotal is a little below the module's memory (carve-outs): the module whose size it is nearest.
        fit = [p for p in cands if mem_total_gb >= 0.8 * p.memory_gb]
        if not fit:
            raise ProfileError(f"'{model}' has {mem_total_gb:.1f} GB of memory, less than the "
                               f"{min(p.memory_gb for p in cands):.0f} GB module EdgeChat has a profile for "
                               "(a 4 GB / 8 GB variant?): pass --profile with the nearest one at your own risk")
        cands = [min(fit, key=lambda p: abs(p.memory_gb - mem_total_gb))]
    p = cands[0]
    if "super" in model.lower() and "super" in p.modes:
        return f"{p.name}@super"
    return p.name


def interpret(facts: dict) -> Machine:
    """Turn `edge.device.probe.probe()` output (local or from a device over SSH) into a Machine."""
    gb = lambda k: round(facts[k] / GB, 2) if facts.get(k) else None  # noqa: E731
    kw: dict = dict(
        arch=facts.get("arch", "?"), python=facts.get("python", "?"), tensorrt=facts.get("tensorrt"),
        tensorrt_source=facts.get("tensorrt_source"), cuda=facts.get("cuda"), cuda_bindings=facts.get("cuda_bindings"),
        cuda_python=facts.get("cuda_python"), driver=facts.get("driver"),
        gpu_name=facts.get("gpu_name"), gpu_sm=facts.get("gpu_sm"), gpu_error=facts.get("gpu_error"),
        onnxruntime=facts.get("onnxruntime"), ort_providers=list(facts.get("ort_providers") or []),
        mem_total_gb=gb("mem_total_bytes"), mem_available_gb=gb("mem_available_bytes"),
        disk_free_gb=gb("disk_free_bytes"), systemd=bool(facts.get("systemd")), glibc=facts.get("glibc"))
    tegra = facts.get("nv_tegra_release")
    if tegra:
        kw["jetson"] = True
        kw["module"] = facts.get("device_tree_model")
        try:
            kw["l4t"] = parse_tegra_release(tegra)
            row = jetpack_for(kw["l4t"])
            if row:
                kw["jetpack"] = row["jetpack"]
                kw["cuda"] = kw["cuda"] or row["cuda"]
                if not kw["tensorrt"]:
                    kw["tensorrt"], kw["tensorrt_source"] = row["tensorrt"], f"JetPack {row['jetpack']} table"
        except ProfileError as e:
            kw["profile_error"] = str(e)
        try:
            kw["profile"] = match_jetson_profile(kw["module"] or "", kw["mem_total_gb"])
            if not kw["gpu_sm"]:
                prof = load_profile(kw["profile"])
                kw["gpu_sm"], kw["gpu_name"] = str(prof.compute_capability), prof.display_name
                kw["gpu_error"] = None
        except ProfileError as e:
            kw["profile_error"] = str(e)
    elif kw["gpu_name"]:
        kw["profile"] = match_gpu_profile(kw["gpu_name"])
    return Machine(**kw)


def match_gpu_profile(gpu_name: str) -> str | None:
    """Device profile for a discrete GPU from its name ('Tesla T4', 'NVIDIA L4'); None if EdgeChat has none."""
    words = set(re.split(r"[\s-]+", gpu_name.upper()))
    for name in available():
        p = load_profile(name)
        key = p.facts.get("nvidia_smi_name")
        if p.facts["kind"] == "dgpu" and key and key.upper() in words:
            return p.name
    return None


def detect(install_root: str | None = None, root: str | None = None) -> Machine:
    from edge.device.probe import probe

    return interpret(probe(install_root, root))
