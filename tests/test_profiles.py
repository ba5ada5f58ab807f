import subprocess
import sys
from pathlib import Path

import pytest

from edge.errors import ProfileError
from edge.device.profiles import REQUIRED, available, load_profile

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["t4", "l4", "orin-nano-8gb", "orin-nx-16gb", "agx-orin-32gb", "agx-orin-64gb", "cpu"]


def test_all_targets_present():
    assert set(TARGETS) <= set(available())


@pytest.mark.parametrize("name", TARGETS)
def test_profile_loads_with_sources(name):
    p = load_profile(name)
    for k in REQUIRED:
        assert k in p.facts
        assert p.sources[k].strip(), f"{name}.{k} has no source"
    assert set(p.facts) == set(p.sources)
    assert 0 < p.usable_memory_gb <= p.memory_gb
    for mode in p.modes:
        q = load_profile(f"{name}@{mode}")
        assert set(q.facts) == set(q.sources)


def test_device_facts():
    t4, l4, nano = load_profile("t4"), load_profile("l4"), load_profile("orin-nano-8gb")
    assert t4.compute_capability == "7.5" and not t4.supports("bf16") and not t4.supports("fp8-qdq") and not t4.supports("int4-qdq")
    assert l4.compute_capability == "8.9" and l4.supports("fp8-qdq") and l4.supports("int4-qdq")
    assert nano.compute_capability == "8.7" and nano.build_on_device and nano.unified_memory
    assert nano.usable_memory_gb == pytest.approx(6.6)  # headless; the desktop mode leaves 5.2
    assert load_profile("orin-nano-8gb@desktop").usable_memory_gb == pytest.approx(5.2)
    assert nano.tensorrt_versions == ["10.3"] and nano.cuda_version == "12.6"
    sup = load_profile("orin-nano-8gb@super")
    assert sup.memory_bandwidth_gbs == 102.0 and nano.memory_bandwidth_gbs == 68.0


def test_unknown_target_and_mode():
    with pytest.raises(ProfileError, match="unknown target device 'nope'.*orin-nano-8gb"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="no power mode 'turbo'"):
        load_profile("t4@turbo")


def test_fact_without_source_is_refused(tmp_path):
    src = (ROOT / "device_profiles" / "t4.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(src.replace('memory_gb = { value = 16.0, source = "T4 datasheet: 16 GB GDDR6" }', "memory_gb = 16.0"))
    with pytest.raises(ProfileError, match="memory_gb"):
        load_profile(str(bad))


@pytest.mark.slow
def test_installed_wheel_finds_profiles(tmp_path):
    """The wheel (not the checkout) must carry device_profiles/ inside the edge package."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)], check=True)
    whl = next(wheels.glob("edgechat-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)], check=True)
    code = ("import edge.device.profiles as p, sys; assert str(p.profiles_dir()).startswith(sys.argv[1]), p.profiles_dir(); "
            "import edge.device.runtimes as r; assert 'jetpack6' in r.load_targets(), 'runtime targets not in the wheel'; "
            "print(','.join(p.available()))")
    out = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "orin-nano-8gb" in out.stdout and "t4" in out.stdout
