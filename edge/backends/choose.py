"""Which backend runs a bundle here, and building it: the one place that knows every backend.

    TensorRT engine whose fingerprint matches this GPU and TensorRT
      -> ONNX Runtime with the TensorRT or CUDA execution provider
      -> ONNX Runtime on CPU

Every step that is passed over says why in one line ("engine built for SM 8.7 with TensorRT 10.3;
this is SM 7.5 with TensorRT 10.8"), so `edge-chat info` can show the whole reasoning and the runtime
can log it. `decide` reads only the manifest and a `Machine` and touches no GPU; `load_decoder` builds the
decoder it names, and falls back along the chain when an engine whose fingerprint matched still fails to
load. Backend modules never import each other: only this module imports them (lazily, so a machine without
TensorRT or ONNX Runtime loads it).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from edge import precisions
from edge.backends.decoder import Decoder
from edge.bundle import Bundle, EngineEntry, Fingerprint, Manifest
from edge.errors import BundleError, EdgeChatError
from edge.device.machine import Machine, detect
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
    if fp.precision in precisions.PRECISIONS and (why := precisions.sm_refusal(fp.precision, m.gpu_sm)):
        return f"{built}; {why}"
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


# -- building the chosen decoder ----------------------------------------------------------------------

log = logging.getLogger("edgechat")
DEFAULT_EP_BATCH = 8  # the TensorRT EP's decode profile where no device profile matches this GPU


def pick_engine(bundle: Bundle, name: str | None = None, prefer_gpu: bool = False,
                providers: list[str] | None = None) -> EngineEntry:
    """An ONNX engine: by name, else what the fallback chain (edge.backends.choose.decide) takes for these ONNX Runtime
    execution providers: the TensorRT EP's order, then the CUDA EP's (`prefer_gpu`), then CPU's, each the
    best-ranked precision the bundle has, its table variant first."""
    m = bundle.manifest
    if name:
        return m.engine(name)
    onnx = [e for e in m.engines if e.fingerprint.format == "onnx"]
    if not onnx:
        raise BundleError("bundle has no ONNX engine to run with ONNX Runtime")
    eps = providers or []
    kinds = (["ort_trt"] if any("Tensorrt" in p for p in eps) else []) \
        + (["cuda"] if prefer_gpu or any("CUDA" in p or "Tensorrt" in p for p in eps) else []) + ["cpu"]
    for kind in kinds:
        e = first_engine(onnx, precisions.order(kind))
        if e is not None:
            return e
    return onnx[0]  # no precision the table ranks: the bundle's first (ONNX Runtime says if it cannot run it)


TRT_EP = "TensorrtExecutionProvider"


def _ort_decoder(bundle: Bundle, entry: EngineEntry, threads: int | None, providers: list[str] | None,
                 spin: bool, here: Machine | None = None) -> Decoder:
    from edge.backends.onnxruntime import OrtDecoder

    asked: list | None = list(providers) if providers is not None else None
    if asked and TRT_EP in asked:  # the EP gets the engine's shape profiles, or it rebuilds as the past grows
        asked[asked.index(TRT_EP)] = (TRT_EP, tensorrt_ep_options(bundle, entry, here or detect()))
    return OrtDecoder.from_entry(bundle, entry, threads, asked, spin)


def tensorrt_ep_options(bundle: Bundle, entry: EngineEntry, here: Machine) -> dict[str, str]:
    """The TensorRT EP's profiles for this machine's device profile (batch and context), else the model's
    context and the default batch."""
    from edge.io_contract import DecoderIO
    from edge.device.profiles import load_profile
    from edge.backends.tensorrt.settings import ort_tensorrt_options

    m = bundle.manifest
    batch, context = DEFAULT_EP_BATCH, m.model.max_context
    if here.profile:
        prof = load_profile(here.profile)
        batch, context = prof.max_batch, min(prof.max_context, context)
    return ort_tensorrt_options(m.model, DecoderIO.from_dict(m.engine_io(entry)), batch, context)


def engine_file_decoder(bundle: Bundle, entry: EngineEntry, path) -> Decoder:
    """A TensorRT engine file not yet in the manifest (a build's, before its golden check), loaded as `entry`."""
    from edge.backends.tensorrt.runtime import TensorRTDecoder
    from edge.io_contract import DecoderIO

    m = bundle.manifest
    dec = TensorRTDecoder(path, m.model, DecoderIO.from_dict(m.engine_io(entry)), name=entry.file,
                          version_compatible=entry.fingerprint.version_compatible)
    dec.engine = entry
    return dec


def _tensorrt_decoder(bundle: Bundle, entry: EngineEntry) -> Decoder:
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    return TensorRTDecoder.from_entry(bundle, entry)


def load_decoder(bundle: Bundle, engine: str | None = None, threads: int | None = None,
                 providers: list[str] | None = None, spin: bool = True) -> tuple[Decoder, Choice | None]:
    """The decoder the fallback chain picks here (and the choice, with why each step was passed over),
    unless `providers` forces ONNX Runtime execution providers (then the choice is None)."""
    m = bundle.manifest
    if providers is not None:
        return _ort_decoder(bundle, pick_engine(bundle, engine, providers=providers), threads, providers, spin), None
    here = detect()
    choice = decide(m, here, engine)
    failed: list[str] = []
    dropped: set[str] = set()
    dec: Decoder | None = None
    while choice.backend == "tensorrt":  # an engine whose fingerprint matches can still fail to load
        try:
            dec = _tensorrt_decoder(bundle, m.engine(choice.engine))
            break
        except Exception as e:  # TensorRT and the CUDA bindings raise their own types (RuntimeError, TypeError...)
            if engine:  # asked for by name: no fallback
                raise
            why = str(e) if isinstance(e, EdgeChatError) else f"{type(e).__name__}: {e}"
            failed.append(f"TensorRT '{choice.engine}': it did not load here: {why}")
            dropped.add(choice.engine)
            choice = decide(dataclasses.replace(m, engines=[x for x in m.engines if x.name not in dropped]), here)
    if failed:  # the engines left out above are not "no TensorRT engine in the bundle"
        choice = dataclasses.replace(choice, skipped=[s for s in choice.skipped if not s.startswith("TensorRT: ")])
    choice = dataclasses.replace(choice, skipped=failed + choice.skipped)
    for line in choice.skipped:
        (log.warning if line.startswith("TensorRT '") else log.info)("skipped %s", line)
    log.info("running %s", choice.describe())
    if dec is None:
        dec = _ort_decoder(bundle, m.engine(choice.engine), threads, list(choice.providers), spin, here)
    return dec, choice
