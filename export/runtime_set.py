"""The offline install set a deploy ships with a bundle: the edgechat wheel plus what the device lacks.

A Jetson is often air-gapped, and JetPack's Python already holds the hard parts (onnxruntime-gpu from
NVIDIA's Jetson builds, numpy that it was compiled against, TensorRT's bindings). So the set is:
- the edgechat wheel, always (built from this checkout, or the installed version fetched from the index),
  so every release carries the runtime it was tested with and a rollback rolls the runtime back too;
- wheels for each of `edge`'s own requirements that the device's Python does not already satisfy,
  fetched here for the device's platform (arch, Python, glibc); what is there is used, never shadowed
  (replacing JetPack's numpy under its onnxruntime-gpu is a classic way to break it).
The device unpacks the wheels into `releases/<id>/runtime/` (wheels are zip files: no pip needed there)
and runs `PYTHONPATH=.../runtime python3 -m edge.cli`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from edge.errors import EdgeChatError
from edge.device.machine import Machine
from edge.device.runtimes import RuntimeTarget

REPO = Path(__file__).resolve().parent.parent
ORT_VERSION = "1.32.0"  # the CPU runtime this package is tested with (pyproject's [cpu] extra): Python 3.11+ only

# Run on the device: installed version of each distribution name given on argv (null when absent).
VERSIONS = r'''
import json, sys
from importlib import metadata
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
'''

# Run on the device: unpack the wheels in argv[2:] into argv[1] (emptied first), then prove it imports.
UNPACK = r'''
import os, shutil, sys, zipfile
dst = sys.argv[1]
tmp = dst + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
for w in sys.argv[2:]:
    with zipfile.ZipFile(w) as z:
        z.extractall(tmp)
shutil.rmtree(dst, ignore_errors=True)
os.rename(tmp, dst)
'''


class RuntimeSetError(EdgeChatError):
    pass


@dataclass
class RuntimeSet:
    wheels: list[Path] = field(default_factory=list)  # to copy and unpack, edgechat's first
    from_device: dict[str, str] = field(default_factory=dict)  # name -> version the device already has
    shipped: list[str] = field(default_factory=list)  # "name version" of dependency wheels shipped

    def summary(self) -> str:
        s = f"{self.wheels[0].name}" if self.wheels else "no edgechat wheel"
        s += f" + {len(self.shipped)} dependency wheel(s)" + (f" ({', '.join(self.shipped)})" if self.shipped else "")
        if self.from_device:
            s += "; from the device: " + ", ".join(f"{k} {v}" for k, v in sorted(self.from_device.items()))
        return s


def cache_dir() -> Path:
    return Path(os.environ.get("EDGECHAT_CACHE", Path.home() / ".cache" / "edgechat")) / "wheels"


def requirements(m: Machine, service: bool, target: RuntimeTarget | None = None) -> list[Requirement]:
    """What `edge` needs on this device: the package's base dependencies, the server when it runs one, and
    from the device's runtime target (device_profiles/runtimes/targets.toml) its cuda-python pin and, when
    the device has no ONNX Runtime, the target's ONNX Runtime pin. A Jetson target has none on PyPI: then
    nothing is requested (the deploy's device check says what to install, or TensorRT serves alone)."""
    from importlib import metadata  # noqa: PLC0415

    try:
        dist = metadata.distribution("edgechat")
        reqs = [Requirement(r) for r in dist.requires or []]
    except metadata.PackageNotFoundError as e:
        raise RuntimeSetError("edgechat is not installed here (pip install -e .), so its requirements are unknown") from e
    env = default_environment() | {"python_version": ".".join(m.python.split(".")[:2]),
                                   "python_full_version": m.python, "platform_machine": m.arch,
                                   "sys_platform": "linux"}
    out: list[Requirement] = []
    for r in reqs:
        extra_ok = [e for e in ("", "serve" if service else None) if e is not None]
        if r.marker is None:
            out.append(r)
        elif any(r.marker.evaluate(env | {"extra": e}) for e in extra_ok):
            r.marker = None
            out.append(r)
    if target is not None:
        out += [Requirement(x) for x in target.pins(target.cuda_python, m.python, m.arch)]
        if not m.onnxruntime:
            out += [Requirement(x) for x in target.pins(target.onnxruntime, m.python, m.arch)]
    elif not m.onnxruntime:
        if tuple(int(x) for x in m.python.split(".")[:2]) < (3, 11):
            raise RuntimeSetError(f"the device has no onnxruntime and its Python {m.python} has no onnxruntime "
                                  f"{ORT_VERSION} wheel (Python 3.11+ only): install an onnxruntime there first, "
                                  "or use Python 3.11+ on the device")
        out.append(Requirement(f"onnxruntime=={ORT_VERSION}"))
    return out


def _source_hash() -> str:
    h = hashlib.sha256()
    for p in sorted([REPO / "pyproject.toml", *REPO.glob("edge/**/*"), *REPO.glob("export/**/*"),
                     *REPO.glob("device_profiles/**/*")]):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(REPO)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def edgechat_wheel() -> Path:
    """The edgechat wheel: built from this checkout (cached by source hash), else the installed
    version from the package index."""
    from importlib import metadata  # noqa: PLC0415

    version = metadata.version("edgechat")
    if (REPO / "pyproject.toml").is_file():
        out = cache_dir() / "edgechat" / _source_hash()
        found = sorted(out.glob("edgechat-*.whl"))
        if found:
            return found[0]
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)]
        what = "build the edgechat wheel from this checkout"
    else:
        out = cache_dir() / "edgechat" / version
        found = sorted(out.glob(f"edgechat-{version}-*.whl"))
        if found:
            return found[0]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), f"edgechat=={version}"]
        what = f"download edgechat {version}"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = sorted(out.glob("edgechat-*.whl"))
    if r.returncode != 0 or not found:
        raise RuntimeSetError(f"could not {what}: {r.stderr.strip()[-400:]}")
    return found[0]


def platform_args(m: Machine) -> list[str]:
    """pip download flags for the device's platform."""
    arch = m.arch
    major, minor = (m.glibc or "2.17").split(".")[:2]
    tags = [f"manylinux_{major}_{mn}_{arch}" for mn in range(int(minor), 16, -1)] + [f"manylinux2014_{arch}", f"linux_{arch}"]
    py = "".join(m.python.split(".")[:2])
    args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", py, "--abi", f"cp{py}", "--abi", "abi3",
            "--abi", "none"]
    for t in tags:
        args += ["--platform", t]
    return args


def download(reqs: list[Requirement], m: Machine) -> tuple[list[Path], str]:
    """Wheels for reqs and their dependencies, for the device's platform, one folder per resolution
    (so a folder holds exactly one consistent set; pip's own cache makes reruns cheap)."""
    key = hashlib.sha256(" ".join(sorted(map(str, reqs)) + platform_args(m)).encode()).hexdigest()[:16]
    out = cache_dir() / f"{m.arch}-cp{''.join(m.python.split('.')[:2])}" / key
    done = out / "complete"
    if not done.is_file():
        out.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(out), *platform_args(m),
                            *[str(x) for x in reqs]], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            errs = [x for x in r.stderr.strip().splitlines() if x.startswith("ERROR")] or r.stderr.strip().splitlines()
            return [], (errs[0] if errs else f"pip exit {r.returncode}")
        done.write_text("\n".join(sorted(map(str, reqs))))
    return sorted(out.glob("*.whl")), ""


def device_versions(t, names) -> dict[str, str | None]:
    """Installed version of each distribution in the device's Python (None when absent)."""
    return json.loads(t.run(f"{t.python} - " + " ".join(names), "runtime", stdin=VERSIONS).stdout.strip().splitlines()[-1])


def plan(t, m: Machine, service: bool, target: RuntimeTarget | None = None) -> RuntimeSet:
    """Decide what to ship: ask the device which requirements it already satisfies, fetch the rest."""
    rs = RuntimeSet(wheels=[edgechat_wheel()])
    reqs = requirements(m, service, target)
    have = device_versions(t, [r.name for r in reqs])
    if m.onnxruntime:
        rs.from_device["onnxruntime"] = m.onnxruntime
    need = []
    for r in reqs:
        v = have.get(r.name)
        if v is not None and (not r.specifier or r.specifier.contains(v, prereleases=True)):
            rs.from_device[r.name] = v
        else:
            need.append(r)
    if not need:
        return rs
    wheels, err = download(need, m)
    if err:
        raise RuntimeSetError(f"the device lacks {', '.join(map(str, need))} and no wheels for {m.arch} / Python "
                              f"{m.python} could be fetched here ({err}): install them on the device "
                              f"(pip install {' '.join(repr(str(r)) for r in need)}), or deploy with "
                              "--device-runtime to use an edgechat installed there")
    # ship each resolved distribution the device does not already have (never shadow one it has)
    names = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in wheels}
    wanted = set()
    asked = {canonicalize_name(r.name) for r in need}
    stack = list(asked)
    deps = _wheel_deps(names, m)
    there = device_versions(t, names)
    while stack:
        n = stack.pop()
        if n in wanted or n not in names:
            continue
        if there.get(n) is not None and n not in asked:
            rs.from_device[n] = there[n]
            continue
        wanted.add(n)
        stack.extend(deps.get(n, []))
    for n in sorted(wanted):
        w = names[n]
        rs.wheels.append(w)
        rs.shipped.append(f"{n} {parse_wheel_filename(w.name)[1]}")
    return rs


def _wheel_deps(names: dict[str, Path], m: Machine) -> dict[str, list[str]]:
    """Each wheel's own runtime requirements (from its METADATA), evaluated for the device."""
    import zipfile  # noqa: PLC0415

    env = default_environment() | {"python_version": ".".join(m.python.split(".")[:2]), "python_full_version": m.python,
                                   "platform_machine": m.arch, "sys_platform": "linux", "extra": ""}
    out: dict[str, list[str]] = {}
    for n, w in names.items():
        with zipfile.ZipFile(w) as z:
            meta = next((x for x in z.namelist() if x.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode("utf-8", "replace") if meta else ""
        deps = []
        for line in text.splitlines():
            if line.startswith("Requires-Dist:"):
                r = Requirement(line.split(":", 1)[1].strip())
                if r.marker is None or r.marker.evaluate(env):
                    deps.append(canonicalize_name(r.name))
        out[n] = deps
    return out
