"""Every precision EdgeChat knows, as one table: the runtime's pickers, the TensorRT builder, the
exporter's quantizer and packager, and the planner all read it, so a precision is added or reordered
in one place.

- `variant`: the graph an ONNX engine of this precision is ("fused": ONNX Runtime contrib ops, in-place
  KV; "plain": standard ops, what TensorRT builds from).
- `cpu`, `cuda`, `ort_trt`: rank when ONNX Runtime picks an engine on that execution provider (0 first;
  None: not run there). CPU: the int8/int4 kernels first (fastest measured there). CUDA EP: no fast path
  for Q/DQ graphs. TensorRT EP: standard-op graphs only.
- `trt_sources`: the bundle graphs a TensorRT engine of this precision is built from, preferred first
  (empty: TensorRT does not build it).
- `min_sm`: the lowest GPU compute capability a TensorRT engine of it runs on, and why (None: every GPU
  TensorRT 10 supports); `edge.precisions.sm_refusal` says it in one line, for the builder and the runtime.
- `weight_bytes`: bytes per weight, block scales included; `head_bytes`: the LM head's when it is
  stored at another precision; `embed_bytes`: an untied input embedding's (a per-row INT8 table in every
  quantized engine). `quality`: 0 is the reference; higher loses more (measured order).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    variant: str
    weight_bytes: float
    quality: int
    cpu: int | None = None
    cuda: int | None = None
    ort_trt: int | None = None
    trt_sources: tuple[str, ...] = ()
    head_bytes: float | None = None
    embed_bytes: float | None = None
    exported: bool = False  # edge-export builds an ONNX engine of it (--precision)
    quantized: bool = False  # made by the quantize stage from the fp32 (or fused) graph
    # ONNX Runtime session settings when its CPU provider runs this graph. An explicit Q/DQ graph is run as
    # written (Q/DQ not fused into ORT's int8 kernels; the weights' DequantizeLinear folded once at load): the
    # arithmetic TensorRT's Q/DQ semantics define, max |logit diff| 2e-7 to the fused kernels on the tiny model,
    # and it does not dequantize the whole embedding table on every call (47 ms/call on SmolLM2 otherwise)
    cpu_session_config: tuple[tuple[str, str], ...] = ()
    min_sm: tuple[str, str] | None = None  # (compute capability, why), see the module docstring
    # bytes per element of the LM head (and of an untied embedding) once the evaluate stage holds the graph in ONNX
    # Runtime's CPU provider, where it dequantizes them at load: int4-qdq's CPU twin (export/cpu_twin.py:
    # INT4 in MatMulNBits, the INT8 head folded: fp16 and fp32 copies and the source), fitted to the 1.5B Qwen's
    # evaluate stage (4.7 GB, 2026-12-07, docs/models.md); None: the head counts as any weight
    cpu_table_bytes: float | None = None

    @property
    def tensorrt(self) -> bool:
        return bool(self.trt_sources)


def nbits_bytes(bits: int, block: int, symmetric: bool) -> float:
    """Bytes per weight of a MatMulNBits weight: the packed levels, one fp32 scale per block and, when
    asymmetric, a zero point of `bits` per block (the layout export/quantize.py writes)."""
    return bits / 8 + 4 / block + (0 if symmetric else bits / 8 / block)


INT4_HEAD_BLOCK = 64  # the int4-weight engine's 8-bit LM head block (export/quantize.py int4_lm_head_block)
INT4_QDQ_BLOCK = 32  # the int4-qdq engine's default block (QuantizeOptions.int4_block_size; export/trt_formats.py)
QDQ_CPU = (("session.disable_quant_qdq", "1"),)  # see cpu_session_config: a Q/DQ graph run as written

# the SM facts: NVIDIA Model Optimizer's support matrix (nvidia.github.io/Model-Optimizer/guides/0_support_matrix.html:
# W4A16 block-wise INT4 "GPUs: Ampere and Later", FP8 "GPUs: Ada and Later"); TensorRT's "Working with Quantized
# Types" (INT4 is weight-only; FP8 GEMMs on compute capability 8.9 or later); BF16 tensor cores from Ampere
AMPERE = ("8.0", "TensorRT's INT4 weight-only (W4A16) kernels need Ampere or later")
ADA = ("8.9", "TensorRT's FP8 E4M3 GEMMs need Ada (SM 8.9) or later")

# the names, for code that means one precision in particular (a test keeps other literals out of the code)
FP32, FP16, BF16, FP8 = "fp32", "fp16", "bf16", "fp8-qdq"
INT8_QDQ, INT8_DYNAMIC, INT4_WEIGHT, INT4_QDQ = "int8-qdq", "int8-dynamic", "int4-weight", "int4-qdq"

TABLE: tuple[Precision, ...] = (
    Precision(FP32, "plain", 4.0, 0, cpu=2, cuda=1, ort_trt=2, trt_sources=(FP32,), exported=True),
    # the fp16 graph (export/fp16.py: fp32 islands for norms, softmax, rotary, logits) first; the fp32 graph with
    # TensorRT 10's FP16 flag for bundles that have none. ONNX Runtime CPU runs it in fp32 kernels (no fp16 ones)
    Precision(FP16, "plain", 2.0, 1, cpu=4, cuda=0, ort_trt=1, trt_sources=(FP16, FP32), exported=True),
    Precision(BF16, "plain", 2.0, 2, trt_sources=(BF16, FP32), min_sm=("8.0", "BF16 tensor cores start with Ampere")),
    # FP8 E4M3 weights per output channel, activations per tensor (calibrated), on the fp16 graph; the LM head in
    # fp16 (export/trt_formats.py)
    Precision(FP8, "plain", 1.0, 3, cpu=6, trt_sources=(FP8,), head_bytes=2.0, embed_bytes=1.0, exported=True,
              quantized=True, cpu_session_config=QDQ_CPU, min_sm=ADA),
    Precision(INT8_QDQ, "plain", 1.0, 4, cpu=3, ort_trt=0, trt_sources=(INT8_QDQ,), head_bytes=4.0, embed_bytes=1.0,
              exported=True, quantized=True, cpu_session_config=QDQ_CPU),
    # the head is left in fp32: a strongly typed network (TensorRT 11, and EdgeChat's Q/DQ builds on 10) runs it,
    # and every other unquantized layer, in the graph's fp32, not FP16
    Precision(INT8_DYNAMIC, "fused", nbits_bytes(8, 32, True), 5, cpu=0, cuda=3, embed_bytes=1.0, exported=True,
              quantized=True),
    Precision(INT4_WEIGHT, "fused", nbits_bytes(4, 32, False), 6, cpu=1, cuda=2, head_bytes=nbits_bytes(8, INT4_HEAD_BLOCK, True),
              embed_bytes=1.0, exported=True, quantized=True),
    # W4A16 for TensorRT: symmetric INT4 blocks (fp16 scales) in DequantizeLinear before each MatMul of the fp16
    # graph, the head (and the budget's promotions) INT8 per channel (export/trt_formats.py)
    Precision(INT4_QDQ, "plain", 0.5 + 2 / INT4_QDQ_BLOCK, 7, cpu=5, trt_sources=(INT4_QDQ,), head_bytes=1.0,
              embed_bytes=1.0, exported=True, quantized=True, cpu_session_config=QDQ_CPU, min_sm=AMPERE,
              cpu_table_bytes=7.0),
)
PRECISIONS: dict[str, Precision] = {p.name: p for p in TABLE}
NAMES: tuple[str, ...] = tuple(PRECISIONS)
EXPORTED: tuple[str, ...] = tuple(p.name for p in TABLE if p.exported)  # edge-export --precision choices
QUANTIZED: tuple[str, ...] = tuple(p.name for p in TABLE if p.quantized)  # the quantize stage's modes
TENSORRT: tuple[str, ...] = tuple(p.name for p in TABLE if p.tensorrt)  # edge-chat build-engine --precision choices
TENSORRT_SOURCES: tuple[str, ...] = tuple(dict.fromkeys(s for p in TABLE for s in p.trt_sources if s in PRECISIONS))
BY_QUALITY: tuple[str, ...] = tuple(p.name for p in sorted(TABLE, key=lambda p: p.quality))
REFERENCE = BY_QUALITY[0]  # what every other engine's quality is measured against


def get(name: str) -> Precision:
    """The table's row for `name`; a clear error for a name it does not have."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}: choose one of {', '.join(NAMES)}") from None


def _sm(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(v).split(".")[:2] if x.isdigit())


def sm_refusal(name: str, sm: str | None) -> str | None:
    """Why a GPU of compute capability `sm` cannot run a TensorRT engine of precision `name`, in one line (None:
    it can, or the precision has no floor)."""
    row = get(name)
    if row.min_sm is None or sm is None or _sm(sm) >= _sm(row.min_sm[0]):
        return None
    return f"{name} needs SM >= {row.min_sm[0]} ({row.min_sm[1]}); this GPU is SM {sm}"


def order(provider: str) -> tuple[str, ...]:
    """Precisions ONNX Runtime runs on `provider` ("cpu", "cuda", "ort_trt"), best first."""
    ranked = [(getattr(p, provider), p.name) for p in TABLE if getattr(p, provider) is not None]
    return tuple(name for _, name in sorted(ranked))
