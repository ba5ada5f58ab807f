"""edge-export deploy against a real OpenSSH server on loopback.

The fixture starts Debian's sshd as a non-daemon on a free port with its own host key and one
authorized test key. The "device" is this machine reached over SSH; only its identity files (a fake
/etc/nv_tegra_release, device-tree model and meminfo under a folder) are simulated. SSH, rsync,
hashing, install, switch and rollback are real.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, run_cli
from export.deploy import DeployError, Target, deploy, rollback

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("rsync")),
                                reason="needs openssh-server, openssh-client and rsync (scripts/system-deps.sh installs them)")
TEGRA = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 2025\n"


class Device:
    def __init__(self, d: Path, port: int, proc: subprocess.Popen) -> None:
        self.dir, self.port, self.proc = d, port, proc
        self.install = d / "home" / ".edgechat"
        self.known_hosts = d / "known_hosts"
        self.identity = d / "client_ed25519"
        self.identity_root = d / "identity"

    def target(self, **kw) -> Target:
        base = dict(host=f"{getpass.getuser()}@127.0.0.1", port=self.port, identity=str(self.identity),
                    known_hosts=str(self.known_hosts), root=str(self.install), python=sys.executable,
                    device_root=str(self.identity_root))
        return Target(**(base | kw))

    def current(self) -> str:
        return os.readlink(self.install / "current")


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    d = tmp_path_factory.mktemp("device")
    for name in ("host_ed25519", "client_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client_ed25519.pub", d / "authorized_keys")
    os.chmod(d / "authorized_keys", 0o600)
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_ed25519\nAuthorizedKeysFile {d}/authorized_keys\n"
        f"PidFile {d}/sshd.pid\nUsePAM no\nStrictModes no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"sshd did not start: {proc.stdout.read()}")
            time.sleep(0.1)
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {(d / 'host_ed25519.pub').read_text()}")
    ident = d / "identity"
    (ident / "etc").mkdir(parents=True)
    (ident / "proc/device-tree").mkdir(parents=True)
    (ident / "etc/nv_tegra_release").write_text(TEGRA)
    (ident / "proc/device-tree/model").write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit\x00")
    (ident / "proc/meminfo").write_text("MemTotal:        7620000 kB\nMemAvailable:    5100000 kB\nSwapFree: 0 kB\n")
    unit = Path(os.path.expanduser("~")) / ".config/systemd/user/edgechat.service"
    unit_was_there = unit.exists()
    yield Device(d, port, proc)
    if not unit_was_there:  # the --service scenario writes the real user unit file of this account
        unit.unlink(missing_ok=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


def _variant(src: Path, dst: Path, bundle_id: str, drop: str | None = None) -> Path:
    """A copy of a bundle under another id (optionally without one engine), still self-consistent."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["bundle_id"] = bundle_id
    if drop:
        m["engines"] = [e for e in m["engines"] if e["name"] != drop]
        m["files"] = {k: v for k, v in m["files"].items() if not k.startswith(f"engines/{drop}/")}
        m["golden"] = [g for g in m["golden"] if g["engine"] != drop]
        shutil.rmtree(dst / "engines" / drop)
    (dst / "manifest.json").write_text(json.dumps(m, indent=2))
    return dst


def _quiet(*_a, **_k):
    pass


def test_deploy_scenarios(device, tiny_bundle, tmp_path):
    lines: list[str] = []
    echo = lines.append
    t = device.target()
    b1 = _variant(tiny_bundle.root, tmp_path / "one.bundle", "tiny-release-one")

    # fresh deploy: preflight table, copy + verify, engine plan (no TensorRT here), golden, switch
    rep = deploy(str(b1), t, echo=echo)
    text = "\n".join(lines)
    assert "module" in text and "Orin Nano" in text and "orin-nano-8gb" in text and "36.4.3 / 6.2" in text
    assert "free disk" in text and "TensorRT" in text and "10.3 (JetPack 6.2 table)" in text
    steps = dict(rep.steps)
    assert steps["build-engine"].startswith("skipped: TensorRT 10.3 has no Python bindings") and "ONNX Runtime" in steps["build-engine"]
    assert "answers same as the workstation's: " in steps["golden"]
    n_files = sum(1 for p in b1.rglob("*") if p.is_file())  # the listed files + manifest.json
    assert rep.sent_files == n_files
    assert device.current() == "releases/tiny-release-one"
    release = device.install / "releases/tiny-release-one/bundle"
    assert (release / "manifest.json").is_file()
    # the release carries its own runtime: this checkout's wheel, unpacked; the device's numpy etc. are used;
    # the JetPack 6 target's cuda-python (~=12.6.0) is shipped because the device's (13.x, the dev extra's) is not it
    assert "edgechat-0.1.0-py3-none-any.whl + 1 dependency wheel(s) (cuda-python 12.6." in steps["runtime"], steps["runtime"]
    assert "ONNX Runtime serves" in steps["device-check"], steps["device-check"]
    assert "from the device: " in steps["runtime"] and "numpy" in steps["runtime"]
    assert (device.install / "releases/tiny-release-one/runtime/edge/cli.py").is_file()

    # redeploy of the same bundle copies nothing
    rep = deploy(str(b1), t, echo=_quiet)
    assert rep.sent_files == 0 and device.current() == "releases/tiny-release-one"

    # a file corrupted on the device (same size and mtime, so rsync's quick check misses it) is found and re-sent
    victim = release / "engines/fp32/model.onnx"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    rep = deploy(str(b1), t, echo=_quiet)
    assert any(s == "verify" and "engines/fp32/model.onnx" in w for s, w in rep.steps), rep.steps
    assert victim.read_bytes() == (b1 / "engines/fp32/model.onnx").read_bytes()

    # a copy interrupted mid-way (rsync killed) is resumed: only what is missing is sent
    b2 = _variant(tiny_bundle.root, tmp_path / "two.bundle", "tiny-release-two")
    ssh = " ".join(t.ssh_base())
    dst = device.install / "releases/tiny-release-two/bundle"
    cp = subprocess.Popen(["rsync", "-a", "--partial", "--bwlimit=200", "--mkpath", "-e", ssh, f"{b2}/",
                           f"{t.host}:{dst}/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)
    cp.kill()
    cp.wait()
    there = [p for p in dst.rglob("*") if p.is_file()] if dst.exists() else []
    assert 0 < len(there) < n_files, "the interrupted copy should have left part of the bundle"
    rep = deploy(str(b2), t, echo=_quiet)
    assert 0 < rep.sent_files < n_files and device.current() == "releases/tiny-release-two"

    # an engine build that fails on the device leaves the previous release current
    b3 = _variant(tiny_bundle.root, tmp_path / "three.bundle", "tiny-release-three", drop="fp32")
    with pytest.raises(DeployError, match="deploy stopped at 'build-engine'.*lacks"):
        deploy(str(b3), t, echo=_quiet)
    assert device.current() == "releases/tiny-release-two"

    # rollback returns to the release before
    assert rollback(t, echo=_quiet) == "releases/tiny-release-one"
    assert device.current() == "releases/tiny-release-one"
    assert os.readlink(device.install / "previous") == "releases/tiny-release-two"

    # --service without systemd: the unit is written, not activated; keep=1 prunes older releases
    rep = deploy(str(b2), t, service=True, keep=1, echo=_quiet)
    steps = dict(rep.steps)
    assert "not activated" in steps["service"]
    unit = (Path(os.path.expanduser("~")) / ".config/systemd/user/edgechat.service").read_text()
    assert f"{sys.executable} -m edge.cli serve {device.install}/current/bundle" in unit and "Restart=on-failure" in unit
    assert f"Environment=PYTHONPATH={device.install}/current/runtime" in unit
    left = sorted(p.name for p in (device.install / "releases").iterdir())
    assert left == ["tiny-release-one", "tiny-release-two"], left  # current and previous are never pruned
    assert "tiny-release-three" in steps.get("prune", "")


def test_unknown_host_key_refused(device, tiny_bundle, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(DeployError, match="not in known_hosts.*--accept-new-host-key"):
        deploy(str(tiny_bundle.root), device.target(known_hosts=str(empty)), dry_run=True, echo=_quiet)
    rep = deploy(str(tiny_bundle.root), device.target(known_hosts=str(empty), accept_new_host_key=True),
                 dry_run=True, echo=_quiet)
    assert rep.steps[-1][0] == "dry-run"
    # ssh hashes host names in known_hosts; the server's own public key is what must have been recorded
    assert (device.dir / 'host_ed25519.pub').read_text().split()[1] in empty.read_text()


def test_not_enough_disk_refused_in_preflight(device, tiny_bundle):
    before = sorted((device.install / "releases").iterdir()) if (device.install / "releases").exists() else []
    with pytest.raises(DeployError, match="deploy stopped at 'preflight'.*must stay free"):
        deploy(str(tiny_bundle.root), device.target(), reserve_gb=1e6, echo=_quiet)
    after = sorted((device.install / "releases").iterdir()) if (device.install / "releases").exists() else []
    assert before == after  # nothing copied


def test_deploy_cli_dry_run_prints_the_preflight(device, tiny_bundle):
    t = device.target()
    r = run_cli("export.cli", "deploy", str(tiny_bundle.root), t.host, "--port", str(t.port), "--identity",
                t.identity, "--known-hosts", t.known_hosts, "--root", t.root, "--remote-python", t.python,
                "--device-root", t.device_root, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "preflight" in r.stdout and "L4T / JetPack" in r.stdout and "[dry-run]" in r.stdout
    r = run_cli("export.cli", "deploy", str(tiny_bundle.root), t.host, "--port", str(t.port), "--identity",
                t.identity, "--known-hosts", t.known_hosts, "--root", t.root, "--remote-python", t.python,
                "--device-root", t.device_root, "--profile", "agx-orin-64gb", "--dry-run")
    assert r.returncode == 2 and "--profile agx-orin-64gb but the device is" in r.stderr


def test_runtime_ships_what_the_device_lacks(device, tiny_bundle, tmp_path, monkeypatch):
    """A requirement the device's python does not have is fetched for its platform and shipped with the release;
    one that cannot be had stops the deploy at 'runtime' before anything is switched."""
    from packaging.requirements import Requirement

    from export import runtime_set

    monkeypatch.setenv("EDGECHAT_CACHE", str(tmp_path / "cache"))
    base = runtime_set.requirements
    monkeypatch.setattr(runtime_set, "requirements", lambda m, s, target=None: [*base(m, s, target), Requirement("six>=1.16")])
    b = _variant(tiny_bundle.root, tmp_path / "six.bundle", "tiny-release-six")
    rep = deploy(str(b), device.target(), echo=_quiet)
    steps = dict(rep.steps)
    assert "2 dependency wheel(s) (cuda-python 12.6." in steps["runtime"] and ", six " in steps["runtime"], steps["runtime"]
    assert (device.install / "releases/tiny-release-six/runtime/six.py").is_file()
    assert device.current() == "releases/tiny-release-six"

    monkeypatch.setattr(runtime_set, "requirements", lambda m, s, target=None: [Requirement("edgechat-no-such-dist==9.9")])
    b2 = _variant(tiny_bundle.root, tmp_path / "nope.bundle", "tiny-release-nope")
    with pytest.raises(DeployError, match="deploy stopped at 'runtime'.*lacks edgechat-no-such-dist==9.9"):
        deploy(str(b2), device.target(), echo=_quiet)
    assert device.current() == "releases/tiny-release-six"


# sitecustomize for a python that presents JetPack 6 (Python 3.10 on aarch64) and refuses the modules named in
# EDGECHAT_TEST_HIDE, as if they were not installed (JetPack 6 has no cuda-python, and no ONNX Runtime until
# the user installs one from a Jetson index)
JETPACK6_SITE = r'''
import importlib.abc, os, platform, sys
platform.machine = lambda: "aarch64"
platform.python_version = lambda: "3.10.12"
HIDE = set(filter(None, os.environ.get("EDGECHAT_TEST_HIDE", "").split(",")))


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hidden())
'''


def _jetpack6_python(folder: Path, hide: str) -> Path:
    """A `python3` for the device that presents JetPack 6's Python (3.10, aarch64) without `hide`'s modules."""
    (folder / "site").mkdir(parents=True)
    (folder / "site/sitecustomize.py").write_text(JETPACK6_SITE)
    exe = folder / "python3"
    exe.write_text(f'#!/bin/sh\nEDGECHAT_TEST_HIDE={hide} PYTHONPATH={folder}/site${{PYTHONPATH:+:$PYTHONPATH}} '
                   f'exec {sys.executable} "$@"\n')
    exe.chmod(0o755)
    return exe


def _link(p: Path) -> str | None:
    return os.readlink(p) if p.is_symlink() else None


def test_jetpack6_device_is_told_what_to_install_then_gets_its_runtime(device, tiny_bundle, tmp_path):
    """Issue #38 on JetPack 6 (L4T 36.4, Python 3.10, aarch64, no cuda-python, no ONNX Runtime): the deploy stops
    before copying anything, naming the installs; once ONNX Runtime is there it ships cuda-python ~=12.6 for
    aarch64/cp310 (never onnxruntime 1.32, which has no Python 3.10 wheel), checks the device and switches."""
    before = _link(device.install / "current"), _link(device.install / "previous")
    b = _variant(tiny_bundle.root, tmp_path / "jp6.bundle", "tiny-release-jp6")
    bare = _jetpack6_python(tmp_path / "bare", hide="onnxruntime,cuda")
    lines: list[str] = []
    with pytest.raises(DeployError, match="deploy stopped at 'preflight': nothing on the device") as e:
        deploy(str(b), device.target(python=str(bare)), echo=lines.append)
    msg = str(e.value)
    assert "(1) sudo apt install python3-libnvinfer" in msg, msg
    assert "(2) PyPI has no ONNX Runtime for JetPack 6 (Python 3.10 / aarch64)" in msg and "pip install --index-url" in msg
    assert "previous release is still current" in msg
    text = "\n".join(lines)
    assert "aarch64" in text and "3.10.12" in text and "runtime target  jetpack6" in text, text
    assert (_link(device.install / "current"), _link(device.install / "previous")) == before
    assert not (device.install / "releases/tiny-release-jp6").exists()  # stopped before the copy

    # the user installs JetPack's onnxruntime-gpu from their Jetson index (here: this machine's, no longer hidden)
    fixed = _jetpack6_python(tmp_path / "fixed", hide="cuda")
    rep = deploy(str(b), device.target(python=str(fixed)), echo=_quiet)
    steps = dict(rep.steps)
    shipped = steps["runtime"].split("; from the device")[0]
    assert "cuda-python 12.6." in shipped and "onnxruntime" not in shipped, steps["runtime"]
    wheels = sorted(p.name for p in (device.install / "releases/tiny-release-jp6/wheels").glob("cuda_python-*"))
    assert wheels and "cp310-cp310-manylinux_2_17_aarch64" in wheels[0], wheels
    assert "no TensorRT Python bindings" in steps["device-check"] and "ONNX Runtime serves" in steps["device-check"]
    assert steps["build-engine"].startswith("skipped: TensorRT 10.3 has no Python bindings there (sudo apt install python3-libnvinfer)")
    assert device.current() == "releases/tiny-release-jp6"
    assert _link(device.install / "previous") == (before[0] if before[0] and before[0] != "releases/tiny-release-jp6" else before[1])


def test_jetpack6_with_tensorrt_but_no_usable_cuda_stops_before_the_engine_build(device, tiny_bundle, tmp_path):
    """Issue #38's third failure: TensorRT's bindings are there but CUDA does not open through cuda-python (here
    the aarch64 cp310 wheel the release ships cannot load on this x86 'device'; on a real JetPack 6 it is an
    unpinned cuda-python 13 the r540 driver refuses). The device check stops before build-engine, naming the
    pin, and nothing is switched. The `tensorrt` module here is an empty stand-in that only imports."""
    py = _jetpack6_python(tmp_path / "trt", hide="cuda")
    (tmp_path / "trt/site/tensorrt").mkdir()
    (tmp_path / "trt/site/tensorrt/__init__.py").write_text('__version__ = "10.3.0"\n')
    before = _link(device.install / "current"), _link(device.install / "previous")
    b = _variant(tiny_bundle.root, tmp_path / "jp6trt.bundle", "tiny-release-jp6-trt")
    lines: list[str] = []
    with pytest.raises(DeployError, match="deploy stopped at 'device-check'") as e:
        deploy(str(b), device.target(python=str(py)), echo=lines.append)
    assert "CUDA does not open" in str(e.value) and 'pip install "cuda-python~=12.6.0"' in str(e.value), str(e.value)
    assert any("TensorRT" in x and "10.3.0 (python)" in x for x in lines), lines
    assert any(x.startswith("[runtime]") and "cuda-python 12.6." in x for x in lines), lines
    assert not any(x.startswith("[build-engine]") for x in lines)
    engines = json.loads((device.install / "releases/tiny-release-jp6-trt/bundle/manifest.json").read_text())["engines"]
    assert not any(e["name"].startswith("trt") for e in engines)  # no engine was built
    assert (_link(device.install / "current"), _link(device.install / "previous")) == before
