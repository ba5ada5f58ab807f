"""Re-ask the golden prompts a bundle carries and compare with the answers recorded at export.

The export's evaluate stage saved, per engine, greedy answers to a fixed set of prompts. On the
device (after an engine build or a deploy) the same prompts are asked again with the engine that will
serve, so a broken engine or a wrong backend shows up as changed answers before users see it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from edge.bundle import Bundle, EngineEntry, Manifest
from edge.decode import conversation
from edge.precisions import FP32
from edge.decode.sampling import SamplingConfig

GOLDEN_TOKENS = 48  # export/evaluate.py answers golden prompts with 48 greedy tokens


def reference_answers(manifest: Manifest, engine: str | None = None) -> dict[str, dict]:
    """prompt -> recorded golden entry, for `engine` (default: fp32, the teacher)."""
    want = engine or FP32
    rows = [g for g in manifest.golden if g.get("engine") == want] or \
           [g for g in manifest.golden if g.get("engine") == (manifest.golden[0]["engine"] if manifest.golden else None)]
    return {g["prompt"]: g for g in rows}


def recheck(gen, manifest: Manifest, reference: str | None = None) -> dict:
    """Ask every golden prompt greedily; count answers identical to the reference and keyword passes."""
    ref = reference_answers(manifest, reference)
    cfg = SamplingConfig(max_new_tokens=GOLDEN_TOKENS)
    rows, same, passed, checked = [], 0, 0, 0
    for prompt, g in ref.items():
        text, _ = gen.complete(conversation.prompt(gen.tokenizer, [{"role": "user", "content": prompt}]).ids, cfg)
        text = text.strip()
        ok = any(k.lower() in text.lower() for k in g.get("expect") or []) if g.get("expect") else None
        same += text == g["answer"]
        passed += bool(ok)
        checked += ok is not None
        rows.append({"prompt": prompt, "answer": text, "reference": g["answer"], "same": text == g["answer"],
                     "passed": ok})
    return {"reference_engine": next(iter(ref.values()))["engine"] if ref else None, "prompts": rows,
            "same_as_reference": f"{same}/{len(rows)}", "golden_passed": f"{passed}/{checked}"}


def engine_recheck(bundle: Bundle, reference: str) -> Callable[[Path, EngineEntry], dict]:
    """The golden prompts asked of a newly built engine file before the manifest names it (the build-engine
    command passes this to edge.backends.tensorrt.builder.build_engine): how many answers equal `reference`'s
    (the graph it was built from) and how many pass their keywords."""

    def check(engine_file: Path, entry: EngineEntry) -> dict:
        from edge.backends.choose import engine_file_decoder
        from edge.decode.generate import Generator
        from edge.decode.tokenizer import ChatTokenizer

        m = bundle.manifest
        gen = Generator(ChatTokenizer(bundle.path(m.tokenizer.file), m.tokenizer),
                        engine_file_decoder(bundle, entry, engine_file), m.generation, bundle)
        result = recheck(gen, m, reference=reference)
        return {"golden_same_as_source": result["same_as_reference"], "golden_passed": result["golden_passed"]}

    return check
