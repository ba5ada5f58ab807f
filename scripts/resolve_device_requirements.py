"""Prove every runtime target's install resolves: for each target in device_profiles/runtimes/targets.toml,
each of its platforms and Pythons, pip's dry run resolves edgechat's base requirements plus the target's
ONNX Runtime, cuda-python and TensorRT-wheel pins for that platform (nothing is installed or downloaded
beyond metadata). A pin that does not exist, or that has no wheel for the target's platform and Python,
fails here instead of on a user's device (issue #38).

    python scripts/resolve_device_requirements.py [--targets FILE] [--only NAME ...] [--json PATH]

Prints one line per target/Python/platform; exits 1 if any cannot resolve, 2 if pip reached no index.
JetPack's apt-provided TensorRT is not a pip requirement and is not resolved here; x86 TensorRT's
libraries come from pypi.nvidia.com at install time, so only its bindings wheel is resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from edge.device.machine import Machine  # noqa: E402
from edge.device.runtimes import RuntimeTarget, load_targets  # noqa: E402
from export.runtime_set import platform_args  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

INDEX = "https://pypi.org/simple"
KEY = ("onnxruntime", "onnxruntime-gpu", "cuda-python", "cuda-bindings", "tensorrt-cu12-bindings",
       "tensorrt-cu13-bindings", "numpy", "tokenizers")


@dataclass
class Resolution:
    target: str
    python: str
    platform: str
    requirements: list[str]
    ok: bool = False
    versions: dict[str, str] = field(default_factory=dict)  # every resolved distribution
    error: str = ""

    def line(self) -> str:
        head = f"{self.target:<11} py{self.python:<5} {self.platform:<24}"
        if not self.ok:
            return f"{head} FAILED  {self.error}"
        keys = [f"{k} {self.versions[k]}" for k in KEY if k in self.versions]
        return f"{head} ok      {', '.join(keys)}"


def base_requirements(python: str, arch: str) -> list[str]:
    """edgechat's own [project].dependencies, markers evaluated for the target."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return RuntimeTarget.pins(tuple(deps), python, arch)


def pip_env() -> dict[str, str]:
    """pip without this machine's config (constraints, local find-links): only the index named on the command."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def resolve(t: RuntimeTarget, python: str, platform: str, index: str) -> Resolution:
    arch = platform.split("_", 3)[-1]
    glibc = ".".join(platform.split("_")[1:3])
    reqs = base_requirements(python, arch) + t.requirements(python, arch)
    res = Resolution(t.name, python, platform, reqs)
    flags = platform_args(Machine(arch=arch, python=python, glibc=glibc))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
               "--target", tmp, "--index-url", index, *flags, *reqs]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=pip_env())
    if r.returncode != 0:
        errs = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or r.stderr.strip().splitlines()[-2:]
        res.error = " | ".join(errs)[:400] or f"pip exit {r.returncode}"
        return res
    report = json.loads(r.stdout)
    res.versions = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
    res.ok = True
    return res


def index_reachable(index: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "packaging", "--index-url", index],
                       capture_output=True, text=True, timeout=120, env=pip_env())
    return r.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", help="runtime targets file (default: device_profiles/runtimes/targets.toml)")
    ap.add_argument("--only", action="append", default=[], help="resolve only this target (repeatable)")
    ap.add_argument("--json", help="write the resolutions here")
    ap.add_argument("--index-url", default=INDEX, help=f"the index to resolve against (default {INDEX})")
    a = ap.parse_args(argv)
    targets = load_targets(a.targets)
    unknown = [n for n in a.only if n not in targets]
    if unknown:
        print(f"unknown target(s) {', '.join(unknown)}: the file defines {', '.join(targets)}", file=sys.stderr)
        return 2
    if not index_reachable(a.index_url):
        print(f"pip cannot reach {a.index_url}: nothing resolved", file=sys.stderr)
        return 2
    print(f"index {a.index_url}, pip dry run per platform (nothing installed)")
    out = []
    for t in targets.values():
        if a.only and t.name not in a.only:
            continue
        for py in t.pythons:
            for plat in t.platforms:
                res = resolve(t, py, plat, a.index_url)
                print(res.line(), flush=True)
                out.append(res)
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in out], indent=2))
    bad = [r for r in out if not r.ok]
    if bad:
        print(f"{len(bad)} of {len(out)} target set(s) do not resolve: fix the pins in "
              f"{a.targets or 'device_profiles/runtimes/targets.toml'}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
