"""Runtime targets (device_profiles/runtimes/targets.toml): every entry loads with its sources, names real
device profiles and a JetPack row, and the choice of target and the device verdict follow the data."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.errors import ProfileError
from edge.device.machine import jetpack_releases
from edge.device.profiles import available
from edge.device.runtimes import judge, load_targets, target_for

ROOT = Path(__file__).resolve().parent.parent
TARGETS = load_targets()


def test_the_targets_issue_38_names_are_there():
    assert {"x86-cuda12", "x86-cuda13", "jetpack6", "jetpack7", "cpu"} <= set(TARGETS)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_loads_with_sources(name):
    t = TARGETS[name]
    assert set(t.sources) >= {"description", "kind", "profiles", "platforms", "pythons", "onnxruntime"}
    assert all(s.strip() for s in t.sources.values())
    assert set(t.profiles) <= set(available()), f"{name} names a profile that does not exist"
    assert t.platforms and t.pythons and t.arches
    for py in t.pythons:
        for arch in t.arches:
            t.requirements(py, arch)  # every pin parses and its markers evaluate
    if t.kind == "jetson":
        rows = [r for key, r in jetpack_releases().items() if int(key.split(".")[0]) == t.l4t_major]
        assert rows, f"{name}: no L4T {t.l4t_major} row in device_profiles/jetpack/releases.toml"
        assert t.tensorrt_from == "apt" and not t.tensorrt_wheels and t.onnxruntime == ()
    if t.kind != "cpu":
        assert t.cuda_python and t.cuda_driver_major in (12, 13) and t.tensorrt_install


def test_cuda12_targets_never_pull_cuda13_packages():
    """The issue: unpinned tensorrt / cuda-python resolved to CUDA 13 builds that CUDA 12 drivers refuse."""
    for t in TARGETS.values():
        if t.cuda_driver_major == 12:
            for py in t.pythons:
                reqs = " ".join(t.requirements(py, t.arches[0]))
                assert "cu13" not in reqs and "1.32.0" not in reqs, (t.name, reqs)
                assert "cuda-python" in reqs and ("<13" in reqs or "~=12." in reqs), (t.name, reqs)
    assert TARGETS["jetpack6"].requirements("3.10", "aarch64") == ["cuda-python~=12.6.0"]


def test_target_for_a_machine():
    assert target_for("jetson", "36.4.3").name == "jetpack6"
    assert target_for("jetson", "39.2.0").name == "jetpack7"
    assert target_for("jetson", "35.6") is None  # JetPack 5: no target, deploy says so
    assert target_for("dgpu", driver="550.54.15", has_gpu=True).name == "x86-cuda12"
    assert target_for("dgpu", driver="580.65.06", has_gpu=True).name == "x86-cuda13"
    assert target_for("cpu").name == "cpu"


def test_fact_without_source_is_refused(tmp_path):
    src = (ROOT / "device_profiles/runtimes/targets.toml").read_text()
    bad = tmp_path / "targets.toml"
    bad.write_text(src.replace('pythons = { value = ["3.10"], source = "Ubuntu 22.04', 'pythons = ["3.10"]\nx = { value = 1, source = "', 1))
    with pytest.raises(ProfileError, match="targets.jetpack6.pythons must be"):
        load_targets(bad)
    bad.write_text(src.replace('kind = { value = "cpu", source = "no GPU" }', 'kind = { value = "tpu", source = "no GPU" }'))
    with pytest.raises(ProfileError, match="kind must be one of"):
        load_targets(bad)


def test_verdict_names_what_to_install_on_jetpack6():
    jp6 = TARGETS["jetpack6"]
    v = judge(jp6, {}, has_gpu=True, python="3.10.12", arch="aarch64")
    assert v.must_stop and not v.engine and not v.onnxruntime
    text = "\n".join(v.to_install)
    assert "sudo apt install python3-libnvinfer" in text and "pip install --index-url" in text
    assert "Python 3.10 / aarch64" in text
    # ONNX Runtime there, no TensorRT bindings: ONNX Runtime serves, nothing to install
    v = judge(jp6, {"onnxruntime": "1.20.0"}, has_gpu=True, python="3.10.12", arch="aarch64")
    assert not v.must_stop and not v.engine
    # TensorRT there but cuda-python 13 on the r540 driver: stop before the build, name the pin
    v = judge(jp6, {"tensorrt": "10.3.0", "cuda_python": "13.4.4", "cuda_driver": None,
                    "cuda_error": "cudaErrorInsufficientDriver"}, has_gpu=True, python="3.10.12", arch="aarch64")
    assert v.must_stop and "cuda-python~=12.6.0" in v.to_install[0]
    v = judge(jp6, {"tensorrt": "10.3.0", "cuda_python": "12.6.2.post1", "cuda_driver": 12060},
              has_gpu=True, python="3.10.12", arch="aarch64")
    assert v.engine and not v.must_stop
    # a CUDA 13 target on a CUDA 12 driver
    v = judge(TARGETS["x86-cuda13"], {"tensorrt": "10.16.1", "cuda_python": "13.4.4", "cuda_driver": 12080},
              has_gpu=True, python="3.11.7", arch="x86_64")
    assert v.must_stop and "580.65.06" in v.to_install[0]


def test_pyproject_extras_carry_the_targets_pins():
    """[gpu] / [gpu-cuda13] / [tensorrt-cu12/13] are the x86 targets' pins: one set of numbers, two files."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, target in (("gpu", "x86-cuda12"), ("gpu-cuda13", "x86-cuda13")):
        t = TARGETS[target]
        assert sorted(map(str, map(Requirement, extras[extra]))) == sorted(map(str, map(Requirement, t.onnxruntime + t.cuda_python)))
    for extra, target in (("tensorrt-cu12", "x86-cuda12"), ("tensorrt-cu13", "x86-cuda13")):
        [pkg], [bindings] = map(Requirement, extras[extra]), map(Requirement, TARGETS[target].tensorrt_wheels)
        assert pkg.name == extra and bindings.name == f"{extra}-bindings" and pkg.specifier == bindings.specifier
    assert extras["cpu"] == ["onnxruntime==1.32.0"] and TARGETS["cpu"].requirements("3.11", "x86_64") == ["onnxruntime==1.32.0"]


def test_jetpack6_release_requests_cuda_python_12_and_no_onnxruntime():
    """What the deploy asks pip for on a JetPack 6 device without ONNX Runtime: never onnxruntime 1.32 (no cp310 wheel)."""
    from edge.device.machine import Machine
    from export.runtime_set import requirements

    m = Machine(arch="aarch64", python="3.10.12", jetson=True, l4t="36.4.3")
    names = {str(r) for r in requirements(m, service=False, target=TARGETS["jetpack6"])}
    assert "cuda-python~=12.6.0" in names and not any(n.startswith("onnxruntime") for n in names), names
    cpu_310 = Machine(arch="x86_64", python="3.10.12")
    assert not any(str(r).startswith("onnxruntime") for r in requirements(cpu_310, False, TARGETS["cpu"]))


def test_every_device_profile_has_a_runtime_target():
    covered = {p for t in TARGETS.values() for p in t.profiles}
    assert set(available()) <= covered, set(available()) - covered
