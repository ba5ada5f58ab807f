"""Package stage: stage outputs -> a verified bundle, written atomically."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from edge import precisions
from edge.bundle import Bundle, BundleWriter, EngineEntry, Fingerprint, Manifest, StageRecord, schema_needed
from edge.io_contract import DecoderIO, io_for_variant
from export import trt_compat
from export.load import META, model_dims, tokenizer_spec

DEFAULT_GENERATION = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


@dataclass
class EngineArtifact:
    name: str
    folder: Path  # holds model.onnx (+ external data)
    precision: str
    variant: str = "plain"
    quality: dict = field(default_factory=dict)
    report_only: bool = False  # measured for the report (e.g. an ablation), not shipped
    dims_dir: Path | None = None  # the HF folder this graph was exported from, when not the shipped model's
    lineage: bool = False  # teacher / pruned-only: quality and speed measured, no golden answers
    reference: bool = False  # the fp32 graph every engine is compared with: measured in full even when not shipped
    logit_ids: Path | None = None  # a cut LM head's vocabulary ids (.npy; export/draft.py), shipped beside the graph
    kv_cache: str = ""  # "int8": the fused graph's K/V buffers are int8 (export/kv_int8.py); its io says so

    @property
    def io(self) -> DecoderIO:
        """The contract the graph follows (what the manifest records, and what evaluation binds)."""
        return io_for_variant(self.variant, self.kv_cache)


@dataclass
class DraftArtifact:
    """A draft model's bundle (export/draft.py) to ship inside the target's, with what was measured of it."""
    root: Path  # a complete, verified bundle
    engine: str  # the draft's engine
    target_engine: str  # the target engine its acceptance was measured against
    records: list[StageRecord]
    acceptance: dict


def _head_tokens(bundle: Bundle, engine: str) -> int:
    """The tokens an engine's LM head scores: its cut head's ids, else the whole vocabulary."""
    import numpy as np

    rel = bundle.manifest.engine_io(bundle.manifest.engine(engine)).get("logit_ids")
    return len(np.load(bundle.path(rel))) if rel else bundle.manifest.model.vocab_size


def _opset(path: Path) -> int:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


TENSORRT_SOURCES = precisions.TENSORRT_SOURCES


def run(hf_dir: Path, engines: list[EngineArtifact], stages: list[StageRecord], dst: Path, max_context: int,
        golden: list[dict] | None = None, extra_files: dict[str, Path] | None = None,
        draft: DraftArtifact | None = None) -> Bundle:
    import onnxruntime as ort

    src = json.loads((hf_dir / META).read_text())
    dims = model_dims(hf_dir, max_context)
    spec = tokenizer_spec(hf_dir)
    gen = dict(DEFAULT_GENERATION)
    shipped_draft = Bundle.open(draft.root, verify="full") if draft is not None else None
    digest = hashlib.sha256(json.dumps([src, [e.name for e in engines], [s.params for s in stages],
                                        shipped_draft.manifest.bundle_id if shipped_draft else None],
                                       sort_keys=True, default=str).encode()).hexdigest()[:10]
    slug = "".join(c if c.isalnum() else "-" for c in src["name"].lower()).strip("-")
    with BundleWriter(dst) as w:
        shutil.copy2(hf_dir / "tokenizer.json", w.root / "tokenizer.json")
        entries = []
        for e in engines:
            edir = w.root / "engines" / e.name
            edir.mkdir(parents=True)
            for f in e.folder.iterdir():
                if f.name.startswith("model.onnx"):
                    shutil.copy2(f, edir / f.name)
            fp = Fingerprint(format="onnx", precision=e.precision, opset=_opset(edir / "model.onnx"),
                             variant=e.variant, providers=["CPUExecutionProvider", "CUDAExecutionProvider"],
                             onnxruntime_version=ort.__version__)
            quality = dict(e.quality)
            if e.precision in TENSORRT_SOURCES and e.variant == "plain":  # graphs TensorRT builds engines from
                rep = trt_compat.check(edir / "model.onnx")
                quality["tensorrt_check"] = {"compatible": rep.compatible, "problems": rep.problems,
                                             "opset": rep.opset, "qdq_nodes": rep.quantize_nodes + rep.dequantize_nodes,
                                             "tensorrt_version": trt_compat.DEFAULT_TENSORRT}  # the op table's
            io = e.io
            if e.logit_ids is not None:
                shutil.copy2(e.logit_ids, edir / e.logit_ids.name)
                io = dataclasses.replace(io, logit_ids=f"engines/{e.name}/{e.logit_ids.name}")
            entries.append(EngineEntry(name=e.name, file=f"engines/{e.name}/model.onnx", fingerprint=fp, quality=quality,
                                       io={} if io == DecoderIO() else io.to_dict()))
        draft_entry: dict = {}
        if shipped_draft is not None:
            from export.draft import DRAFT_DIR

            shutil.copytree(shipped_draft.root, w.root / DRAFT_DIR)
            dm = shipped_draft.manifest
            draft_entry = {"path": DRAFT_DIR, "engine": draft.engine, "bundle_id": dm.bundle_id,
                           "num_parameters": dm.model.num_parameters, "num_layers": dm.model.num_layers,
                           "bytes": dm.engine_bytes(draft.engine), "target_engine": draft.target_engine,
                           "head_tokens": _head_tokens(shipped_draft, draft.engine),
                           "acceptance": draft.acceptance}
        for rel, path in (extra_files or {}).items():
            (w.root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, w.root / rel)
        manifest = Manifest(
            bundle_id=f"{slug}-{digest}", model_name=src["name"], source=src["source"], model=dims, tokenizer=spec,
            io=DecoderIO().to_dict(), engines=entries, stages=stages, generation=gen, golden=golden or [],
            draft=draft_entry, schema_version=schema_needed(draft_entry, entries, spec.add_bos),
        )
        return w.commit(manifest)
