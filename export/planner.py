"""Will it fit, and how fast can it be? Memory and roofline arithmetic per device.

Pure functions of (model dims, device profile, options), so every number can be
checked by hand. Bytes are decimal GB (1e9), the unit people quote ("a 7B model
is 14 GB in FP16").
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from edge import precisions
from edge.bundle import ModelDims
from edge.errors import RecipeError
from edge.io_contract import KV_BYTES, KV_INT8, DecoderIO
from edge.precisions import BF16, FP8, FP16, FP32, INT4_QDQ, INT4_WEIGHT, INT8_DYNAMIC, INT8_QDQ
from edge.device.profiles import DeviceProfile
from edge.backends.tensorrt.settings import build_ram, swap_allowed

GB = 1e9
# bytes per weight. MatMulNBits (int8-dynamic, int4-weight) stores one fp32 scale per block and, at 4 bits,
# a 4-bit zero point per block; int4-weight keeps the LM head (vocab x hidden) at 8 bits, see head_bytes; an
# untied input embedding is a per-row INT8 table (embed_bytes). Checked against SmolLM2-135M's bundle:
# int8-dynamic 151 MB planned / 154 MB on disk, int4-weight 100 / 102 MB (the rest is norms, rotary tables
# and the graph); tests/test_planner.py checks a tiny untied model's engines against the plan.
WEIGHT_BYTES = {p.name: p.weight_bytes for p in precisions.TABLE}  # the table in edge/precisions.py
PRECISIONS = precisions.NAMES
QUALITY_ORDER = precisions.BY_QUALITY  # highest quality first: the recommendation walks this list
PREFILL_CHUNK = DecoderIO().prefill_chunk  # the runtime's prompt chunk (the engines' I/O contract)


@dataclass(frozen=True)
class Int4Layout:
    """How an int4 engine stores the model: 4-bit blocks of `block` weights (int4-weight: an fp32 scale and a 4-bit
    zero point each; int4-qdq: an fp16 scale), the LM head at `head_bits` (8: int4-weight's blocks of 64,
    int4-qdq's INT8 per channel), and `extra_ratio` of the all-4-bit engine's bytes spent on 8-bit projections,
    the ones whose 4 bits cost the most KL (measured at build time). The quantize stage's int4_block_size,
    int4_lm_head_bits and int4_extra_ratio (`edge-export build --int4-block N --int4-head-bits B
    --int4-extra-ratio R`)."""

    block: int = 32
    head_bits: int = 8
    extra_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_int4_layout(self.block, self.head_bits)
        if not 0 <= self.extra_ratio <= 1:
            raise RecipeError(f"int4 extra ratio (--int4-extra-ratio, recipe key int4_extra_ratio) must be in [0, 1], "
                              f"got {self.extra_ratio!r}")

    @property
    def body_bytes(self) -> float:
        return precisions.nbits_bytes(4, self.block, False)

    @property
    def head_bytes(self) -> float:
        return precisions.nbits_bytes(8, precisions.INT4_HEAD_BLOCK, True) if self.head_bits == 8 else self.body_bytes

    @property
    def flags(self) -> str:
        """The build flags that make this layout ('' for the default)."""
        return " ".join(f for f in (f"--int4-block {self.block}" if self.block != 32 else "",
                                    f"--int4-head-bits {self.head_bits}" if self.head_bits != 8 else "",
                                    f"--int4-extra-ratio {self.extra_ratio:g}" if self.extra_ratio else "") if f)

    def describe(self) -> str:
        return (f"4-bit blocks of {self.block}, {self.head_bits}-bit LM head"
                + (f", the projections 4 bits hurt most at 8 bits within +{self.extra_ratio:.0%} of the bytes"
                   if self.extra_ratio else ""))


def check_int4_layout(block: int, head_bits: int) -> None:
    if block not in INT4_BLOCKS:
        raise RecipeError(f"int4 block size (--int4-block, recipe key int4_block_size) must be one of "
                          f"{', '.join(map(str, INT4_BLOCKS))}, got {block!r}")
    if head_bits not in (4, 8):
        raise RecipeError(f"int4 LM head bits (--int4-head-bits, recipe key int4_lm_head_bits) must be 4 or 8, got {head_bits!r}")


INT4_BLOCKS = (16, 32, 64, 128, 256)  # MatMulNBits block sizes (powers of two from 16)
# The int4 layouts a build was measured in (SMOLLM2_INT4_EVAL below: `edge-export build --recipe
# recipes/smollm2-int8.toml --precision P` plus the layout's flags, KL to fp32 on its evaluate stage's 64 held-out
# chats; tests/test_planner.py checks each figure against the JSON): all 4 bits in blocks of 32 (the default build)
# and 64, and byte budgets of several sizes, so that a device with little room left gets the largest measured
# budget that still fits rather than all 4 bits.
INT4_MEASURED: dict[str, dict[Int4Layout, float]] = {
    INT4_WEIGHT: {Int4Layout(64, 8, 0.1): 0.0518, Int4Layout(64, 8, 0.05): 0.0628, Int4Layout(64, 8, 0.02): 0.0772,
                  Int4Layout(32, 8): 0.1106, Int4Layout(64, 8): 0.1315},
    INT4_QDQ: {Int4Layout(64, 8, 0.2): 0.0427, Int4Layout(64, 8, 0.1): 0.0610, Int4Layout(64, 8, 0.05): 0.0762,
               Int4Layout(64, 8, 0.02): 0.1033, Int4Layout(32, 8): 0.1471, Int4Layout(64, 8): 0.1892},
}
# Each int4 engine's layouts, best expected quality first; the planner takes the first that fits. The measured
# ones by their KL, then smaller layouts nobody measured (blocks of 128, a 4-bit head: the plan says in which
# layout the KL it shows was measured).
INT4_LAYOUTS = {
    INT4_WEIGHT: (*sorted(INT4_MEASURED[INT4_WEIGHT], key=INT4_MEASURED[INT4_WEIGHT].__getitem__),
                  Int4Layout(128, 8), Int4Layout(128, 4)),
    INT4_QDQ: (*sorted(INT4_MEASURED[INT4_QDQ], key=INT4_MEASURED[INT4_QDQ].__getitem__), Int4Layout(128, 8)),
}
# the measured byte budgets, largest first (what `--int4-extra-ratio` builds were scored)
INT4_BUDGETS = {p: tuple(lay for lay in layouts if lay.extra_ratio) for p, layouts in INT4_LAYOUTS.items()}


@dataclass(frozen=True)
class PlanOptions:
    context: int = 2048
    batch: int = 1
    prompt_tokens: int = 256
    answer_tokens: int = 100
    int4_layout: Int4Layout | None = None  # the int4 engines' layout; None: the best of INT4_LAYOUTS that fits
    # per engine, before int4_layout: the layout a bundle's engine was built in (`bundle_layouts`)
    int4_built: tuple[tuple[str, Int4Layout], ...] = ()
    # per Q/DQ engine (int8-qdq, fp8-qdq): the float share a bundle's engine was built with (`bundle_qdq_shares`);
    # else QDQ_FLOAT_RATIO, the default's
    qdq_built: tuple[tuple[str, float], ...] = ()
    # the fused engines' K/V cache (`edge-export build --kv-cache`): "int8" counts one byte per K/V element for
    # the precisions that run the fused graph (int8-dynamic, int4-weight); the others keep a float cache
    kv_cache: str = "float"

    def __post_init__(self) -> None:
        from export.kv_int8 import check_kv_cache

        check_kv_cache(self.kv_cache)
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
    build_ram_gb: float | None  # TensorRT engine build's peak memory (edge/backends/tensorrt/settings.py), None if no build
    host_ram_gb: float
    fits_build: bool  # in the host's RAM, or on a Jetson with swap for the weights' copies (build_swap_gb)
    decode_tok_s: float  # roofline upper bound
    prefill_s: float
    answer_s: float  # prompt + answer_tokens
    int4_layout: Int4Layout | None = None  # int4-weight / int4-qdq: the layout planned
    build_swap_gb: float = 0.0  # swap the engine build needs on top of host_ram_gb (a Jetson's NVMe swap file)

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_build

    def to_dict(self) -> dict:
        return asdict(self) | {"fits": self.fits}


# int8-qdq's and fp8-qdq's default float budget (export/quantize.py QuantizeOptions.qdq_float_ratio; tests/test_planner.py
# checks they agree): the activations whose 8-bit form hurts most keep fp16 MatMuls within this share of the 8-bit
# bytes, at most (the build stops earlier where the rest's measured KL is below qdq_float_kl). fp8-qdq at 0.7 is
# 4x closer on SmolLM2 but plans 1.7x the FP8 bytes (13B on an L4: no longer fits): docs/quality.md "fp8-qdq's float budget"
QDQ_FLOAT_RATIO = 0.2


def kv_bytes_per_token(dims: ModelDims, kv_dtype_bytes: int) -> int:
    """K and V, every layer, one token, one sequence."""
    return 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * kv_dtype_bytes


def weight_bytes(dims: ModelDims, precision: str, layout: Int4Layout | None = None,
                 qdq_share: float | None = None) -> float:
    """Bytes of weights at `precision`: the LM head and an input embedding at their own rates; int4-weight in
    `layout` (default: blocks of 32). A tied table is stored once where the runtime can gather the embedding
    from the head (unquantized, or an 8-bit MatMulNBits head); a quantized engine whose head is anything
    else keeps a separate per-row INT8 embedding table beside it (export/embedding.py quantize_embedding)."""
    row = precisions.get(precision)
    table = dims.vocab_size * dims.hidden_size
    if precision == INT4_WEIGHT:
        layout = layout or Int4Layout()
        body_b, head_b, eight_bit_head = layout.body_bytes, layout.head_bytes, layout.head_bits == 8
    else:
        body_b, head_b = row.weight_bytes, row.head_bytes or row.weight_bytes
        eight_bit_head = row.head_bytes is None
    if precision == INT4_QDQ:  # symmetric INT4 blocks with an fp16 scale each; the head INT8 per channel, a tied
        layout = layout or Int4Layout()  # embedding gathered from its one table (89.7 MB on disk for SmolLM2, 88 planned)
        body_b, eight_bit_head = 0.5 + 2 / layout.block, True
    if precision in (INT8_QDQ, FP8):  # their float budget: fp16 MatMuls adding at most this share of the 8-bit bytes
        body_b *= 1 + (QDQ_FLOAT_RATIO if qdq_share is None else qdq_share)
    shared = dims.tie_word_embeddings and (row.embed_bytes is None or eight_bit_head)
    body = dims.num_parameters - table - (0 if dims.tie_word_embeddings else table)
    embed = 0 if shared else table
    if precision == INT4_WEIGHT:
        body *= _block_padding(dims, layout.block)
        if layout.head_bits == 4:  # the head's input is the hidden width too
            head_b *= -(-dims.hidden_size // layout.block) * layout.block / dims.hidden_size
    total = body * body_b + table * head_b + embed * (row.embed_bytes or row.weight_bytes)
    # an int4 byte budget: the quantize stage fills the engine up to (1 + extra_ratio) x its all-4-bit size
    return total * (1 + layout.extra_ratio) if layout is not None else total


def _block_padding(dims: ModelDims, block: int) -> float:
    """How much a 4-bit MatMul grows when its input width K is padded to whole blocks (SmolLM2's 576 at
    blocks of 128: 640), averaged over a decoder block's weights by their share."""
    q = dims.num_heads * dims.head_dim
    kv = dims.num_kv_heads * dims.head_dim
    widths = ((dims.hidden_size, dims.hidden_size * (q + 2 * kv + 2 * dims.intermediate_size)),  # q, k, v, gate, up
              (q, q * dims.hidden_size),  # o
              (dims.intermediate_size, dims.intermediate_size * dims.hidden_size))  # down
    total = sum(n for _, n in widths)
    return sum(n * (-(-k // block) * block) / k for k, n in widths) / total if total else 1.0


def plan(dims: ModelDims, profile: DeviceProfile, precision: str, opts: PlanOptions = PlanOptions()) -> Plan:
    """The memory and roofline plan of one precision; an int4 engine in the layout a bundle built it in
    (`opts.int4_built`), else in `opts.int4_layout` (int4-qdq: its block; its head is always 8-bit), else in the
    best of its INT4_LAYOUTS that fits (the smallest when none does)."""
    if precision not in WEIGHT_BYTES:
        raise RecipeError(f"unknown precision '{precision}': choose one of {', '.join(PRECISIONS)}")
    if precision not in INT4_LAYOUTS:
        return _plan(dims, profile, precision, opts, None)
    pinned = dict(opts.int4_built).get(precision) or opts.int4_layout
    if pinned and precision == INT4_QDQ:  # its head is INT8 per channel whatever int4-weight's head bits
        pinned = dataclasses.replace(pinned, head_bits=8)
    layouts = [pinned] if pinned else INT4_LAYOUTS[precision]
    tried = [_plan(dims, profile, precision, opts, lay) for lay in layouts]
    return next((p for p in tried if p.fits), min(tried, key=lambda p: p.total_gb))


def _plan(dims: ModelDims, profile: DeviceProfile, precision: str, opts: PlanOptions, layout: Int4Layout | None) -> Plan:
    gpu = profile.is_gpu
    act_bytes = 2 if gpu and precision != FP32 else 4
    kv_dtype = act_bytes  # fp16 KV on GPUs, fp32 on CPU
    if opts.kv_cache == KV_INT8 and precisions.get(precision).variant == "fused":
        kv_dtype = KV_BYTES[KV_INT8]  # the static per-channel scales are a few KB per layer: not counted
    params = dims.num_parameters
    weights = weight_bytes(dims, precision, layout, dict(opts.qdq_built).get(precision))
    kv = kv_bytes_per_token(dims, kv_dtype) * opts.context * opts.batch
    chunk = min(opts.context, PREFILL_CHUNK)
    hidden_acts = opts.batch * chunk * (4 * dims.hidden_size + 2 * dims.intermediate_size + dims.vocab_size)
    scores = opts.batch * dims.num_heads * chunk * opts.context
    activations = (hidden_acts + scores) * act_bytes
    overhead = profile.runtime_overhead_gb * GB
    total = weights + kv + activations + overhead
    usable = profile.usable_memory_gb * GB
    needs_build = bool(profile.tensorrt_versions) and precisions.get(precision).tensorrt and precision != FP32
    # from the ONNX graph it is built from (its own precision's, the first of trt_sources)
    build = build_ram(weights, profile, weight_bytes(dims, precisions.get(precision).trt_sources[0], layout)) \
        if needs_build else None
    host = profile.host_ram_gb * GB
    swap = build.swap_needed_gb(profile.host_ram_gb) if build is not None and swap_allowed(profile) else 0.0
    # Roofline: each decoded token reads every weight once plus the whole KV cache so far (worst case: full).
    bytes_per_token = weights + kv
    decode = profile.memory_bandwidth_gbs * GB / bytes_per_token
    prefill = 2 * params * opts.prompt_tokens * opts.batch / profile.peak_flops(precision)
    return Plan(
        precision=precision, weights_gb=weights / GB, kv_cache_gb=kv / GB, activations_gb=activations / GB,
        overhead_gb=overhead / GB, total_gb=total / GB, usable_gb=usable / GB, fits_memory=total <= usable,
        build_ram_gb=None if build is None else build.total_gb, host_ram_gb=host / GB,
        fits_build=build is None or build.fits(profile.host_ram_gb, swap), decode_tok_s=decode, prefill_s=prefill,
        answer_s=prefill + opts.answer_tokens / decode, int4_layout=layout, build_swap_gb=swap,
    )


def plan_all(dims: ModelDims, profile: DeviceProfile, opts: PlanOptions, precisions: list[str] | None = None) -> list[Plan]:
    chosen = precisions or [p for p in QUALITY_ORDER if profile.supports(p)]
    for p in chosen:
        if not profile.supports(p):
            raise RecipeError(
                f"{profile.display_name} does not support {p} (it supports: {', '.join(profile.precisions)})"
            )
    return [plan(dims, profile, p, opts) for p in chosen]


# Expected quality loss of each precision: mean per-token KL(fp32 || precision) on held-out chats, used when
# no bundle's own measurement is at hand. Data with its source; None where nothing has been measured.
SMOLLM2 = ("measured on SmolLM2-135M-Instruct by the build's evaluate stage: recipes/smollm2-int8.toml, 64 held-out "
           "chitchat chats, edge runtime (README, 'Quality kept')")
# the measured build docs/quality.md reports (`edge-export build --precision int8-dynamic --precision int4-weight
# --int4-block 64 --int4-budget-mb 105.4`, then `edge-export eval`, 32 held-out chats): its JSON is the source, and
# tests/test_planner.py checks these figures against it so they cannot drift from the measurement
SMOLLM2_EVAL = "docs/bench/quality-final-eval-2026-12-05.json"
SMOLLM2_FINAL = (f"measured on SmolLM2-135M-Instruct, 32 held-out chats, KL to fp32 ({SMOLLM2_EVAL}; "
                 "docs/quality.md)")
# the int4 engines as `edge-export build --recipe recipes/smollm2-int8.toml --precision P [the layout's flags]` makes
# them, each build's evaluate stage (64 held-out chats; docs/quality.md "What the plan's int4 flags build"): the
# layouts of INT4_MEASURED; int4-qdq scored as its CPU twin. Checked against the JSON by tests/test_planner.py
SMOLLM2_INT4_EVAL = "docs/bench/quality-int4-builds-2026-12-07.json"
SMOLLM2_INT4 = (f"measured on SmolLM2-135M-Instruct by the build's evaluate stage, 64 held-out chats, KL to fp32 "
                f"({SMOLLM2_INT4_EVAL}; docs/quality.md)")
# int8-qdq and fp8-qdq at every default (`edge-export build --precision int8-qdq --precision fp8-qdq`, its evaluate
# stage: 64 held-out chats; docs/quality.md "fp8-qdq with int8-qdq's measured choices"), checked likewise
SMOLLM2_QDQ_EVAL = "docs/bench/quality-trt-formats-build-2026-12-07.json"
SMOLLM2_QDQ = (f"measured on SmolLM2-135M-Instruct by the default build's evaluate stage, 64 held-out chats, KL to fp32 "
               f"on ONNX Runtime's CPU reference kernels, not on a GPU ({SMOLLM2_QDQ_EVAL}; docs/quality.md)")
NO_GPU = "not measured: EdgeChat has not run TensorRT on a GPU yet"
NO_MODEL = ("not measured on SmolLM2-135M yet (its graph is scored on ONNX Runtime's CPU reference kernels by the "
            "evaluate stage: a bundle's own figure replaces this)")
DEFAULT_KL: dict[str, tuple[float | None, str]] = {
    FP32: (0.0, "the reference itself"),
    FP16: (None, NO_GPU),
    BF16: (None, NO_GPU),
    FP8: (0.0187, SMOLLM2_QDQ),
    INT8_DYNAMIC: (0.0043, SMOLLM2_FINAL),
    # both with their float budget (QDQ_FLOAT_RATIO, whose fp16 bytes `weight_bytes` counts)
    INT8_QDQ: (0.0087, SMOLLM2_QDQ),
    # the default build (--precision P alone): all 4 bits in blocks of 32
    INT4_WEIGHT: (INT4_MEASURED[INT4_WEIGHT][Int4Layout()], SMOLLM2_INT4 + ", all 4 bits in blocks of 32"),
    INT4_QDQ: (INT4_MEASURED[INT4_QDQ][Int4Layout()],
               SMOLLM2_INT4 + ", all 4 bits in blocks of 32, on ONNX Runtime's CPU reference kernels"),
}
# every measured int4 layout's figure with its source (the default layout's is DEFAULT_KL's)
MEASURED_INT4_KL: dict[tuple[str, Int4Layout], tuple[float, str]] = {
    (p, lay): (kl, SMOLLM2_INT4 + ", " + (lay.flags or "all 4 bits in blocks of 32")
               + (", on ONNX Runtime's CPU reference kernels" if p == INT4_QDQ else ""))
    for p, measured in INT4_MEASURED.items() for lay, kl in measured.items()
}
DEFAULT_MAX_KL = 0.05  # int8-dynamic, int8-qdq, fp8-qdq and int4-qdq's +20% budget are within it; the other int4 layouts are not
GPU_FLOOR = (FP16, BF16)  # on a GPU the recommendation never goes below these for quality, nor to fp32 unasked
TENSORRT_FROM_FP32 = tuple(p.name for p in precisions.TABLE if FP32 in p.trt_sources)  # built on the device from fp32


@dataclass(frozen=True)
class Expected:
    """Expected KL to fp32 of one precision, and where the number comes from (`bundle`: the bundle's own engine)."""

    kl: float | None
    source: str
    bundle: bool = False

    @property
    def short(self) -> str:
        """For a one-line reason: the number and a word on where it is from."""
        if self.kl is None:
            return "KL not measured"
        where = "this bundle" if self.bundle else "SmolLM2-135M" if "SmolLM2" in self.source else "reference"
        return f"KL {self.kl:.2g}, {where}"


def expected(p: "Plan", quality: dict[str, Expected]) -> Expected:
    """The expected KL of what a plan builds: the bundle's own engine of its precision, else the measured build of
    its int4 layout (MEASURED_INT4_KL), else its precision's figure (`quality`). An int4 layout nobody built has
    none: another layout's figure would flatter it (blocks of 64 measured worse than 32, and 128 hold still
    fewer scales), so it is "not measured" and ranks after every measured one."""
    q = quality.get(p.precision, Expected(None, "not measured"))
    if q.bundle or p.int4_layout is None:
        return q
    got = MEASURED_INT4_KL.get((p.precision, p.int4_layout))
    return Expected(*got) if got else Expected(None, f"not measured in {p.int4_layout.describe()}"
                                               + _nearest_measured(p.precision, p.int4_layout))


def _nearest_measured(precision: str, layout: Int4Layout) -> str:
    """The measured all-4-bit layout with the largest block up to `layout`'s, as a hint of where its KL starts."""
    near = [lay for lay in INT4_MEASURED.get(precision, {}) if not lay.extra_ratio and lay.block <= layout.block]
    if not near:
        return ""
    lay = max(near, key=lambda la: la.block)
    return f"; all 4 bits in blocks of {lay.block} measured {INT4_MEASURED[precision][lay]:.2g}, larger blocks lose more"


def default_quality() -> dict[str, Expected]:
    return {p: Expected(kl, src) for p, (kl, src) in DEFAULT_KL.items()}


def bundle_quality(manifest) -> tuple[dict[str, Expected], set[str]]:
    """Expected KL per precision from a bundle's measured engines (the defaults for the rest), and the
    precisions the bundle can run: its engines' and, given its fp32 graph, what TensorRT builds from it.

    A pruned bundle's KL is measured against the teacher; its fp32 engine's own KL is subtracted, so the
    number is what the precision loses against the model the bundle holds."""
    measured: dict[str, float] = {}
    for e in manifest.engines:
        v = e.quality.get("kl_to_fp32")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            measured[e.fingerprint.precision] = min(v, measured.get(e.fingerprint.precision, v))
    base = measured.get(FP32, 0.0)
    quality = default_quality()
    for prec, v in measured.items():
        quality[prec] = Expected(max(0.0, v - base), f"measured in bundle {manifest.bundle_id}"
                                 + (" (minus its fp32 engine's KL to the teacher)" if base else ""), bundle=True)
    have = {e.fingerprint.precision for e in manifest.engines}
    return quality, have | (set(TENSORRT_FROM_FP32) if FP32 in have else set())


def _quantize_stage(manifest, precision: str):
    """The quantize stage record a bundle's engine of `precision` came from, or None."""
    return next((s for s in manifest.stages if s.name == f"quantize-{precision}"), None)


def bundle_layouts(manifest) -> tuple[tuple[str, Int4Layout], ...]:
    """The layout each int4 engine of a bundle was built in, from its quantize stage's record (block, head bits, and
    the byte budget as a share of its all-4-bit bytes), so a bundle's plan counts the bytes of the engine it has."""
    out = []
    for e in manifest.engines:
        p = e.fingerprint.precision
        if p not in INT4_LAYOUTS or p in dict(out):
            continue
        stage = _quantize_stage(manifest, p)
        if stage is None:
            continue
        params, metrics = stage.params or {}, stage.metrics or {}
        budget, base = metrics.get("int4_budget_bytes"), metrics.get("int4_all4_bytes")
        ratio = budget / base - 1 if budget and base else float(params.get("int4_extra_ratio") or 0.0)
        block = int(params.get("int4_block_size") or 32)
        head = int(params.get("int4_lm_head_bits") or 8) if p == INT4_WEIGHT else 8
        if block in INT4_BLOCKS and head in (4, 8):
            out.append((p, Int4Layout(block, head, round(min(max(ratio, 0.0), 1.0), 4))))
    return tuple(out)


def bundle_qdq_shares(manifest) -> tuple[tuple[str, float], ...]:
    """The float share each Q/DQ engine of a bundle was built with (its quantize stage's `qdq_float_ratio`: at most
    that many fp16 bytes, the stop may have spent fewer), so a bundle built with another share plans its bytes."""
    out = []
    for e in manifest.engines:
        p = e.fingerprint.precision
        stage = _quantize_stage(manifest, p) if p in (INT8_QDQ, FP8) else None
        share = (stage.params or {}).get("qdq_float_ratio") if stage is not None else None
        if isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share < 1 and p not in dict(out):
            out.append((p, float(share)))
    return tuple(out)


def _layout_note(p: Plan, quality: dict[str, Expected]) -> str:
    """An int4 KL figure is measured in one layout: say so when the plan takes a layout nobody measured."""
    e = expected(p, quality)
    return f" ({e.source})" if e.kl is None and p.int4_layout is not None and not e.bundle else ""


@dataclass(frozen=True)
class Recommendation:
    plan: Plan | None
    context: int
    reason: str
    runner_up: Plan | None = None
    runner_up_reason: str = ""

    def to_dict(self, quality: dict[str, Expected]) -> dict:
        def kl(p: Plan | None) -> dict:
            return {} if p is None else {"expected_kl": expected(p, quality).kl,
                                         "expected_kl_source": expected(p, quality).source}
        lay = self.plan.int4_layout if self.plan else None
        return {"precision": self.plan.precision if self.plan else None, "context": self.context,
                "reason": self.reason, **kl(self.plan),
                "int4_layout": asdict(lay) if lay else None, "build_flags": lay.flags if lay else "",
                "runner_up": None if self.runner_up is None else
                {"precision": self.runner_up.precision, "decode_tok_s": self.runner_up.decode_tok_s,
                 "reason": self.runner_up_reason, **kl(self.runner_up)}}


def recommend(dims: ModelDims, profile: DeviceProfile, opts: PlanOptions, max_kl: float = DEFAULT_MAX_KL,
              quality: dict[str, Expected] | None = None, precisions: list[str] | None = None,
              allow_fp32: bool = False) -> Recommendation:
    """What a user should run: the fastest precision that fits whose expected KL to fp32 is within `max_kl`.

    On a GPU fp16 is the floor (always acceptable, whatever its KL) and fp32 is left out unless asked for
    (`allow_fp32`; or when it is the only candidate): nobody runs fp32 on a Jetson. On a CPU fp32 is the floor.
    If nothing within the bound fits, the lowest-KL precision that fits, saying so; if nothing fits at the
    asked context, the longest context that does. `precisions` limits the candidates (--precision)."""
    if max_kl < 0:
        raise RecipeError(f"--max-kl must be >= 0, got {max_kl}")
    quality = quality or default_quality()
    order = [p for p in (precisions or QUALITY_ORDER) if profile.supports(p)]
    if not order:
        raise RecipeError(f"none of {', '.join(precisions or QUALITY_ORDER)} runs on {profile.display_name} "
                          f"(it supports: {', '.join(profile.precisions)})")
    if profile.is_gpu and not allow_fp32:
        order = [p for p in order if p != FP32] or order
    floor = next((p for p in (GPU_FLOOR if profile.is_gpu else (FP32,)) if p in order), None)

    def kl(pl: Plan) -> float:
        v = expected(pl, quality).kl
        return float("inf") if v is None else v

    def ok(pl: Plan) -> bool:
        return pl.precision == floor or kl(pl) <= max_kl

    def why_kl(pl: Plan) -> str:
        return expected(pl, quality).short

    def candidates(o: PlanOptions) -> tuple[list[Plan], list[Plan]]:
        """Each precision's plan (the table's), and for an int4 engine in no fixed layout its other measured layouts
        that fit too: a smaller budget within the bound is faster than the best-quality one the table shows."""
        first = [plan(dims, profile, p, o) for p in order]
        more = [alt for f in first if f.fits and f.precision in INT4_LAYOUTS
                and not (dict(o.int4_built).get(f.precision) or o.int4_layout)
                for lay in INT4_LAYOUTS[f.precision] if lay != f.int4_layout and (f.precision, lay) in MEASURED_INT4_KL
                for alt in (_plan(dims, profile, f.precision, o, lay),) if alt.fits]
        return first, more

    def flags(pl: Plan) -> str:
        return f" ({pl.int4_layout.flags})" if pl.int4_layout and pl.int4_layout.flags else ""

    ctx = opts.context
    while True:
        o = dataclasses.replace(opts, context=ctx, prompt_tokens=min(opts.prompt_tokens, ctx))
        first, more = candidates(o)
        fitting = [pl for pl in first if pl.fits]
        within = sorted((pl for pl in fitting + more if ok(pl)),
                        key=lambda pl: (-pl.decode_tok_s, kl(pl), order.index(pl.precision)))
        where = f"fits {ctx} tokens x batch {o.batch}" + (f" (not {opts.context})" if ctx != opts.context else "")
        if within:
            best = within[0]
            note = _layout_note(best, quality)
            faster = [pl for pl in fitting if pl.decode_tok_s > best.decode_tok_s and not ok(pl)
                      and pl.precision != best.precision]
            floor_note = " (the floor on GPUs)" if best.precision == floor and profile.is_gpu else ""
            reason = (f"the fastest that {where} with expected KL <= {max_kl:g}{floor_note}: "
                      f"≤{best.decode_tok_s:,.0f} tok/s, {why_kl(best)}"
                      + (f"; {faster[0].precision} is faster but {why_kl(faster[0])}" if faster else "") + note)
            others = [pl for pl in within[1:] if pl.precision != best.precision]  # the runner-up: another engine
            runner = others[0] if others else (faster[0] if faster else None)
            return Recommendation(best, ctx, reason, runner, "" if runner is None else (
                f"≤{runner.decode_tok_s:,.0f} tok/s, {why_kl(runner)}{flags(runner)}"
                + ("" if ok(runner) else f", above --max-kl {max_kl:g}")
                + (" (the floor on GPUs)" if runner.precision == floor and profile.is_gpu else "")
                + _layout_note(runner, quality)))
        if fitting:
            best = min(fitting, key=lambda pl: (kl(pl), order.index(pl.precision)))
            rest = [pl for pl in fitting if pl.precision != best.precision]
            runner = max(rest, key=lambda pl: pl.decode_tok_s) if rest else None
            return Recommendation(best, ctx, (
                f"nothing with expected KL <= {max_kl:g} {where}; this is the best quality that does "
                f"({why_kl(best)})" + _layout_note(best, quality)), runner,
                "" if runner is None else f"≤{runner.decode_tok_s:,.0f} tok/s, {why_kl(runner)}" + _layout_note(runner, quality))
        if ctx <= 256:
            break
        ctx //= 2
    smallest = plan(dims, profile, order[-1], opts)
    why = "engine build needs more host RAM than the device has" if smallest.fits_memory else (
        f"even {order[-1]} needs {smallest.total_gb:.1f} GB of {smallest.usable_gb:.1f} GB usable")
    if opts.int4_layout and INT4_WEIGHT in order:
        free = recommend(dims, profile, dataclasses.replace(opts, int4_layout=None), max_kl, quality, precisions, allow_fp32)
        if free.plan is not None:
            lay = free.plan.int4_layout
            why += (f" in the pinned int4 layout ({opts.int4_layout.describe()}); without the pin {free.plan.precision} "
                    f"fits at context {free.context}" + (f" in {lay.describe()} ({lay.flags or 'the default'})" if lay else ""))
            return Recommendation(None, opts.context, f"does not fit: {why}")
    return Recommendation(None, opts.context, f"does not fit: {why}; prune the model (edge-export build --prune) "
                                              "or pick a larger device")
