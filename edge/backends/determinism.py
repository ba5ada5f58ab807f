"""Which engines give batch-invariant answers on this machine: the same request gets the same answer whether it
is decoded alone or beside other users' rows. A promise with a scope, per engine and CPU feature set, from what
was measured (docs/status.md): the server shows it in /v1/models, `edge-chat info` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge.device.probe import cpu_flags
from edge.precisions import FP32, INT4_WEIGHT, INT8_DYNAMIC

# Engines measured batch-invariant on ONNX Runtime's CPU provider, with the CPU feature that needs (None: any
# x86/Arm CPU measured): int4-weight's MatMulNBits is invariant with AVX-512 VNNI, not on AVX2-only EPYCs
# (logits up to 0.56 apart, docs/status.md, 2026-12-04).
CPU_INVARIANT_NEEDS: dict[str, str | None] = {FP32: None, INT8_DYNAMIC: None, INT4_WEIGHT: "avx512_vnni"}


@dataclass(frozen=True)
class BatchInvariance:
    """Whether batched answers equal the answer alone here (`guaranteed`), and why."""

    guaranteed: bool
    why: str

    def card(self) -> dict:
        return {"batch_invariant": self.guaranteed, "why": self.why}


def float_activations(manifest, precision: str) -> bool:
    """Whether the bundle's engine of `precision` was quantized with float activations (int4-weight built with
    --int4-activations fp32: MatMulNBits accuracy level 1, another kernel than the measured one), by its quantize
    stage's record (its options, as the build and the streaming build record them)."""
    stage = next((s for s in getattr(manifest, "stages", []) if s.name == f"quantize-{precision}"), None)
    return stage is not None and stage.params.get("accuracy_level", 4) != 4


def batch_invariance(precision: str, provider: str, flags: set[str] | None = None,
                     float_acts: bool = False) -> BatchInvariance:
    """The promise for an engine of `precision` run by ONNX Runtime's `provider` (or "TensorRT") on a CPU with
    feature `flags` (default: this machine's); `float_acts`: its MatMulNBits compute with float activations
    (`float_activations`), whose kernels were not measured."""
    if provider != "CPUExecutionProvider":
        return BatchInvariance(False, f"not measured on {provider}: batched answers may differ from the answer "
                                      "alone in rare near-ties")
    if precision not in CPU_INVARIANT_NEEDS:
        return BatchInvariance(False, f"{precision} on CPU: batch invariance not measured")
    if float_acts:
        return BatchInvariance(False, f"{precision} with float activations on CPU: batch invariance not measured "
                                      "(ONNX Runtime runs other kernels for one row and for several)")
    need = CPU_INVARIANT_NEEDS[precision]
    flags = cpu_flags() if flags is None else flags
    if need is not None and need not in flags:
        return BatchInvariance(False, f"{precision} on a CPU without {need}: ONNX Runtime's kernels are not "
                                      "batch-invariant there (docs/status.md), so an answer can differ from the same "
                                      f"request alone; serve {INT8_DYNAMIC} where that matters")
    return BatchInvariance(True, f"{precision} on this CPU: batched rows' logits equal the row alone (tested), "
                                 "prefill calls fixed by position")
