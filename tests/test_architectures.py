"""Every entry of the architecture table, built end to end on a tiny random-init model of that architecture.

For each: the export stage (plain graph, and the fused graph where the entry says it can be written,
each parity-checked against PyTorch: logits, cached decode, 64 greedy tokens), int8-dynamic and
int4-weight quantization, and each shipped engine decoding through the edge runtime with logits
close to the fp32 graph's. The cases carry what distinguishes the family as users meet it: Llama 3's
rope scaling and untied head, Mistral's sliding window (shorter than the parity prompts plus their
answers, so it engages), Qwen2's attention bias with tied and untied embeddings, Qwen3's q/k norms.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny_model
from export.architectures import ARCHITECTURES

CASES = {
    "LlamaForCausalLM": dict(tie=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "MistralForCausalLM": dict(tie=False, sliding_window=24),
    "Qwen2ForCausalLM": dict(tie=True),
    "Qwen2ForCausalLM-untied": dict(tie=False),
    "Qwen3ForCausalLM": dict(tie=True, head_dim=16),
    "Phi3ForCausalLM": dict(tie=False),
}


def test_every_architecture_in_the_table_has_a_case():
    assert set(ARCHITECTURES) == {c.split("-")[0] for c in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_architecture_builds_and_runs(case, tmp_path):
    from edge.bundle import Bundle
    from edge.backends.onnxruntime import OrtDecoder
    from export.recipe import BuildOptions, build

    arch = case.split("-")[0]
    src = make_tiny_model(tmp_path / case, arch=arch, **CASES[case])
    bundle = build(BuildOptions(output=tmp_path / "b.bundle", model=str(src), max_context=256, skip_eval=True,
                                precisions=("fp32", "int8-dynamic", "int4-weight"), calibration_samples=2),
                   log=lambda s: None)
    export = next(s for s in bundle.manifest.stages if s.name == "export")
    assert export.metrics["greedy_tokens_identical"]  # the plain graph vs PyTorch (a ParityError otherwise)
    fused = export.metrics["fused"]
    assert fused["written"] == ARCHITECTURES[arch].fusable, fused
    if fused["written"]:
        assert fused["greedy_tokens_identical"]
    b = Bundle.open(bundle.root)
    ids = list(range(3, 40))
    logits = {}
    for e in b.manifest.engines:
        dec = OrtDecoder.from_entry(b, b.manifest.engine(e.name), threads=1)
        logits[e.name] = dec.forward(np.array([ids]), dec.new_cache(capacity=len(ids)), last_only=False)[0]
        assert np.isfinite(logits[e.name]).all()
        assert e.fingerprint.variant == ("fused" if fused["written"] and e.name != "fp32" else "plain")
    ref = logits["fp32"]
    for name in ("int8-dynamic", "int4-weight"):
        corr = np.corrcoef(logits[name].ravel(), ref.ravel())[0, 1]
        assert corr > (0.99 if name == "int8-dynamic" else 0.9), f"{case} {name}: correlation {corr:.4f}"
