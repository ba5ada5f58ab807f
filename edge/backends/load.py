"""From a bundle to a running decoder: the one place that knows every backend.

`edge.backends.choose.decide` reads the manifest and the machine and names a backend and an engine; this
module builds that decoder, and falls back along the chain when an engine whose fingerprint matched
still fails to load. Backend modules never import each other: only this loader imports both.
"""

from __future__ import annotations

import dataclasses
import logging

from edge import precisions
from edge.backends.choose import Choice, decide, first_engine
from edge.bundle import Bundle, EngineEntry
from edge.backends.decoder import Decoder
from edge.errors import BundleError, EdgeChatError
from edge.device.machine import Machine, detect

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
