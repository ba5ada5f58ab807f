"""Will it fit, and how fast can it be? Memory and roofline arithmetic per device.

Pure functions of (model dims, device profile, options), so every number can be
checked by hand. Bytes are decimal GB (1e9), the unit people quote ("a 7B model
is 14 GB in FP16").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edge.bundle import ModelDims
from edge.errors import RecipeError
from edge.profiles import DeviceProfile
from edge.trt_settings import TENSORRT_BUILD_RAM_FACTOR

GB = 1e9
# bytes per weight. MatMulNBits (int8-dynamic, int4-weight) stores one fp32 scale per block of 32 and, at
# 4 bits, a 4-bit zero point per block; int4-weight keeps the LM head (vocab x hidden) at 8 bits, see
# head_bytes. Checked against SmolLM2-135M's bundle: int8-dynamic 151 MB planned / 154 MB on disk,
# int4-weight 100 / 102 MB (the rest is norms, rotary tables and the graph).
WEIGHT_BYTES = {
    "fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0,
    "int8-dynamic": 1.0 + 4 / 32, "int8-qdq": 1.0, "int4-weight": 0.5 + 4.5 / 32,
}
HEAD_BYTES = {"int4-weight": 1.0 + 4 / 32}  # precisions whose LM head is stored apart from the rest
PRECISIONS = tuple(WEIGHT_BYTES)
# Highest quality first: the recommendation walks this list.
QUALITY_ORDER = ("fp32", "fp16", "bf16", "fp8", "int8-qdq", "int8-dynamic", "int4-weight")
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class PlanOptions:
    context: int = 2048
    batch: int = 1
    prompt_tokens: int = 256
    answer_tokens: int = 100

    def __post_init__(self) -> None:
        for k in ("context", "batch", "prompt_tokens", "answer_tokens"):
            if getattr(self, k) <= 0:
                raise RecipeError(f"--{k.replace('_', '-')} must be positive, got {getattr(self, k)}")
        if self.prompt_tokens > self.context:
            raise RecipeError(f"--prompt-tokens ({self.prompt_tokens}) exceeds --context ({self.context})")


@dataclass(frozen=True)
class Plan:
    precision: str
    weights_gb: float
    kv_cache_gb: float
    activations_gb: float
    overhead_gb: float
    total_gb: float
    usable_gb: float
    fits_memory: bool
    build_ram_gb: float | None  # TensorRT engine build peak host RAM, None if no build
    host_ram_gb: float
    fits_build: bool
    decode_tok_s: float  # roofline upper bound
    prefill_s: float
    answer_s: float  # prompt + answer_tokens

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_build

    def to_dict(self) -> dict:
        return asdict(self) | {"fits": self.fits}


def kv_bytes_per_token(dims: ModelDims, kv_dtype_bytes: int) -> int:
    """K and V, every layer, one token, one sequence."""
    return 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * kv_dtype_bytes


def weight_bytes(dims: ModelDims, precision: str) -> float:
    """Bytes of weights at `precision` (an LM head kept at more bits counted at its own rate)."""
    if precision not in HEAD_BYTES:
        return dims.num_parameters * WEIGHT_BYTES[precision]
    head = dims.vocab_size * dims.hidden_size
    return (dims.num_parameters - head) * WEIGHT_BYTES[precision] + head * HEAD_BYTES[precision]


def plan(dims: ModelDims, profile: DeviceProfile, precision: str, opts: PlanOptions = PlanOptions()) -> Plan:
    if precision not in WEIGHT_BYTES:
        raise RecipeError(f"unknown precision '{precision}': choose one of {', '.join(PRECISIONS)}")
    gpu = profile.is_gpu
    act_bytes = 2 if gpu and precision != "fp32" else 4
    kv_dtype = act_bytes  # fp16 KV on GPUs, fp32 on CPU
    params = dims.num_parameters
    weights = weight_bytes(dims, precision)
    kv = kv_bytes_per_token(dims, kv_dtype) * opts.context * opts.batch
    chunk = min(opts.context, PREFILL_CHUNK)
    hidden_acts = opts.batch * chunk * (4 * dims.hidden_size + 2 * dims.intermediate_size + dims.vocab_size)
    scores = opts.batch * dims.num_heads * chunk * opts.context
    activations = (hidden_acts + scores) * act_bytes
    overhead = profile.runtime_overhead_gb * GB
    total = weights + kv + activations + overhead
    usable = profile.usable_memory_gb * GB
    needs_build = bool(profile.tensorrt_versions) and precision in ("fp16", "bf16", "fp8", "int8-qdq")
    build = weights * TENSORRT_BUILD_RAM_FACTOR if needs_build else None
    host = profile.host_ram_gb * GB
    # Roofline: each decoded token reads every weight once plus the whole KV cache so far (worst case: full).
    bytes_per_token = weights + kv
    decode = profile.memory_bandwidth_gbs * GB / bytes_per_token
    prefill = 2 * params * opts.prompt_tokens * opts.batch / profile.peak_flops(precision)
    return Plan(
        precision=precision, weights_gb=weights / GB, kv_cache_gb=kv / GB, activations_gb=activations / GB,
        overhead_gb=overhead / GB, total_gb=total / GB, usable_gb=usable / GB, fits_memory=total <= usable,
        build_ram_gb=None if build is None else build / GB, host_ram_gb=host / GB,
        fits_build=build is None or build <= host, decode_tok_s=decode, prefill_s=prefill,
        answer_s=prefill + opts.answer_tokens / decode,
    )


def plan_all(dims: ModelDims, profile: DeviceProfile, opts: PlanOptions, precisions: list[str] | None = None) -> list[Plan]:
    chosen = precisions or [p for p in QUALITY_ORDER if profile.supports(p)]
    for p in chosen:
        if not profile.supports(p):
            raise RecipeError(
                f"{profile.display_name} does not support {p} (it supports: {', '.join(profile.precisions)})"
            )
    return [plan(dims, profile, p, opts) for p in chosen]


def recommend(dims: ModelDims, profile: DeviceProfile, opts: PlanOptions) -> tuple[Plan | None, int, str]:
    """Best-quality precision that fits at the asked context; else the longest context that fits.

    Returns (plan or None, context used, reason).
    """
    order = [p for p in QUALITY_ORDER if profile.supports(p)]
    for p in order:
        pl = plan(dims, profile, p, opts)
        if pl.fits:
            lower = [q for q in order[order.index(p) + 1:] if plan(dims, profile, q, opts).fits]
            faster = f"; {lower[-1]} would fit too and decode up to {plan(dims, profile, lower[-1], opts).decode_tok_s:.0f} tok/s" if lower else ""
            return pl, opts.context, (
                f"{p} is the highest-quality precision that fits {opts.context} tokens x batch {opts.batch} "
                f"in {pl.usable_gb:.1f} GB ({pl.total_gb:.2f} GB needed){faster}"
            )
    ctx = opts.context
    while ctx > 256:
        ctx //= 2
        o2 = PlanOptions(context=ctx, batch=opts.batch, prompt_tokens=min(opts.prompt_tokens, ctx),
                         answer_tokens=opts.answer_tokens)
        for p in order:
            pl = plan(dims, profile, p, o2)
            if pl.fits:
                return pl, ctx, (
                    f"nothing fits {opts.context} tokens; {p} fits a {ctx}-token context "
                    f"({pl.total_gb:.2f} of {pl.usable_gb:.1f} GB)"
                )
    smallest = plan(dims, profile, order[-1], opts)
    why = "engine build needs more host RAM than the device has" if smallest.fits_memory else (
        f"even {order[-1]} needs {smallest.total_gb:.1f} GB of {smallest.usable_gb:.1f} GB usable")
    return None, opts.context, f"does not fit: {why}; prune the model (edge-export build --prune) or pick a larger device"
