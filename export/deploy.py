"""Deploy a bundle to a Jetson (or any Linux box) over SSH: preflight, copy, install, switch, roll back.

Transport: the system OpenSSH client and rsync, not a Python SSH library. They honour the user's
~/.ssh/config, agents and known_hosts exactly as `ssh` does, rsync resumes an interrupted copy
(`--partial`) and skips files already there, and both are on every JetPack image. SSH runs with
BatchMode (never a password prompt) and StrictHostKeyChecking (an unknown host is refused unless
--accept-new-host-key).

Layout on the device (install root, default ~/.edgechat):
    releases/<bundle-id>/bundle/    the bundle, verified by SHA-256 on the device
    current -> releases/<id>        flipped atomically (symlink + rename) only after every step passed
    previous -> releases/<id>       what --rollback returns to
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge.bundle import Bundle
from edge.errors import EdgeChatError, ProfileError
from edge.device.machine import Machine, interpret
from edge.precisions import FP16
from edge.device.runtimes import RuntimeTarget, RuntimeVerdict, judge, target_of
from export import runtime_set

PROBE = Path(__file__).resolve().parent.parent / "edge" / "device" / "probe.py"
VERIFY = r'''
import hashlib, json, sys
root = sys.argv[1]
m = json.load(open(root + "/manifest.json"))
bad = []
for rel, e in m["files"].items():
    h = hashlib.sha256()
    try:
        with open(root + "/" + rel, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        bad.append(rel); continue
    if h.hexdigest() != e["sha256"]:
        bad.append(rel)
print(json.dumps(bad))
'''
# Run on the device with the release's PYTHONPATH, before any engine build: can TensorRT and CUDA (through the
# cuda-python this release carries) and ONNX Runtime actually be used there? Standard library only.
DEVICE_CHECK = r'''
import json
from importlib import metadata
out = {}
try:
    import tensorrt
    out["tensorrt"] = tensorrt.__version__
except Exception as e:
    out["tensorrt_error"] = (str(e).splitlines() or [type(e).__name__])[0]
if out.get("tensorrt"):
    out["cuda_driver"] = None
    try:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu
        out["cuda_python"] = metadata.version("cuda-python")
        err, = cu.cuInit(0)
        if int(err) != 0:
            out["cuda_error"] = "cuInit: " + cu.cuGetErrorName(err)[1].decode()
        else:
            err, ver = cu.cuDriverGetVersion()
            out["cuda_driver"] = int(ver)
    except Exception as e:
        out["cuda_error"] = (str(e).splitlines() or [type(e).__name__])[0]
try:
    import onnxruntime
    out["onnxruntime"] = onnxruntime.__version__
except Exception as e:
    out["onnxruntime_error"] = (str(e).splitlines() or [type(e).__name__])[0]
print(json.dumps(out))
'''


class DeployError(EdgeChatError):
    """A deploy step failed; the previous release is still the current one."""

    def __init__(self, step: str, message: str) -> None:
        self.step = step
        super().__init__(f"deploy stopped at '{step}': {message} (the previous release is still current)")


@dataclass
class Target:
    host: str  # user@host
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    root: str = "~/.edgechat"
    python: str = "python3"  # python on the device
    device_root: str | None = None  # where identity files are read (tests); "/" on a real device

    def ssh_base(self) -> list[str]:
        cmd = ["ssh", "-p", str(self.port), "-o", "BatchMode=yes", "-o", "ConnectTimeout=15",
               "-o", f"StrictHostKeyChecking={'accept-new' if self.accept_new_host_key else 'yes'}"]
        if self.known_hosts:
            cmd += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        if self.identity:
            cmd += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        return cmd

    def run(self, script: str, step: str, stdin: str | None = None, timeout: float = 1800,
            check: bool = True) -> subprocess.CompletedProcess:
        env = f"EDGECHAT_DEVICE_ROOT={shlex.quote(self.device_root)} " if self.device_root else ""
        r = subprocess.run([*self.ssh_base(), self.host, f"{env}sh -c {shlex.quote(script)}"], input=stdin,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode == 255:
            msg = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "ssh failed"
            if "Host key verification failed" in r.stderr or "No ED25519 host key is known" in r.stderr \
                    or "host key is known" in r.stderr:
                msg = (f"the host key of {self.host} is not in known_hosts: check it (ssh-keyscan -p {self.port} HOST) "
                       "and add it, or pass --accept-new-host-key on a network you trust")
            raise DeployError(step, msg)
        if check and r.returncode != 0:
            raise DeployError(step, (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}")[-800:])
        return r

    @property
    def root_q(self) -> str:
        """The install root for a remote shell (~ expanded by the shell)."""
        return self.root if self.root.startswith("~") else shlex.quote(self.root)


@dataclass
class Report:
    steps: list[tuple[str, str]] = field(default_factory=list)  # (step, what happened)
    machine: Machine | None = None
    target: RuntimeTarget | None = None  # the device's runtime target (device_profiles/runtimes/targets.toml)
    release: str = ""
    sent_files: int = 0

    def add(self, step: str, what: str, echo=print) -> None:
        self.steps.append((step, what))
        echo(f"[{step}] {what}")


def preflight_table(m: Machine, bundle: Bundle, need_gb: float, target: RuntimeTarget | None = None) -> list[tuple[str, str]]:
    return [
        ("architecture", m.arch),
        ("module", f"{m.module or '-'}" + (f" -> profile {m.profile}" if m.profile else "")),
        ("L4T / JetPack", f"{m.l4t or '-'} / {m.jetpack or '-'}"),
        ("TensorRT", f"{m.tensorrt or 'not installed'}" + (f" ({m.tensorrt_source})" if m.tensorrt_source else "")),
        ("CUDA", m.cuda or "-"),
        ("onnxruntime", f"{m.onnxruntime or 'not installed'}" + (f" {m.ort_providers}" if m.ort_providers else "")),
        ("Python", m.python),
        ("runtime target", f"{target.name}: {target.description}" if target else "none in device_profiles/runtimes/targets.toml"),
        ("free disk", f"{m.disk_free_gb:.1f} GB (bundle needs {need_gb:.2f} GB)" if m.disk_free_gb is not None else "?"),
        ("MemAvailable", f"{m.mem_available_gb:.1f} GB" if m.mem_available_gb is not None else "?"),
        ("bundle", f"{bundle.manifest.model_name} ({bundle.manifest.bundle_id})"),
    ]


def preflight(t: Target, bundle: Bundle, reserve_gb: float = 1.0, profile: str | None = None,
              echo=print) -> tuple[Machine, RuntimeTarget | None]:
    """Probe the device (edge/device/probe.py piped into its python3) and refuse what cannot work, before anything
    is copied: too little disk, a --profile that is not the device, and nothing that could serve the bundle
    (no TensorRT bindings, no ONNX Runtime and none the release would ship), naming what to install."""
    r = t.run(f"{t.python} - {t.root}", "preflight", stdin=PROBE.read_text())
    try:
        m = interpret(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise DeployError("preflight", f"the device's probe printed no facts: {r.stdout[-300:]} {r.stderr[-300:]}")
    try:
        target = target_of(m)
    except ProfileError as e:
        raise DeployError("preflight", str(e)) from e
    need = sum(f.size for f in bundle.manifest.files.values()) / 1e9 * 1.1
    rows = preflight_table(m, bundle, need, target)
    w = max(len(k) for k, _ in rows)
    echo("preflight " + t.host)
    for k, v in rows:
        echo(f"  {k:<{w}}  {v}")
    if m.disk_free_gb is not None and m.disk_free_gb - need < reserve_gb:
        raise DeployError("preflight", f"{m.disk_free_gb:.1f} GB free under {t.root} but the bundle needs {need:.2f} GB "
                                       f"and {reserve_gb:.1f} GB must stay free: free space or lower --reserve-gb")
    shipped_ort = (target.pins(target.onnxruntime, m.python, m.arch) if target
                   else [f"onnxruntime=={runtime_set.ORT_VERSION}"] if tuple(map(int, m.python.split(".")[:2])) >= (3, 11) else [])
    facts = {"tensorrt": m.tensorrt if m.tensorrt_source == "python" else None,
             "tensorrt_error": (f"TensorRT {m.tensorrt} known from the {m.tensorrt_source}, not importable"
                                if m.tensorrt else m.tensorrt_source or "not installed"),
             "onnxruntime": m.onnxruntime or (f"{shipped_ort[0]} (shipped with the release)" if shipped_ort else None)}
    verdict = judge(target, facts, m.has_gpu, m.python, m.arch)
    if verdict.must_stop:
        raise DeployError("preflight", _nothing_serves(verdict, m))
    want = profile if profile and profile != "auto" else None
    if want and m.profile and want.split("@")[0] != m.profile.split("@")[0]:
        raise DeployError("preflight", f"--profile {want} but the device is {m.module} ({m.profile})")
    if m.jetson and not m.profile and not want:
        raise DeployError("preflight", f"{m.profile_error or 'unknown Jetson module'}")
    return m, target


def _nothing_serves(v: RuntimeVerdict, m: Machine) -> str:
    steps = "; or ".join(f"({i}) {x}" for i, x in enumerate(v.to_install, 1))
    return (f"nothing on the device ({m.arch}, Python {m.python}) can serve the bundle yet ({'; '.join(v.notes)}). "
            f"Install on the device: {steps}. Then deploy again")


def device_check(t: Target, m: Machine, target: RuntimeTarget | None, pythonpath: str | None, rep: Report,
                 echo=print) -> RuntimeVerdict:
    """Before any engine build: import TensorRT, open CUDA with the cuda-python this release carries (the
    driver must take it) and import ONNX Runtime, on the device; stop naming what to install when neither
    can serve, or when TensorRT is there but CUDA will not open."""
    env = f"PYTHONPATH={pythonpath} " if pythonpath else ""
    r = t.run(f"{env}{t.python} -", "device-check", stdin=DEVICE_CHECK)
    try:
        facts = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise DeployError("device-check", f"the device check printed nothing: {r.stderr[-400:]}")
    v = judge(target, facts, m.has_gpu, m.python, m.arch)
    if v.must_stop:
        raise DeployError("device-check", _nothing_serves(v, m))
    rep.add("device-check", f"{'; '.join(v.notes)} -> {'TensorRT engine' if v.engine else 'ONNX Runtime serves'}", echo)
    return v


def _rsync(t: Target, src: Path | list[Path], dst: str, checksum: bool, step: str) -> int:
    """Copy a folder's contents (or a list of files) into dst/ on the device; resumable (--partial);
    returns the number of files transferred."""
    ssh = " ".join(shlex.quote(x) for x in t.ssh_base())
    srcs = [f"{src}/"] if isinstance(src, Path) else [str(p) for p in src]
    cmd = ["rsync", "-a", "--partial", "--stats", "--mkpath", "-e", ssh, *srcs, f"{t.host}:{dst}/"]
    if checksum:
        cmd.insert(2, "--checksum")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if r.returncode != 0:
        raise DeployError(step, f"rsync failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    for line in r.stdout.splitlines():
        if line.startswith("Number of regular files transferred:"):
            return int(line.split(":")[1].strip().replace(",", ""))
    return 0


def _sh_path(p: str) -> str:
    """A device path for a remote shell: a leading ~ becomes $HOME (expanded inside double quotes too)."""
    return '"$HOME"' + shlex.quote(p[1:]) if p.startswith("~/") else shlex.quote(p)


def install_runtime(t: Target, m: Machine, rel: str, service: bool, rep: Report, echo=print,
                    target: RuntimeTarget | None = None) -> str:
    """Ship the edgechat wheel and the wheels the device lacks (the target's pins included), unpack them into
    rel/runtime, and return the command that runs this release's edge-chat."""
    try:
        rs = runtime_set.plan(t, m, service, target)
    except runtime_set.RuntimeSetError as e:
        raise DeployError("runtime", str(e)) from e
    sent = _rsync(t, rs.wheels, f"{rel}/wheels", checksum=False, step="runtime")
    runtime = f"{rel}/runtime"
    wheels = " ".join(_sh_path(f"{rel}/wheels/{w.name}") for w in rs.wheels)
    t.run(f"{t.python} - {_sh_path(runtime)} {wheels}", "runtime", stdin=runtime_set.UNPACK)
    edge_chat = f"PYTHONPATH={_sh_path(runtime)} {t.python} -m edge.cli"
    r = t.run(f"PYTHONPATH={_sh_path(runtime)} {t.python} -c 'import edge, edge.cli; print(edge.__file__)'",
              "runtime", check=False)
    if r.returncode != 0:
        raise DeployError("runtime", f"this release's runtime does not import on the device: {r.stderr.strip()[-600:]}")
    rep.add("runtime", f"{rs.summary()} ({sent} wheel(s) sent)", echo)
    return edge_chat


def deploy(bundle_path: str, t: Target, profile: str = "auto", precision: str = FP16, service: bool = False,
           keep: int = 3, reserve_gb: float = 1.0, dry_run: bool = False, device_runtime: bool = False,
           echo=print) -> Report:
    """Preflight, copy + verify, runtime, build-engine, golden, switch, service, prune; any failure raises
    DeployError naming the step, with `current` untouched. device_runtime: use an edgechat already installed
    in the device's Python instead of shipping this one with the release."""
    bundle = Bundle.open(bundle_path, verify="full")
    rep = Report()
    m, rep.target = preflight(t, bundle, reserve_gb, profile, echo)
    rep.machine = m
    rep.add("preflight", "ok", echo)
    if dry_run:
        rep.add("dry-run", "stopping after preflight (nothing copied)", echo)
        return rep
    rid = bundle.manifest.bundle_id
    rep.release = rid
    rel = f"{t.root}/releases/{rid}"
    # copy: rsync skips files already there with the same size+mtime; the device then hashes everything and
    # anything that does not match is sent again, compared by content this time.
    def differing() -> list[str]:  # files on the device whose SHA-256 is not the manifest's
        return json.loads(t.run(f"{t.python} - {rel}/bundle", "verify", stdin=VERIFY).stdout.strip() or "[]")

    sent = _rsync(t, bundle.root, f"{rel}/bundle", checksum=False, step="copy")
    bad = differing()
    if bad:
        rep.add("verify", f"{len(bad)} file(s) differ on the device ({', '.join(bad[:3])}): sending them again", echo)
        sent += _rsync(t, bundle.root, f"{rel}/bundle", checksum=True, step="copy")
        bad = differing()
        if bad:
            raise DeployError("verify", f"{', '.join(bad)} still differ from the manifest after re-sending")
    rep.sent_files = sent
    rep.add("copy", f"{sent} file(s) sent, all {len(bundle.manifest.files)} verified by SHA-256 on the device", echo)

    if device_runtime:
        edge_chat = f"{t.python} -m edge.cli"
        have = t.run(f"{t.python} -c 'import edge.cli'", "runtime", check=False)
        if have.returncode != 0:
            raise DeployError("runtime", "--device-runtime but edgechat is not installed in the device's Python: "
                                         "pip install 'edgechat[serve]' there, or deploy without --device-runtime")
        rep.add("runtime", "using the edgechat installed on the device", echo)
        verdict = device_check(t, m, rep.target, None, rep, echo)
    else:
        edge_chat = install_runtime(t, m, rel, service, rep, echo, rep.target)
        verdict = device_check(t, m, rep.target, _sh_path(f"{rel}/runtime"), rep, echo)
    prof = f"--profile {shlex.quote(profile)}"
    if verdict.engine:
        t.run(f"{edge_chat} build-engine {rel}/bundle {prof} --precision {precision}", "build-engine", timeout=7200)
        rep.add("build-engine", f"TensorRT {m.tensorrt} engine built on the device", echo)
    else:
        # no TensorRT: still check the engine plan is valid for this device, then fall back to ONNX Runtime
        if m.jetson or profile != "auto":
            t.run(f"{edge_chat} build-engine {rel}/bundle {prof} --precision {precision} --dry-run", "build-engine")
        fix = rep.target.tensorrt_install if rep.target and rep.target.tensorrt_install else "sudo apt install python3-libnvinfer"
        why = (f"TensorRT {m.tensorrt} has no Python bindings there ({fix})" if m.tensorrt else "no TensorRT on the device")
        rep.add("build-engine", f"skipped: {why}; it will run with ONNX Runtime", echo)
    r = t.run(f"{edge_chat} golden {rel}/bundle --json", "golden", timeout=3600)
    g = json.loads(r.stdout.strip().splitlines()[-1])
    rep.add("golden", f"answers same as the workstation's: {g['same_as_reference']} (keywords passed "
                      f"{g['golden_passed']}, engine {g['engine']})", echo)

    if service:
        t.run(f"mkdir -p ~/.config/systemd/user && cat > ~/.config/systemd/user/edgechat.service", "service",
              stdin=_unit(t, device_runtime))
    # switch: previous -> old current, current -> this release, each by symlink + rename (atomic)
    t.run(f"cd {t.root_q} && if [ -L current ] && [ \"$(readlink current)\" != releases/{rid} ]; then "
          f"ln -sfn \"$(readlink current)\" previous.tmp && mv -T previous.tmp previous; fi && "
          f"ln -sfn releases/{rid} current.tmp && mv -T current.tmp current", "switch")
    rep.add("switch", f"current -> releases/{rid}", echo)
    if service:
        if m.systemd:
            t.run("systemctl --user daemon-reload && systemctl --user enable --now edgechat.service && "
                  "systemctl --user restart edgechat.service", "service")
            _health(t, "service")
            rep.add("service", "edgechat.service restarted and /health is ok", echo)
        else:
            rep.add("service", "unit written to ~/.config/systemd/user/edgechat.service; systemd is not running "
                               "on the device, so it was not activated", echo)
    pruned = _prune(t, keep)
    if pruned:
        rep.add("prune", f"removed old releases: {', '.join(pruned)}", echo)
    return rep


def _unit(t: Target, device_runtime: bool) -> str:
    root = "%h/" + t.root[2:] if t.root.startswith("~/") else t.root
    env = "" if device_runtime else f"Environment=PYTHONPATH={root}/current/runtime\n"
    return (f"[Unit]\nDescription=EdgeChat chat server\nAfter=network.target\n\n[Service]\n{env}"
            f"ExecStart={t.python} -m edge.cli serve {root}/current/bundle --host 127.0.0.1\n"
            "Restart=on-failure\nRestartSec=5\n\n[Install]\nWantedBy=default.target\n")


def _health(t: Target, step: str, tries: int = 60) -> None:
    for _ in range(tries):
        r = t.run("curl -fsS http://127.0.0.1:7860/health", step, check=False)
        if r.returncode == 0:
            return
        time.sleep(2)
    raise DeployError(step, "the service did not answer /health within 2 minutes (journalctl --user -u edgechat)")


def _prune(t: Target, keep: int) -> list[str]:
    """Keep at most `keep` releases, counting current and previous, which are never removed."""
    r = t.run(f"cd {t.root_q}/releases && cur=$(basename \"$(readlink ../current)\"); "
              f"prev=$(basename \"$(readlink ../previous 2>/dev/null)\" 2>/dev/null); "
              f"n=0; [ -d \"$cur\" ] && n=$((n+1)); [ -n \"$prev\" ] && [ \"$prev\" != \"$cur\" ] && [ -d \"$prev\" ] && n=$((n+1)); "
              f"room=$(( {keep} - n )); [ $room -lt 0 ] && room=0; "
              f"ls -1t | while read d; do [ \"$d\" = \"$cur\" ] || [ \"$d\" = \"$prev\" ] || echo \"$d\"; done | "
              f"tail -n +$((room + 1)) | while read d; do rm -rf \"$d\" && echo \"$d\"; done", "prune")
    return [x for x in r.stdout.split() if x]


def rollback(t: Target, echo=print) -> str:
    r = t.run(f"cd {t.root_q} && [ -L previous ] && old=$(readlink current) && new=$(readlink previous) && "
              f"ln -sfn \"$new\" current.tmp && mv -T current.tmp current && "
              f"ln -sfn \"$old\" previous.tmp && mv -T previous.tmp previous && echo \"$new\"", "rollback", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise DeployError("rollback", "there is no previous release to return to")
    echo(f"[rollback] current -> {r.stdout.strip()}")
    return r.stdout.strip()
