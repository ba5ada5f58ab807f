"""Will a build fit this workstation's RAM? Answered before any stage starts, from measured peaks.

Planned peak = BASE_BYTES + factor x the model's fp32 weight bytes, the factor of the stage that peaks.
Measured peaks in GB (each stage's own, from its record; builds of 2026-12-05, docs/models.md):

| model (fp32 weights)         | load | export | quantize-int8-qdq | evaluate |
|------------------------------|------|--------|-------------------|----------|
| SmolLM2-135M (0.54 GB)       | 1.2  | 3.1    | 4.2               | 4.1      |
| Qwen2.5-Coder-0.5B (2.52 GB) | 4.0  | 7.2    | 9.8               | 8.7      |
| Qwen2.5-Coder-1.5B (7.11 GB) | 9.3  | 11.3   | (refused here)    | 12.9     |

- export: PyTorch traces the fp32 model into an ONNX graph (the model and the graph's weights at once),
  then the parity check runs it. evaluate holds the fp32 reference and every engine in ONNX Runtime.
- quantize-int8-qdq: ONNX Runtime's quantize_static loads the whole graph, an augmented copy for
  calibration (whose activations grow with the vocabulary) and the quantized result.
Weight-only quantization streams one tensor at a time. Small models are dominated by the fixed cost of
the libraries (BASE_BYTES). The factors below cover every row above; they are upper bounds, looser for
larger models (tests/test_build_memory.py checks each measured build is within its plan).

The streaming build (export/stream_build.py: int8-dynamic, int4-weight and int4-qdq written straight from the checkpoint)
holds the libraries, the graph's records and one weight at a time while it writes an engine: STREAM_BASE_BYTES +
STREAM_PER_LARGEST x the largest single tensor it makes in fp32 (the embedding / LM head, or a layer's packed
gate+up projection), whatever the number of layers (measured with scripts/synthetic_checkpoint.py). GPTQ's
statistics add one block's K x K matrices and the calibration texts' hidden states; its evaluate stage holds each
engine in ONNX Runtime in turn (what the device will hold too; int4-qdq as its CPU twin, its head dequantized at
load: `evaluated_bytes`) and one text's logits. The plan is the largest of
the three (measured on Qwen2.5-Coder-1.5B, docs/models.md).
"""

from __future__ import annotations

from edge.bundle import ModelDims
from edge.errors import RecipeError
from edge.precisions import INT8_DYNAMIC, INT8_QDQ

PEAK_PER_FP32_BYTE = {"export": 3.0, "quantize-int8-qdq": 5.0}  # "export" covers load and evaluate too
BASE_BYTES = 2.5e9  # the interpreter, torch, transformers and ONNX Runtime themselves


STREAM_BASE_BYTES = 1.0e9  # the interpreter, onnx, ONNX Runtime's quantizer, torch (rotary tables), the graph
STREAM_PER_LARGEST = 3.0  # the fp32 tensor, its transposed copy (the tied LM head), its quantized form
# the evaluate stage: one engine in ONNX Runtime at a time, beside the reference's logits on one held-out text (a
# 512-token prose window x the vocabulary in fp32, computed and written to disk); each engine scores a text in the
# runtime's prefill calls (<= 128 positions) against those rows read back. The session holds 1.2x the engine once
# loaded (2.40 GB of VmHWM for the 1.99 GB int8 engine of Qwen2.5-Coder-1.5B) and ~0.2x more as it runs its call
# shapes: that build's evaluate stage peaked at 3.8 GB (2026-12-07; 5.9 GB when each text ran in one call and the
# decoder kept a logits buffer per length: docs/models.md)
STREAM_ENGINE_FACTOR = 1.4
STREAM_TEXT_LOGITS = 1
EVAL_WINDOW = 512  # export/evaluate.py EvalOptions.prose_window
# GPTQ's statistics one block at a time: the widest input's K x K float64 matrix a few times (the sums, GPTQ's
# damped and permuted copies, its Cholesky factor) and the calibration texts' hidden states (96 x 512 tokens)
STREAM_GPTQ_MATRICES = 3
GPTQ_TOKENS = 96 * 512


def largest_tensor_bytes(dims: ModelDims) -> int:
    """fp32 bytes of the largest tensor the fused graph holds: the embedding (or LM head), a layer's packed
    gate+up projection or its packed q/k/v projection."""
    h = dims.hidden_size
    return 4 * max(dims.vocab_size * h, 2 * dims.intermediate_size * h,
                   (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim * h)


def streaming_peak_bytes(dims: ModelDims, precisions: tuple[str, ...] = (), evaluate: bool = True,
                         gptq: bool = True) -> float:
    """Planned peak of the streaming build (int8-dynamic / int4-weight / int4-qdq from the checkpoint, export/stream_build.py):
    the largest of its stages' (writing an engine; GPTQ's statistics; the evaluate stage, which must hold each
    engine it scores: the one term that grows with the model, as the engine the device runs does)."""
    write = STREAM_BASE_BYTES + STREAM_PER_LARGEST * largest_tensor_bytes(dims)
    stages = [write]
    if gptq:
        k = max(dims.hidden_size, dims.intermediate_size, dims.num_heads * dims.head_dim)
        stages.append(STREAM_BASE_BYTES + STREAM_GPTQ_MATRICES * 8 * k * k + 4 * GPTQ_TOKENS * dims.hidden_size)
    if evaluate:
        engine = max(evaluated_bytes(dims, p) for p in precisions or (INT8_DYNAMIC,))
        stages.append(STREAM_BASE_BYTES + STREAM_ENGINE_FACTOR * engine
                      + STREAM_TEXT_LOGITS * 4 * EVAL_WINDOW * dims.vocab_size)
    return max(stages)


def evaluated_bytes(dims: ModelDims, precision: str) -> float:
    """What ONNX Runtime's CPU session holds of an engine while the evaluate stage scores it: its weights, and for
    int4-qdq the head (and an untied embedding) its twin dequantizes at load (edge.precisions cpu_table_bytes)."""
    from edge import precisions as table

    p = table.get(precision)
    held = p.weight_bytes * dims.num_parameters
    if p.cpu_table_bytes:
        held += p.cpu_table_bytes * dims.vocab_size * dims.hidden_size * (1 if dims.tie_word_embeddings else 2)
    return held


def peak_stage(precisions: tuple[str, ...] = ()) -> str:
    return f"quantize-{INT8_QDQ}" if INT8_QDQ in precisions else "export"


def build_peak_bytes(dims: ModelDims, precisions: tuple[str, ...] = ()) -> float:
    return PEAK_PER_FP32_BYTE[peak_stage(precisions)] * 4 * dims.num_parameters + BASE_BYTES


def machine_ram_bytes() -> int | None:
    from edge.device.probe import mem_total_bytes

    return mem_total_bytes()


def largest_buildable(ram: float, precisions: tuple[str, ...] = ()) -> float:
    """Parameters of the largest model whose build fits `ram` bytes."""
    return max(0.0, (ram - BASE_BYTES) / (PEAK_PER_FP32_BYTE[peak_stage(precisions)] * 4))


def check_fits(dims: ModelDims, name: str, precisions: tuple[str, ...] = (), ram: int | None = None,
               streaming: bool = False, evaluate: bool = True, gptq: bool = True) -> dict:
    """Raise a RecipeError before a build that would run out of memory; else the figures it checked."""
    ram = machine_ram_bytes() if ram is None else ram
    if streaming:
        need = streaming_peak_bytes(dims, precisions, evaluate, gptq)
        if ram is not None and need > ram:
            raise RecipeError(
                f"the streaming build of {name} needs about {need / 1e9:.1f} GB of RAM at its peak (its largest "
                f"tensor, {largest_tensor_bytes(dims) / 1e9:.2f} GB in fp32, a few times"
                + (", and each engine in ONNX Runtime for the evaluate stage" if evaluate else "")
                + f"), and this machine has {ram / 1e9:.1f} GB: build on a larger machine"
                + (", add --skip-eval" if evaluate else "") + ", or pass --skip-ram-check to try anyway")
        return {"planned_peak_bytes": need, "peak_stage": "quantize (streamed)", "machine_ram_bytes": ram}
    need = build_peak_bytes(dims, precisions)
    stage = peak_stage(precisions)
    if ram is not None and need > ram:
        alt = (" (without int8-qdq, whose calibration needs the most, up to about "
               f"{largest_buildable(ram) / 1e9:.2f}B)" if stage != "export" else "")
        raise RecipeError(
            f"building {name} ({dims.num_parameters / 1e9:.2f}B parameters, {4 * dims.num_parameters / 1e9:.1f} GB in "
            f"fp32) needs about {need / 1e9:.1f} GB of RAM at its peak (the {stage} stage: "
            f"~{PEAK_PER_FP32_BYTE[stage]:g}x the fp32 weights, measured), and this machine has {ram / 1e9:.1f} GB: "
            f"it builds models up to about {largest_buildable(ram, precisions) / 1e9:.2f}B parameters{alt}. Build on a "
            f"machine with at least {need / 1e9:.0f} GB (the bundle then runs on the device as planned), or pass "
            "--skip-ram-check to try anyway")
    return {"planned_peak_bytes": need, "peak_stage": stage, "machine_ram_bytes": ram}
