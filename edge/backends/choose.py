"""Which backend runs a bundle here: the fallback chain, as one pure decision.

    TensorRT engine whose fingerprint matches this GPU and TensorRT
      -> ONNX Runtime with the TensorRT or CUDA execution provider
      -> ONNX Runtime on CPU

Every step that is passed over says why in one line ("engine built for SM 8.7 with TensorRT 10.3;
this is SM 7.5 with TensorRT 10.8"), so `edge-chat info` can show the whole reasoning and the runtime
can log it. `decide` reads only the manifest and a `Machine`; nothing here touches a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge import precisions
from edge.bundle import EngineEntry, Fingerprint, Manifest
from edge.errors import BundleError
from edge.device.machine import Machine
from edge.device.runtimes import CUDA_PYTHON_ADVICE

CPU_ORDER = precisions.order("cpu")
CUDA_ORDER = precisions.order("cuda")
ORT_TRT_ORDER = precisions.order("ort_trt")


@dataclass(frozen=True)
class Choice:
    backend: str  # tensorrt | onnxruntime-tensorrt | onnxruntime-cuda | onnxruntime-cpu
    engine: str  # manifest engine name
    providers: tuple[str, ...] = ()
    skipped: list[str] = field(default_factory=list)  # one line per step passed over, in chain order

    def describe(self) -> str:
        how = {"tensorrt": "TensorRT engine", "onnxruntime-tensorrt": "ONNX Runtime TensorRT EP",
               "onnxruntime-cuda": "ONNX Runtime CUDA EP", "onnxruntime-cpu": "ONNX Runtime on CPU"}[self.backend]
        return f"'{self.engine}' with {how}"


def _version_tuple(v: str | None) -> tuple[int, ...]:
    out = []
    for part in (v or "").split(".")[:3]:
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def engine_mismatch(fp: Fingerprint, m: Machine) -> str | None:
    """Why a TensorRT engine cannot run on this machine, or None if it can."""
    built = f"engine built for SM {fp.gpu_sm} with TensorRT {fp.tensorrt_version}"
    if not m.has_gpu:
        return f"{built}; this machine has no usable NVIDIA GPU ({m.gpu_error or 'none found'})"
    here = f"this is SM {m.gpu_sm} with TensorRT {m.tensorrt or 'not installed'}"
    if str(fp.gpu_sm) != str(m.gpu_sm):
        return f"{built}; {here}"
    if not m.tensorrt:
        return f"{built}; {here}"
    b, h = _version_tuple(fp.tensorrt_version), _version_tuple(m.tensorrt)
    if fp.version_compatible:
        if not b or not h or b[0] != h[0] or h < b:
            return f"{built} (version-compatible: TensorRT {b[0] if b else '?'}.x >= {fp.tensorrt_version}); {here}"
    elif not b or not h or b != h[:len(b)]:
        return f"{built}; {here} (engines run only on the TensorRT that built them)"
    if m.tensorrt_source and "python" not in m.tensorrt_source:
        return f"TensorRT {m.tensorrt} is here but not its Python bindings (apt install python3-libnvinfer on Jetson)"
    if not m.cuda_bindings:
        return f"no CUDA Python bindings for device buffers: {CUDA_PYTHON_ADVICE}"
    return None


def first_engine(engines: list[EngineEntry], order: tuple[str, ...]) -> EngineEntry | None:
    """The ONNX engine of the best-ranked precision in `order`; between two of one precision, the table's variant
    (edge.precisions); then the manifest's order. None when no engine's precision is in `order`."""
    onnx = [e for e in engines if e.fingerprint.format == "onnx" and e.fingerprint.precision in order]
    onnx.sort(key=lambda e: (order.index(e.fingerprint.precision),
                             e.fingerprint.variant != precisions.get(e.fingerprint.precision).variant))
    return onnx[0] if onnx else None


def decide(manifest: Manifest, m: Machine, engine: str | None = None) -> Choice:
    """The backend for this bundle on this machine. `engine` forces one manifest engine by name."""
    engines = manifest.engines
    if engine:
        engines = [manifest.engine(engine)]
    skipped: list[str] = []
    trt = [e for e in engines if e.fingerprint.format == "tensorrt"]
    if not trt:
        skipped.append("TensorRT: the bundle has no TensorRT engine"
                       + (" (build one on this device: edge-chat build-engine BUNDLE)" if m.has_gpu else ""))
    for t in trt:
        why = engine_mismatch(t.fingerprint, m)
        if why is None:
            return Choice("tensorrt", t.name, (), skipped)
        skipped.append(f"TensorRT '{t.name}': {why}")

    providers = set(m.ort_providers)
    if not m.onnxruntime:
        raise BundleError("ONNX Runtime is not installed and no TensorRT engine can run here: "
                          "pip install 'edgechat[cpu]' (or 'edgechat[gpu]' on a T4/L4 with a CUDA 12 driver; on a Jetson, "
                          "JetPack's onnxruntime-gpu from a Jetson index: docs/deploy.md, 'What to install, per target')")
    gpu_eps = providers & {"TensorrtExecutionProvider", "CUDAExecutionProvider"}
    if not gpu_eps:
        skipped.append(f"ONNX Runtime GPU: onnxruntime {m.onnxruntime} here has only {', '.join(sorted(providers))}"
                       + (" (install onnxruntime-gpu instead of onnxruntime)" if m.has_gpu else ""))
    elif not m.has_gpu:
        skipped.append(f"ONNX Runtime GPU: {', '.join(sorted(gpu_eps))} installed but no usable GPU "
                       f"({m.gpu_error or 'none found'})")
    else:
        if "TensorrtExecutionProvider" in gpu_eps and m.tensorrt:
            e = first_engine(engines, ORT_TRT_ORDER)
            if e:
                return Choice("onnxruntime-tensorrt", e.name,
                              ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"), skipped)
            skipped.append(f"ONNX Runtime TensorRT EP: no {'/'.join(ORT_TRT_ORDER)} graph in the bundle")
        if "CUDAExecutionProvider" in gpu_eps:
            e = first_engine(engines, CUDA_ORDER)
            if e:
                return Choice("onnxruntime-cuda", e.name, ("CUDAExecutionProvider", "CPUExecutionProvider"), skipped)
            skipped.append(f"ONNX Runtime CUDA EP: no graph the CUDA EP runs well ({', '.join(CUDA_ORDER)})")
    e = first_engine(engines, CPU_ORDER)
    if e is None:
        have = ", ".join(f"{x.name} ({x.fingerprint.format})" for x in engines) or "none"
        raise BundleError(f"nothing in this bundle runs on this machine (engines: {have}); {'; '.join(skipped)}")
    return Choice("onnxruntime-cpu", e.name, ("CPUExecutionProvider",), skipped)
