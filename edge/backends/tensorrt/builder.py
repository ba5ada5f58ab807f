"""Build a TensorRT engine from a bundle's ONNX graph, on the machine that will run it.

Lives in `edge/` because Jetson engines are built on the Jetson (TensorRT cannot cross-build for it).
Everything decided before TensorRT is called is in `edge.backends.tensorrt.settings` (pure, tested everywhere);
`plan_build` gathers it and refuses early (wrong precision, not enough RAM). `build_engine` is the thin
part that calls TensorRT, writes the engine beside the bundle's files (temp file, fsync), re-asks the
golden prompts with it, and only then renames it into place and records it in the manifest: an engine
that does not load or answer leaves the bundle as it was (a deploy then keeps the previous release).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from edge import precisions
from edge.bundle import Bundle, EngineEntry, FileEntry, Fingerprint, sha256_file
from edge.errors import BundleError
from edge.io_contract import DecoderIO
from edge.device.machine import Machine
from edge.precisions import FP16
from edge.device.profiles import DeviceProfile, load_profile
from edge.backends.tensorrt.settings import (BuilderSettings, builder_settings, check_build_ram, mem_available_gb,
                                             swap_free_gb)

if TYPE_CHECKING:  # mypy checks the TensorRT calls against tensorrt-stubs (scripts/typecheck.sh)
    import tensorrt as trt

log = logging.getLogger("edgechat")


@dataclass
class BuildPlan:
    bundle: Bundle
    profile: DeviceProfile
    source: EngineEntry
    settings: BuilderSettings
    tensorrt_version: str
    ram_needed_gb: float
    ram_available_gb: float | None

    @property
    def engine_name(self) -> str:
        return f"trt-{self.settings.precision}-sm{self.settings.gpu_sm.replace('.', '')}"

    def summary(self) -> dict:
        return {"engine": self.engine_name, "from": self.source.file, "device": self.profile.id,
                "tensorrt": self.tensorrt_version, "ram_needed_gb": round(self.ram_needed_gb, 2),
                "ram_available_gb": self.ram_available_gb and round(self.ram_available_gb, 2),
                "settings": self.settings.to_dict()}


def _weight_bytes(bundle: Bundle, entry: EngineEntry) -> int:
    folder = bundle.path(entry.file).parent
    return sum(f.stat().st_size for f in folder.glob("model.onnx*"))


def plan_build(bundle: Bundle, profile: DeviceProfile | str, precision: str = FP16,
               tensorrt_version: str | None = None, max_batch: int | None = None, max_context: int | None = None,
               optimization_level: int = 3, version_compatible: bool = False,
               available_gb: float | None = None, prefill_chunk: int | None = None) -> BuildPlan:
    """Everything up to the TensorRT call: source graph, settings, RAM check. Raises with what to do.
    `prefill_chunk`: the most prompt tokens one call takes (default: the graph's I/O contract's); the
    runtime reads it back from the engine's prefill profile."""
    prof = load_profile(profile) if isinstance(profile, str) else profile
    m = bundle.manifest
    wanted = precisions.PRECISIONS[precision].trt_sources if precision in precisions.PRECISIONS else ()
    if not wanted:
        raise BundleError(f"no TensorRT engine precision '{precision}': choose {', '.join(precisions.TENSORRT)}")
    onnx = {e.fingerprint.precision: e for e in m.engines if e.fingerprint.format == "onnx"
            and e.fingerprint.variant == "plain"}
    source = next((onnx[p] for p in wanted if p in onnx), None)
    if source is None:
        raise BundleError(f"the {precision} engine is built from the bundle's {' or '.join(wanted)} ONNX graph, which "
                          f"this bundle lacks (it has {', '.join(sorted(onnx)) or 'none'}): rebuild it with "
                          f"edge-export build --precision {wanted[-1]}")
    check = source.quality.get("tensorrt_check")
    if check and not check.get("compatible", True):
        raise BundleError(f"the export-time TensorRT check failed for {source.file}: {'; '.join(check['problems'])}")
    trt = tensorrt_version or (prof.tensorrt_versions[0] if prof.tensorrt_versions else None)
    if not trt:
        raise BundleError(f"{prof.display_name} has no TensorRT")
    io = DecoderIO.from_dict(m.engine_io(source))
    if prefill_chunk:
        io = dataclasses.replace(io, prefill_chunk=prefill_chunk)
    settings = builder_settings(prof, m.model, io, precision, trt,
                                graph_precision=source.fingerprint.precision if source.fingerprint.precision !=
                                precisions.INT8_QDQ else precisions.REFERENCE,
                                max_batch=max_batch, max_context=max_context, optimization_level=optimization_level,
                                version_compatible=version_compatible)
    have = available_gb if available_gb is not None else mem_available_gb()
    need = check_build_ram(_weight_bytes(bundle, source), have, prof, settings.max_context,
                           swap_gb=swap_free_gb() if available_gb is None else 0.0)
    return BuildPlan(bundle, prof, source, settings, trt, need, have)


def _network(builder: "trt.Builder", logger: "trt.ILogger", onnx_path: Path,
             strongly_typed: bool) -> "tuple[trt.INetworkDefinition, trt.OnnxParser]":
    import tensorrt as trt

    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from file: external weights next to it are found
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BundleError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    return network, parser


def build_engine(plan: BuildPlan, machine: Machine,
                 recheck: Callable[[Path, EngineEntry], dict] | None = None) -> EngineEntry:
    """Build, fingerprint, run `recheck` on the new engine file (edge.decode.golden.engine_recheck: the golden
    prompts, whose counts join the entry's quality), then write it into the bundle. Needs TensorRT and a GPU.
    The golden check lives above the backends: the caller passes it."""
    from edge.backends.tensorrt.runtime import import_tensorrt

    import_tensorrt()  # the one-line "pip install / apt install" error when it is missing
    import tensorrt as trt

    s = plan.settings
    if plan.tensorrt_version.split(".")[0] != trt.__version__.split(".")[0]:
        log.warning("settings were planned for TensorRT %s; building with %s", plan.tensorrt_version, trt.__version__)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _network(builder, logger, plan.bundle.path(plan.source.file), s.strongly_typed)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, s.workspace_bytes)
    config.builder_optimization_level = s.optimization_level
    for flag in s.flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for sp in s.profiles:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in sp.shapes.items():
            p.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        if config.add_optimization_profile(p) < 0:  # TensorRT's answer to an invalid profile (min <= opt <= max)
            raise BundleError(f"TensorRT refused the '{sp.name}' optimization profile {sp.shapes}; see its messages above")
    cache_path = Path(s.timing_cache)
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    t0 = time.perf_counter()
    log.info("building %s for %s (this takes minutes)", plan.engine_name, plan.profile.display_name)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise BundleError(f"TensorRT failed to build {plan.engine_name}; see the TensorRT messages above "
                          "(lower --max-context or --max-batch if it ran out of memory)")
    seconds = time.perf_counter() - t0
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_cache = cache_path.with_suffix(".tmp")
    tmp_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    os.replace(tmp_cache, cache_path)

    rel = f"engines/{plan.engine_name}/model.engine"
    dst = plan.bundle.path(rel)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(memoryview(blob))
        f.flush()
        os.fsync(f.fileno())
    fp = Fingerprint(format="tensorrt", precision=s.precision, opset=plan.source.fingerprint.opset,
                     variant="plain", providers=[], tensorrt_version=trt.__version__, cuda_version=machine.cuda,
                     gpu_sm=machine.gpu_sm or s.gpu_sm, gpu_name=machine.gpu_name,
                     shapes={p.name: {k: [list(x) for x in v] for k, v in p.shapes.items()} for p in s.profiles},
                     version_compatible=s.version_compatible)
    entry = EngineEntry(name=plan.engine_name, file=rel, fingerprint=fp,
                        quality={"build_seconds": round(seconds, 1), "built_from": plan.source.name,
                                 "device_profile": plan.profile.id, "size_bytes": tmp.stat().st_size})
    if recheck is not None:
        try:
            entry = dataclasses.replace(entry, quality=entry.quality | recheck(tmp, entry))
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise BundleError(f"the new engine {plan.engine_name} did not pass its golden re-check ({type(e).__name__}: "
                              f"{e}); the bundle is unchanged") from e
    os.replace(tmp, dst)
    m = plan.bundle.manifest
    files = dict(m.files) | {rel: FileEntry(dst.stat().st_size, sha256_file(dst))}
    engines = [e for e in m.engines if e.name != entry.name] + [entry]
    plan.bundle.update_manifest(dataclasses.replace(m, engines=engines, files=files))
    return entry
