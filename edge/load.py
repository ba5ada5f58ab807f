"""From a bundle to a running decoder: the one place that knows every backend.

`edge.backends.decide` reads the manifest and the machine and names a backend and an engine; this
module builds that decoder, and falls back along the chain when an engine whose fingerprint matched
still fails to load. Backend modules never import each other: only this loader imports both.
"""

from __future__ import annotations

import dataclasses
import logging

from edge import precisions
from edge.backends import Choice, decide
from edge.bundle import Bundle, EngineEntry
from edge.decoder import Decoder
from edge.errors import BundleError, EdgeChatError
from edge.machine import detect

log = logging.getLogger("edgechat")


def pick_engine(bundle: Bundle, name: str | None = None, prefer_gpu: bool = False) -> EngineEntry:
    """An ONNX engine: by name, else the best-ranked precision the bundle has for CPU (or a GPU execution
    provider), its table variant first."""
    m = bundle.manifest
    if name:
        return m.engine(name)
    onnx = [e for e in m.engines if e.fingerprint.format == "onnx"]
    if not onnx:
        raise BundleError("bundle has no ONNX engine to run with ONNX Runtime")
    order = precisions.order("cuda" if prefer_gpu else "cpu")

    def rank(e: EngineEntry) -> tuple[int, bool]:
        p = e.fingerprint.precision
        table_variant = precisions.PRECISIONS[p].variant if p in precisions.PRECISIONS else "plain"
        return (order.index(p) if p in order else 99, e.fingerprint.variant != table_variant)

    return min(onnx, key=rank)


def _ort_decoder(bundle: Bundle, entry: EngineEntry, threads: int | None, providers: list[str] | None,
                 spin: bool) -> Decoder:
    from edge.ort_decoder import OrtDecoder

    return OrtDecoder.from_entry(bundle, entry, threads, providers, spin)


def _tensorrt_decoder(bundle: Bundle, entry: EngineEntry) -> Decoder:
    from edge.tensorrt.runtime import TensorRTDecoder

    return TensorRTDecoder.from_entry(bundle, entry)


def load_decoder(bundle: Bundle, engine: str | None = None, threads: int | None = None,
                 providers: list[str] | None = None, spin: bool = True) -> tuple[Decoder, Choice | None]:
    """The decoder the fallback chain picks here (and the choice, with why each step was passed over),
    unless `providers` forces ONNX Runtime execution providers (then the choice is None)."""
    m = bundle.manifest
    if providers is not None:
        want_gpu = any("CUDA" in p or "Tensorrt" in p for p in providers)
        return _ort_decoder(bundle, pick_engine(bundle, engine, prefer_gpu=want_gpu), threads, providers, spin), None
    here = detect()
    choice = decide(m, here, engine)
    failed: list[str] = []
    dropped: set[str] = set()
    dec: Decoder | None = None
    while choice.backend == "tensorrt":  # an engine whose fingerprint matches can still fail to load
        try:
            dec = _tensorrt_decoder(bundle, m.engine(choice.engine))
            break
        except EdgeChatError as e:
            if engine:  # asked for by name: no fallback
                raise
            failed.append(f"TensorRT '{choice.engine}': it did not load here: {e}")
            dropped.add(choice.engine)
            choice = decide(dataclasses.replace(m, engines=[x for x in m.engines if x.name not in dropped]), here)
    choice = dataclasses.replace(choice, skipped=failed + choice.skipped)
    for line in choice.skipped:
        (log.warning if line.startswith("TensorRT '") else log.info)("skipped %s", line)
    log.info("running %s", choice.describe())
    if dec is None:
        dec = _ort_decoder(bundle, m.engine(choice.engine), threads, list(choice.providers), spin)
    return dec, choice
