"""TensorRT builder settings from a device profile, as pure functions (no tensorrt import).

Everything the builder decides before calling TensorRT is here so it can be
checked on any machine: optimization-profile shapes for batch, sequence and past
length; precision and network flags per TensorRT major version (10 takes FP16 as
a builder flag; 11 removed precision flags, so only strongly typed graphs);
workspace limit from the profile's usable memory; the timing-cache path; and the
host-RAM estimate that refuses a build bound to fail.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edge import precisions
from edge.bundle import ModelDims
from edge.errors import EdgeChatError
from edge.io_contract import DecoderIO
from edge.precisions import BF16, FP16, FP32
from edge.device.profiles import DeviceProfile

# What an engine build holds in memory, from NVIDIA's account of it (TensorRT Developer Guide, "How TensorRT Works" >
# "Memory" > "The Build Phase", docs.nvidia.com/deeplearning/tensorrt/latest/architecture/how-trt-works.html):
# "there will typically be at least two copies of the weights in host memory: those from the original network and
# those included as part of the engine as it is built", more only where TensorRT combines weights (a convolution
# with its batch norm: these decoder graphs have none). The original network's copy is the ONNX graph the parser
# read, the engine's is the engine's weights: both ordinary pageable host memory, which swap can hold. The builder
# also allocates device memory to time kernels (its workspace pool, `workspace_bytes`) and loads the CUDA context and
# TensorRT's libraries (the profile's runtime_overhead_gb); on a Jetson CPU and GPU share one memory, so both come
# out of the same RAM and stay resident. TensorRT engines for a Jetson are built on the Jetson (engines are not
# portable across platforms or GPU models: TensorRT support matrix, "Engine Portability"; the profile's
# build_on_device), so these are the device's numbers, not the workstation's.
TENSORRT_BUILD_WEIGHT_COPIES = 2
GiB = 1 << 30
MiB = 1 << 20


class BuildSettingsError(EdgeChatError):
    """The requested engine cannot be built for this device / TensorRT version."""


class InsufficientMemoryError(EdgeChatError):
    """The engine build would run out of host RAM."""


@dataclass(frozen=True)
class ShapeProfile:
    """One TensorRT optimization profile: (min, opt, max) per dynamic input."""

    name: str
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class BuilderSettings:
    device: str
    precision: str
    tensorrt_major: int
    strongly_typed: bool
    flags: tuple[str, ...]  # tensorrt.BuilderFlag names
    workspace_bytes: int
    max_batch: int
    max_context: int
    profiles: tuple[ShapeProfile, ...]
    optimization_level: int = 3
    version_compatible: bool = False
    timing_cache: str = ""
    gpu_sm: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["profiles"] = [{"name": p.name, "shapes": {k: [list(s) for s in v] for k, v in p.shapes.items()}}
                         for p in self.profiles]
        return d


def tensorrt_major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise BuildSettingsError(f"cannot read a TensorRT version from '{version}'") from None


def shape_profiles(dims: ModelDims, io: DecoderIO, max_batch: int, max_context: int) -> tuple[ShapeProfile, ...]:
    """Two profiles, as LLM engines use: prefill (batch 1, a prompt chunk after any past) and decode
    (one token per sequence, up to max_batch sequences, past up to the context)."""
    kvh, hd = dims.num_kv_heads, dims.head_dim
    chunk = min(io.prefill_chunk, max_context)  # the runtime cuts prompts to the I/O contract's chunk

    def with_kv(tokens: dict, batch: tuple[int, int, int], past: tuple[int, int, int]) -> dict:
        shapes = dict(tokens)
        for name in io.past_names(dims.num_layers):
            shapes[name] = tuple((b, kvh, p, hd) for b, p in zip(batch, past))
        return shapes

    # a prompt's chunks start at multiples of the chunk, so the last one can start anywhere below the
    # context (at 240 of 256 with 24-token chunks): past up to context - 1; past + tokens <= context is the
    # runtime's to keep. TensorRT shape-checks the network at each of min, opt and max, so each point is one
    # the graph can run: the mask is always past + tokens long (at max, past + chunk, beyond any real call).
    # opt: a full chunk after a quarter of the context (where a chat's later chunks land), not an empty past.
    pb, ps = (1, 1, 1), (1, chunk, chunk)
    pp = (0, min(max_context // 4, max_context - 1), max_context - 1)
    prefill = {io.input_ids: tuple((b, s) for b, s in zip(pb, ps)),
               io.position_ids: tuple((b, s) for b, s in zip(pb, ps)),
               io.attention_mask: tuple((b, p + s) for b, p, s in zip(pb, pp, ps))}
    db = (1, max(1, max_batch // 2), max_batch)
    dp = (1, max_context // 4, max_context - 1)
    decode = {io.input_ids: tuple((b, 1) for b in db), io.position_ids: tuple((b, 1) for b in db),
              io.attention_mask: tuple((b, p + 1) for b, p in zip(db, dp))}
    return (ShapeProfile("prefill", with_kv(prefill, pb, pp)), ShapeProfile("decode", with_kv(decode, db, dp)))


def ort_tensorrt_options(dims: ModelDims, io: DecoderIO, max_batch: int, max_context: int,
                         cache_root: str | os.PathLike | None = None) -> dict[str, str]:
    """Provider options for ONNX Runtime's TensorRT execution provider from the same I/O contract and profiles
    an EdgeChat engine is built with. Without explicit profiles the EP builds an engine for the shapes it has
    seen and rebuilds whenever one leaves them, and a decoder's past grows every token (minutes per token);
    with them it builds once, and the engine cache keeps that build across restarts. Each input is named
    once per profile (ONNX Runtime reads repeated names as further profiles). Precision comes from the graph."""
    profiles = shape_profiles(dims, io, max_batch, max_context)

    def shapes(k: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in dims_[k])}" for p in profiles
                        for name, dims_ in p.shapes.items())

    base = Path(cache_root) if cache_root else Path(os.environ.get("EDGECHAT_CACHE") or Path.home() / ".cache" / "edgechat")
    cache = base / "ort-tensorrt"
    return {"trt_profile_min_shapes": shapes(0), "trt_profile_opt_shapes": shapes(1),
            "trt_profile_max_shapes": shapes(2), "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(cache), "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": str(cache)}


def workspace_bytes(profile: DeviceProfile) -> int:
    """A quarter of the memory left after the runtime's own overhead, in [256 MiB, 4 GiB], whole MiB."""
    spare = (profile.usable_memory_gb - profile.facts.get("runtime_overhead_gb", 0.0)) * GiB
    return int(min(4 * GiB, max(256 * MiB, spare / 4)) // MiB * MiB)


def timing_cache_path(gpu_sm: str, trt_version: str, root: str | os.PathLike | None = None) -> Path:
    """One persistent timing cache per GPU architecture and TensorRT version (reused across builds)."""
    base = Path(root) if root else Path(os.environ.get("EDGECHAT_CACHE") or Path.home() / ".cache" / "edgechat")
    return base / "tensorrt" / f"timing-sm{gpu_sm.replace('.', '')}-trt{trt_version}.cache"


def builder_settings(profile: DeviceProfile, dims: ModelDims, io: DecoderIO, precision: str, trt_version: str,
                     graph_precision: str | None = None, max_batch: int | None = None, max_context: int | None = None,
                     optimization_level: int = 3, version_compatible: bool = False,
                     cache_root: str | os.PathLike | None = None) -> BuilderSettings:
    """What to ask TensorRT for. `precision`: the engine's (fp16, int8-qdq, fp32, bf16, fp8);
    `graph_precision`: the ONNX file's own type (fp32 or fp16; defaults to fp32, what bundles hold)."""
    if not profile.is_gpu:
        raise BuildSettingsError(f"{profile.id} has no NVIDIA GPU: TensorRT engines are for GPU targets")
    major = tensorrt_major(trt_version)
    if major < 10:
        raise BuildSettingsError(f"TensorRT {trt_version} is too old: EdgeChat builds with TensorRT 10 or newer "
                                 "(JetPack 6.x brings 10.3)")
    if precisions.get(precision).variant == "fused":
        raise BuildSettingsError(f"'{precision}' is an ONNX Runtime graph (MatMulNBits/dynamic INT8); "
                                 "TensorRT builds from the fp32/fp16 or int8-qdq graph")
    if why := precisions.sm_refusal(precision, str(profile.compute_capability)):
        fits = [p for p in precisions.TENSORRT if profile.supports(p) and not precisions.sm_refusal(p, str(profile.compute_capability))]
        raise BuildSettingsError(f"{profile.display_name}: {why} (build one of {', '.join(fits)} for it)")
    if not profile.supports(precision):
        raise BuildSettingsError(f"{profile.display_name} (SM {profile.compute_capability}) does not support "
                                 f"{precision}; it supports {', '.join(profile.precisions)}")
    graph = graph_precision or FP32
    flags: list[str] = []
    strongly_typed = False
    if precisions.get(precision).quantized:  # int8-qdq, int4-qdq, fp8-qdq (the fused ones were refused above)
        strongly_typed = True  # explicit Q/DQ: types come from the graph, no precision flags (TRT 10 and 11)
    elif precision in (FP16, BF16):
        if graph == precision:
            strongly_typed = True
        elif major >= 11:
            raise BuildSettingsError(f"TensorRT {trt_version} builds only strongly typed networks (the {precision.upper()} "
                                     f"builder flag is gone): export a {precision} graph first "
                                     f"(edge-export build --precision {precision}) or use TensorRT 10")
        else:
            flags.append(precision.upper())
    elif precision == FP32:
        strongly_typed = major >= 11
    if version_compatible:
        flags.append("VERSION_COMPATIBLE")
    batch = min(max_batch or profile.max_batch, profile.max_batch)
    context = min(max_context or profile.max_context, profile.max_context, dims.max_context)
    if context < 2 or batch < 1:
        raise BuildSettingsError(f"max context {context} / batch {batch} too small for an engine")
    if not 0 <= optimization_level <= 5:
        raise BuildSettingsError(f"builder optimization level must be 0-5, got {optimization_level}")
    sm = str(profile.compute_capability)
    return BuilderSettings(
        device=profile.id, precision=precision, tensorrt_major=major, strongly_typed=strongly_typed,
        flags=tuple(flags), workspace_bytes=workspace_bytes(profile), max_batch=batch, max_context=context,
        profiles=shape_profiles(dims, io, batch, context), optimization_level=optimization_level,
        version_compatible=version_compatible, timing_cache=str(timing_cache_path(sm, trt_version, cache_root)),
        gpu_sm=sm)


@dataclass(frozen=True)
class BuildRam:
    """An engine build's peak memory (bytes): the weights' copies (pageable: swap can hold them) and what must stay
    resident (the CUDA context and libraries; on unified memory also the builder's workspace)."""

    pageable: float
    resident: float

    @property
    def total_gb(self) -> float:
        return (self.pageable + self.resident) / 1e9

    def fits(self, ram_gb: float, swap_gb: float = 0.0) -> bool:
        return self.resident / 1e9 <= ram_gb and self.total_gb <= ram_gb + swap_gb

    def swap_needed_gb(self, ram_gb: float) -> float:
        """Swap that lets it build in `ram_gb` (0 when it fits in RAM alone)."""
        return max(0.0, self.total_gb - ram_gb)


def build_ram(weight_bytes: float, profile: DeviceProfile, source_bytes: float | None = None) -> BuildRam:
    """The build's memory for an engine of `weight_bytes` from an ONNX graph of `source_bytes` (default the same)."""
    source = weight_bytes if source_bytes is None else source_bytes
    resident = profile.facts.get("runtime_overhead_gb", 0.0) * 1e9
    if profile.facts.get("unified_memory"):
        resident += workspace_bytes(profile)
    return BuildRam(pageable=source + (TENSORRT_BUILD_WEIGHT_COPIES - 1) * weight_bytes, resident=resident)


def swap_allowed(profile: DeviceProfile) -> bool:
    """Whether the build may lean on swap: a Jetson's weights copies can go to a swap file on its NVMe (and the
    build is only possible there); a workstation GPU's host is expected to have the RAM."""
    return profile.facts.get("kind") == "jetson"


def mem_available_gb(meminfo: str | os.PathLike = "/proc/meminfo") -> float | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


def swap_free_gb(meminfo: str | os.PathLike = "/proc/meminfo") -> float:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("SwapFree:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return 0.0
    return 0.0


def check_build_ram(weight_bytes: int, available_gb: float | None, profile: DeviceProfile, context: int,
                    swap_gb: float = 0.0) -> float:
    """Refuse a build that would run out of memory (RAM, plus free swap on a Jetson); returns the estimate (GB)."""
    need = build_ram(weight_bytes, profile)
    have = available_gb if available_gb is not None else profile.host_ram_gb
    swap = swap_gb if swap_allowed(profile) else 0.0
    if not need.fits(have, swap):
        hint = "build on a machine with more RAM"
        if swap_allowed(profile):  # a Jetson's engine is built on the Jetson: make room there
            gb = max(1, int(need.swap_needed_gb(have) - swap + 0.999))
            hint = ((f"add {gb} GB or more of swap on the NVMe (sudo fallocate -l {gb}G /ssd/swapfile && sudo mkswap "
                     "/ssd/swapfile && sudo swapon /ssd/swapfile), " if need.total_gb > have + swap else "")
                    + "stop the desktop (sudo systemctl isolate multi-user.target)"
                    + (" and other GPU processes: the workspace and CUDA runtime must fit in RAM"
                       if need.resident / 1e9 > have else ""))
        raise InsufficientMemoryError(
            f"building this engine needs about {need.total_gb:.1f} GB ({TENSORRT_BUILD_WEIGHT_COPIES} copies of the "
            f"{weight_bytes / 1e9:.2f} GB of weights, as TensorRT's guide says a build holds, and "
            f"{need.resident / 1e9:.1f} GB of workspace and runtime) but {have:.1f} GB of RAM"
            + (f" and {swap:.1f} GB of swap are" if swap else " is") + f" available: {hint}, "
            f"or build a smaller engine (lower --max-context than {context}, or a smaller precision)")
    return need.total_gb
