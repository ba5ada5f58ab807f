"""The build recipe: which stages run, with which options, chained artifact to artifact.

A recipe is a small TOML file; CLI flags override it. Each stage runs into
`OUT.work/<stage>/` and is reused when its params have not changed, so an
interrupted build resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge.bundle import Bundle, StageRecord
from edge import precisions
from edge.decode.cache import cache_kind
from edge.errors import RecipeError
from edge.precisions import FP8, FP16, FP32, INT4_QDQ, INT4_WEIGHT, INT8_DYNAMIC, INT8_QDQ
from export.console import fmt_bytes
from export.distill import DistillOptions
from export.draft import DraftOptions
from export.prune import PruneOptions

BUILD_PRECISIONS = precisions.EXPORTED
# why the default int4-weight build is not the engine docs/quality.md measures against llama.cpp's Q4_K_M
INT4_ACTIVATIONS = {"int8": 4, "fp32": 1}  # int4-weight's activations -> MatMulNBits' accuracy_level  # noqa: precision
INT4_DEFAULT_NOTE = ("all 4-bit, no size budget. At llama.cpp's Q4_K_M's size, --int4-block 64 --int4-budget-mb <that "
                     "GGUF's MB> is below its KL on chats and news prose and 1.1x on text unlike the "
                     "calibration's; below it on all three takes float activations (--int4-activations fp32: 15x slower "
                     "on ONNX Runtime's CPU kernels) or TensorRT's int4-qdq (docs/quality.md). SmolLM2 with --int4-block 64 "
                     "--int4-extra-ratio 0.02: KL 0.077 at 95.6 MB, all 4 bits in blocks of 32 (the default) 0.111 at 101 "
                     "MB; `edge-export plan` prints the largest measured budget that fits your device. Not the default: "
                     "the budget is per model and its sensitivity pass runs the fp32 model once per 4-bit MatMul (minutes "
                     "at 135M, hours on a CPU at billions of parameters)")
FROM_FUSED = tuple(p for p in precisions.QUANTIZED if precisions.get(p).variant == "fused")  # quantized from the fused graph when there is one


# The module each stage runs: a finished stage is reused only while the edgechat source it imports
# (this module and, transitively, the edge/export modules it imports) is unchanged.
STAGE_CODE = {"load": "export.load", "prune": "export.prune", "export-teacher": "export.onnx_export",
              "export-pruned": "export.onnx_export", "teacher-answers": "export.teacher_answers",
              "distill": "export.distill", "export": "export.onnx_export", "quantize": "export.quantize",
              "evaluate": "export.evaluate", "acceptance": "export.draft", "head": "export.draft", FP16: "export.fp16",
              "kv-int8": "export.kv_int8"}


@dataclass(frozen=True)
class BuildOptions:
    output: Path
    model: str = "default"
    # what the bundle ships; the fp32 graph is always exported and measured as the reference, and
    # shipped only when asked for (an 8B model's fp32 graph is 32 GB)
    precisions: tuple[str, ...] = (INT8_DYNAMIC,)
    max_context: int = 2048
    opset: int = 18  # optimum's recommended minimum for these decoders; TensorRT 10's parser reads 9-20
    parity_atol: float = 1e-3
    calibration: str | None = None
    calibration_samples: int = 64
    smoothquant_alpha: float = 0.5
    # int4-weight and int4-qdq: the engine's size in MB at most (the most sensitive MatMuls go to 8 bits within
    # it), else int4_extra_ratio of the all-4-bit size; int4_rounding (int4-weight): "gptq", "minmax" or "kquant"
    int4_budget_mb: float | None = None
    int4_extra_ratio: float = 0.0
    int4_rounding: str = "gptq"
    gptq_samples: int = 96  # gptq rounding: calibration texts (half chats, half training prose) of 512 tokens
    # ...from these domains (export/calibration_texts.py: chat, news, literature, code, docs), split evenly
    gptq_domains: tuple[str, ...] = ("chat", "news")
    int8_rounding: str = "gptq"  # int8-dynamic, int8-qdq and fp8-qdq: "gptq" or "minmax" (export/quantize.py)
    # int8-qdq and fp8-qdq: the share of their 8-bit weights' bytes that may stay fp16 where 8-bit activations hurt
    # most (measured per activation: minutes on a small model; 0 skips that pass; export/int8_search.py). fp8-qdq
    # at 0.7: KL 0.0047 on SmolLM2's chats against 0.0187, for 1.7x the FP8 bytes (docs/quality.md)
    qdq_float_ratio: float = 0.2
    qdq_float_kl: float = 0.004  # ...and it stops once the rest's measured KLs sum to this (0: spend the whole budget)
    int4_block_size: int = 32  # int4-weight and int4-qdq: 4-bit block size (edge-export plan says which fits)
    # int4-weight and int4-qdq: GPTQ's damping of the 4-bit weights (QuantizeOptions' default: docs/quality.md)
    int4_gptq_damp: float = 0.03
    # int4-weight: what its MatMulNBits multiply the 4-bit weights with: "int8" activations (ONNX Runtime's
    # accuracy level 4, the fast kernel) or "fp32" (level 1: less KL, slower decode; docs/quality.md)
    int4_activations: str = "int8"
    int4_lm_head_bits: int = 8
    # texts (half calibration chats, half training prose) the per-layer sensitivity of int8-qdq's and fp8-qdq's float
    # budgets and the int4 byte budgets is measured on: each runs the model once per quantized MatMul group per text
    # (SmolLM2's int8-qdq: ~1 s per group at 4 texts; hours at billions of parameters): fewer is faster and noisier
    sensitivity_samples: int = 4
    # int8-qdq: also build and score it without SmoothQuant, for the report's "SmoothQuant on vs off" (report only)
    smoothquant_ablation: bool = False
    eval_samples: int = 64
    skip_eval: bool = False
    fresh: bool = False
    reuse_stale: bool = False  # reuse finished stages even when the edgechat code that ran them has changed
    online: bool = False
    # a Jinja chat template file: for a model without one (a base model), or instead of its own
    chat_template: str | None = None
    ram_check: bool = True  # refuse a build whose planned peak memory exceeds this machine's RAM
    threads: int | None = None
    fused: bool = True  # write the fused ONNX Runtime graph and quantize the CPU/CUDA engines from it
    # write int8-dynamic / int4-weight straight from the checkpoint, one tensor at a time (export/stream_build.py):
    # memory bounded by the largest tensor, not the model; no fp32 graph: the reference is the model run one block
    # at a time
    streaming: bool = False
    # what the fused engines' K/V buffers hold: "float" (the graph's float type) or "int8" (per-channel scales
    # calibrated at export, export/kv_int8.py); recorded in each engine's `io`, so the runtime reads it
    kv_cache: str = "float"
    prune: PruneOptions | None = None  # [prune] section: None = keep the model's size
    distill: DistillOptions | None = None  # [distill] section: only after a prune
    draft: DraftOptions | None = None  # [draft] section / --draft: a draft model shipped in the bundle

    def __post_init__(self) -> None:
        bad = [p for p in self.precisions if p not in BUILD_PRECISIONS]
        if bad:
            raise RecipeError(f"unknown precision {bad[0]!r}: choose from {', '.join(BUILD_PRECISIONS)}")
        if not self.precisions:
            raise RecipeError(f"no precision to build: choose from {', '.join(BUILD_PRECISIONS)}")
        if self.max_context < 64:
            raise RecipeError(f"max_context must be >= 64, got {self.max_context}")
        if not 0 <= self.smoothquant_alpha <= 1:
            raise RecipeError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")
        from export.planner import check_int4_layout

        check_int4_layout(self.int4_block_size, self.int4_lm_head_bits)
        from export.quantize import INT8_ROUNDINGS, ROUNDINGS, check_int4_budget, check_qdq_budget, is_number

        check_int4_budget(self.int4_budget_mb, self.int4_extra_ratio)

        if self.int4_activations not in INT4_ACTIVATIONS:
            raise RecipeError(f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}, got {self.int4_activations!r}")
        if not is_number(self.int4_gptq_damp) or not 0 < self.int4_gptq_damp <= 1:
            raise RecipeError(f"int4_gptq_damp must be in (0, 1] (a share of X^T X's mean diagonal), got {self.int4_gptq_damp}")
        if self.int4_rounding not in ROUNDINGS:
            raise RecipeError(f"int4_rounding must be one of {', '.join(ROUNDINGS)}, got {self.int4_rounding!r}")
        if self.int8_rounding not in INT8_ROUNDINGS:
            raise RecipeError(f"int8_rounding must be 'gptq' or 'minmax', got {self.int8_rounding!r}")
        if self.int4_rounding == "kquant" and INT4_QDQ in self.precisions:
            raise RecipeError("int4-qdq's blocks are symmetric (TensorRT takes no zero points) and kquant's have an "
                              "offset: choose --int4-rounding gptq or minmax, or build int4-qdq in a build of its own")
        from export.calibration_texts import check_domains

        check_domains(tuple(self.gptq_domains))
        check_qdq_budget(self.qdq_float_ratio, self.qdq_float_kl)
        if not isinstance(self.smoothquant_ablation, bool):
            raise RecipeError(f"smoothquant_ablation must be true or false, got {self.smoothquant_ablation!r}")
        if isinstance(self.sensitivity_samples, bool) or not isinstance(self.sensitivity_samples, int) \
                or self.sensitivity_samples < 1:
            raise RecipeError(f"sensitivity_samples must be a whole number >= 1 (texts each quantized MatMul's "
                              f"sensitivity is measured on), got {self.sensitivity_samples!r}")
        if not isinstance(self.gptq_samples, int) or self.gptq_samples < 1:
            raise RecipeError(f"gptq_samples must be a whole number >= 1 (calibration texts for GPTQ), got {self.gptq_samples!r}")
        for name, kind in (("prune", PruneOptions), ("distill", DistillOptions), ("draft", DraftOptions)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
                raise RecipeError(f"{name} must be a [{name}] table of options in a recipe, got {getattr(self, name)!r}")
        # the draft is checked by the scheduler's cache for one of this build's engines on CPU (edge.decode.cache)
        if self.draft is not None and not any(cache_kind(self.fused and p in FROM_FUSED).can_verify for p in self.precisions):
            raise RecipeError("a draft model is checked by a fused CPU engine (int8-dynamic or int4-weight), which this "
                              f"build does not make (it builds {', '.join(self.precisions)}"
                              f"{', --no-fused' if not self.fused else ''}): add --precision int8-dynamic")
        from export.kv_int8 import check_kv_cache

        check_kv_cache(self.kv_cache)
        if self.kv_cache == "int8" and not (self.fused and any(p in FROM_FUSED for p in self.precisions)):
            raise RecipeError("--kv-cache int8 is written into the fused CPU graph (int8-dynamic or int4-weight), which "
                              f"this build does not make (it builds {', '.join(self.precisions)}"
                              f"{', --no-fused' if not self.fused else ''}): add --precision int8-dynamic")
        if self.streaming:
            from export.stream_build import check_options

            check_options(self)
        if self.distill is not None and self.prune is None:
            raise RecipeError("distill needs a prune stage before it (a [prune] section or --prune RATIO): "
                              "distilling a model into itself teaches it nothing")

    @property
    def work(self) -> Path:
        return self.output.with_name(self.output.name + ".work")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> "BuildOptions":
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RecipeError(f"recipe file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"recipe {path} is not valid TOML: {e}") from None
        nested = {}
        if isinstance(raw.get("draft"), dict):
            nested["draft"] = DraftOptions.from_section(raw.pop("draft"), str(path))
        for name, kind in (("prune", PruneOptions), ("distill", DistillOptions)):
            if isinstance(raw.get(name), dict):
                sec = raw.pop(name)
                known = {f.name for f in dataclasses.fields(kind)}
                if set(sec) - known:
                    raise RecipeError(f"recipe {path} [{name}] has unknown options {sorted(set(sec) - known)} "
                                      f"(known: {sorted(known)})")
                nested[name] = kind(**sec)
        flat = {}
        for section, values in raw.items():
            if isinstance(values, dict):
                flat.update(values)
            else:
                flat[section] = values
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(flat) - known
        if unknown:
            raise RecipeError(f"recipe {path} has unknown options {sorted(unknown)} (known: {sorted(known)})")
        if "precisions" in flat:
            flat["precisions"] = tuple(flat["precisions"])
        if isinstance(flat.get("gptq_domains"), list):
            flat["gptq_domains"] = tuple(flat["gptq_domains"])
        flat.update(nested)
        flat.update({k: v for k, v in overrides.items() if v is not None})
        if "output" not in flat:
            raise RecipeError("no output folder: pass -o OUT.bundle")
        flat["output"] = Path(flat["output"])
        return cls(**flat)

    @classmethod
    def from_cli(cls, a: argparse.Namespace) -> "BuildOptions":
        over = dict(output=a.output, model=a.model if a.model != "default" or not a.recipe else None,
                    precisions=tuple(a.precision) if a.precision else None, max_context=a.max_context,
                    calibration=a.calibration, eval_samples=a.eval_samples, skip_eval=a.skip_eval or None,
                    fresh=a.fresh or None, reuse_stale=getattr(a, "reuse_stale", False) or None, online=a.online or None,
                    chat_template=getattr(a, "chat_template", None),
                    fused=False if getattr(a, "no_fused", False) else None, kv_cache=getattr(a, "kv_cache", None),
                    streaming=getattr(a, "streaming", False) or None,
                    int4_budget_mb=getattr(a, "int4_budget_mb", None), int4_extra_ratio=getattr(a, "int4_extra_ratio", None),
                    qdq_float_ratio=getattr(a, "qdq_float_ratio", None),
                    int4_block_size=getattr(a, "int4_block", None), int4_lm_head_bits=getattr(a, "int4_head_bits", None),
                    int4_rounding=getattr(a, "int4_rounding", None), int8_rounding=getattr(a, "int8_rounding", None),
                    int4_gptq_damp=getattr(a, "int4_gptq_damp", None), int4_activations=getattr(a, "int4_activations", None),
                    gptq_domains=tuple(a.gptq_domains.split(",")) if getattr(a, "gptq_domains", None) else None,
                    ram_check=False if getattr(a, "skip_ram_check", False) else None)
        base = cls.from_toml(a.recipe, **over) if a.recipe else \
            cls(**{k: (Path(v) if k == "output" else v) for k, v in over.items() if v is not None})
        prune, distill = base.prune, base.distill
        if getattr(a, "prune", None) is not None or getattr(a, "fit", None):
            p = prune or PruneOptions()  # --prune RATIO and/or --fit PROFILE replace the recipe's target
            prune = dataclasses.replace(p, target_ratio=a.prune, fit=a.fit or p.fit,
                                        fit_context=a.fit_context or p.fit_context)
            distill = distill or DistillOptions()
        if getattr(a, "vocab_size", None):
            if prune is None:
                raise RecipeError("--vocab-size prunes the vocabulary: give it with --prune RATIO, --fit PROFILE or a "
                                  "recipe with a [prune] section")
            prune = dataclasses.replace(prune, vocab_size=a.vocab_size)
        if getattr(a, "distill_steps", None) or getattr(a, "distill_minutes", None):
            distill = dataclasses.replace(distill or DistillOptions(), **{k: v for k, v in
                                          (("steps", a.distill_steps), ("max_minutes", a.distill_minutes)) if v})
        if getattr(a, "no_distill", False):
            distill = None
        draft = base.draft
        if getattr(a, "draft", False) or getattr(a, "draft_layers", None) is not None:
            layers = getattr(a, "draft_layers", None)
            draft = dataclasses.replace(draft or DraftOptions(), **({"layers": layers} if layers is not None else {}))
        engine_flags = [(f, engines) for f, v, engines in (
            ("--qdq-float-ratio", getattr(a, "qdq_float_ratio", None), (INT8_QDQ, FP8)),
            ("--int4-block", getattr(a, "int4_block", None), (INT4_WEIGHT, INT4_QDQ)),
            ("--int4-head-bits", getattr(a, "int4_head_bits", None), (INT4_WEIGHT,)),
            ("--int4-budget-mb", getattr(a, "int4_budget_mb", None), (INT4_WEIGHT, INT4_QDQ)),
            ("--int4-extra-ratio", getattr(a, "int4_extra_ratio", None), (INT4_WEIGHT, INT4_QDQ))) if v is not None]
        for flag, engines in engine_flags:
            if not set(engines) & set(base.precisions):
                raise RecipeError(f"{flag} shapes the {' and '.join(engines)} engine, which this build does not make "
                                  f"(it builds {', '.join(base.precisions)}): add --precision {engines[0]}")
        return dataclasses.replace(base, prune=prune, distill=distill, draft=draft)


def build(opts: BuildOptions, log=print, verbose: bool = False, quiet: bool = False) -> Bundle:
    """load -> export (+parity) -> quantize per precision -> evaluate -> package.

    Each stage's third-party output goes to OUT.work/<stage>/log.txt (`verbose`: to the terminal); its
    progress shows on the terminal unless `quiet`."""
    from export import load, onnx_export, package
    from export.model_source import resolve
    from export.stages import run_stage

    ref = resolve(opts.model)
    if opts.ram_check and ref.kind != "hub":  # refuse up front what would run out of memory hours later
        from export.build_memory import check_fits
        from export.model_source import describe

        check_fits(describe(opts.model)[1], ref.name, opts.precisions, streaming=opts.streaming,
                   evaluate=not opts.skip_eval, gptq="gptq" in (opts.int8_rounding, opts.int4_rounding))
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)

    def stage(name: str, params: dict, fn):
        base = name.removeprefix("draft-")  # the draft's stages run the same modules
        code = STAGE_CODE["quantize" if base.startswith("quantize-") else "kv-int8" if base.startswith("kv-int8-") else base]
        code = "export.stream_build" if opts.streaming and base in ("load", *(f"quantize-{p}" for p in opts.precisions)) \
            else code
        return run_stage(work, name, params, fn, opts.fresh, log, code=code, reuse_stale=opts.reuse_stale,
                         verbose=verbose, quiet=quiet)

    records: list[StageRecord] = []

    template = load.read_chat_template(opts.chat_template) if opts.chat_template else None
    load_params = {"model": f"{ref.kind}:{ref.location}:{ref.gguf_file}"}
    if template is not None:  # another template is another load (its digest: the same file reuses the stage)
        load_params["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()
    if opts.streaming:
        from export import stream_build

        hf_dir, rec = stage("load", load_params | {"streamed": True},
                            lambda d: stream_build.load(ref, d, chat_template=template))
        engines, recs = stream_build.stages(stage, opts, hf_dir, rec.finished, _quantize_options)
        records = [rec, *recs]
        golden, extra = [], {}
        if not opts.skip_eval:  # the fp32 reference: the model run one block at a time, no graph
            golden, extra = evaluate_stage(stage, opts, hf_dir, [*engines, stream_build.reference_artifact(hf_dir)],
                                           engines, records, stream_build.reference_logits(hf_dir),
                                           {"reference": "fp32 torch, one block at a time"})
        return _package(opts, hf_dir, engines, records, golden, extra, None, work, verbose, log)
    hf_dir, rec = stage("load", load_params, lambda d: load.run(ref, d, online=opts.online, chat_template=template))
    records.append(rec)
    if opts.draft is not None:  # what would fail after hours of building fails now
        from export import draft as dm

        dm.check(opts.draft, hf_dir, opts.prune)
    eopts = onnx_export.ExportOptions(opset=opts.opset, parity_atol=opts.parity_atol, fused=opts.fused)
    lineage_eopts = dataclasses.replace(eopts, fused=False)  # teacher / pruned-only: measured in fp32 only
    lineage: list = []  # teacher and pruned-only graphs: measured for the report, not shipped
    teacher_dir = hf_dir
    if opts.prune is not None:
        from export import prune

        popts = opts.prune
        pruned_dir, rec = stage("prune", dataclasses.asdict(popts) | {"load": rec.finished},
                                    lambda d: prune.run(teacher_dir, d, popts))
        records.append(rec)
        log(f"[prune] {prune.describe(rec.metrics)}")
        hf_dir = pruned_dir
        t_dir, _ = stage("export-teacher", dataclasses.asdict(lineage_eopts) | {"load": records[0].finished},
                             lambda d: onnx_export.run(teacher_dir, d, lineage_eopts))
        lineage.append(package.EngineArtifact("teacher", t_dir, FP32, report_only=True, dims_dir=teacher_dir,
                                              lineage=True))
        if opts.distill is not None:
            dopts = opts.distill
            p_dir, _ = stage("export-pruned", dataclasses.asdict(lineage_eopts) | {"prune": rec.finished},
                                 lambda d: onnx_export.run(pruned_dir, d, lineage_eopts))
            lineage.append(package.EngineArtifact("pruned-only", p_dir, FP32, report_only=True, dims_dir=pruned_dir,
                                                  lineage=True))
            hf_dir, recs = _distill_stages(stage, teacher_dir, pruned_dir, {"prune": rec.finished},
                                           {"load": records[0].finished}, dopts, opts.threads,
                                           work / ".distill-checkpoint", log)
            records += recs
            rec = recs[-1]
    shipped_from = rec.finished
    fp32_dir, rec = stage("export", dataclasses.asdict(eopts) | ({"model": shipped_from} if opts.prune else {}),
                              lambda d: onnx_export.run(hf_dir, d, eopts))
    records.append(rec)
    reference = package.EngineArtifact(FP32, fp32_dir, FP32, quality={"parity": rec.metrics},
                                       report_only=FP32 not in opts.precisions, reference=True)
    engines = [] if reference.report_only else [reference]  # what the bundle ships
    report_only: list = [reference] if reference.report_only else []  # measured and shown in the report, not shipped
    exported = rec.finished  # later stages depend on this export: a new export invalidates them
    fused_dir = fp32_dir / onnx_export.FUSED_DIR
    has_fused = opts.fused and (fused_dir / "model.onnx").is_file()
    if opts.fused and not has_fused:
        why = rec.metrics.get('fused', {}).get('reason', 'not written')
        if opts.draft is not None:
            raise RecipeError(f"a draft needs a fused graph of the model to check it, and none was written ({why}): "
                              "build without --draft")
        log(f"[export] no fused graph: {why}; the ONNX Runtime engines use the plain graph")
        if opts.kv_cache == "int8":
            raise RecipeError(f"--kv-cache int8 is written into the fused graph, and none was written ({why}): "
                              "build without --kv-cache int8")

    stamps: dict[str, str] = {}  # each quantized engine's stage stamp (what a later stage was measured on)
    for precision in opts.precisions:
        if precision == FP32:
            continue
        if precision == FP16:  # converted, not quantized: the fp32 plain graph with fp32 islands kept
            from export import fp16

            fopts = fp16.Fp16Options()
            f_dir, rec = stage(FP16, dataclasses.asdict(fopts) | {"export": exported},
                               lambda d, o=fopts: fp16.run(fp32_dir, d, o))
            records.append(rec)
            engines.append(package.EngineArtifact(FP16, f_dir, FP16))
            continue
        from export import quantize

        qopts = _quantize_options(opts, precision)
        variant = "fused" if has_fused and precision in FROM_FUSED else "plain"
        src_dir = fused_dir if variant == "fused" else fp32_dir
        qdir, rec = stage(f"quantize-{precision}",
                              dataclasses.asdict(qopts) | {"export": exported, "variant": variant},
                              lambda d, q=qopts, s=src_dir: quantize.run(s, hf_dir, d, q))
        records.append(rec)
        if precision == INT4_WEIGHT and "int4_budget_bytes" not in rec.metrics:
            log(f"[quantize-{precision}] {INT4_DEFAULT_NOTE}")
        kv_cache = ""
        if opts.kv_cache == "int8" and variant == "fused":  # the shipped graph's own K/V ranges set its scales
            from export import kv_int8

            qdir, rec = stage(f"kv-int8-{precision}", {"quantize": rec.finished, "calibration": opts.calibration,
                                                       "texts": kv_int8.CALIBRATION_TEXTS},
                              lambda d, s=qdir: kv_int8.run(s, hf_dir, d, opts.calibration, opts.threads))
            records.append(rec)
            kv_cache = "int8"
        stamps[precision] = rec.finished
        engines.append(package.EngineArtifact(precision, qdir, precision, variant=variant, kv_cache=kv_cache))
        if (qdir / quantize.ABLATION).is_dir():
            report_only.append(package.EngineArtifact(f"{precision}-{quantize.ABLATION}", qdir / quantize.ABLATION, precision,
                                                       report_only=True))

    draft = None
    if opts.draft is not None:
        draft = _draft_stages(stage, opts, hf_dir, shipped_from, engines, stamps, eopts, work, log)
        records += draft.records
    golden: list[dict] = []
    extra: dict[str, Path] = {}
    if not opts.skip_eval:
        golden, extra = evaluate_stage(stage, opts, hf_dir, lineage + engines + report_only, engines, records)
    return _package(opts, hf_dir, engines, records, golden, extra, draft, work, verbose, log)


def evaluate_stage(stage, opts: BuildOptions, hf_dir: Path, measured: list, engines: list, records: list,
                   reference_logits=None, reference_params: dict | None = None) -> tuple[list[dict], dict[str, Path]]:
    """The evaluate stage over `measured` (appended to `records`; each shipped engine's quality recorded on it):
    (golden answers, report files). `reference_logits`: the streaming build's fp32 reference (export/evaluate.py)."""
    from export import evaluate

    evopts = evaluate.EvalOptions(samples=opts.eval_samples, data=opts.calibration, threads=opts.threads,
                                  max_context=opts.max_context)
    stage_info = {r.name: r.metrics for r in records if r.name in ("prune", "teacher-answers", "distill")}
    params = dataclasses.asdict(evopts) | {"engines": [e.name for e in measured],
                                           "inputs": [r.finished for r in records]} | (reference_params or {})
    edir, rec = stage("evaluate", params, lambda d: evaluate.run(hf_dir, measured, d, evopts, stages=stage_info,
                                                                 reference_logits=reference_logits))
    records.append(rec)
    results = rec.metrics
    for e in engines:  # what the evaluate stage cost per engine stays in its stage record
        e.quality.update({k: v for k, v in results["engines"].get(e.name, {}).items() if k != "timing"})
    extra = {p.name: p for p in sorted(edir.iterdir()) if p.suffix in (".png", ".html", ".md")}
    return results.get("golden", []), {f"report/{k}": v for k, v in extra.items()}


def _package(opts: BuildOptions, hf_dir: Path, engines: list, records: list, golden: list, extra: dict, draft,
             work: Path, verbose: bool, log) -> Bundle:
    from export import package
    from export.stages import guarded

    with guarded("package", work / "package.log.txt", verbose, progress=False) as mem:
        bundle = package.run(hf_dir, engines, records, opts.output, opts.max_context, golden, extra, draft)
    log(f"[package] bundle {bundle.manifest.bundle_id} verified and written to {bundle.root} "
        f"(peak memory {fmt_bytes(mem.peak_bytes)})")
    log(summary(records, bundle))
    for r in next((x.metrics.get("golden_regressions", []) for x in records if x.name == "evaluate"), []):
        log(f"golden: {r['engine']} fails \"{r['prompt']}\" (fp32 passes): {r['why']}")
    return bundle


def _distill_stages(stage, teacher_dir: Path, student_dir: Path, after: dict, teacher_key: dict,
                    dopts: DistillOptions, threads: int | None, ckpt: Path, log, prefix: str = "") -> tuple[Path, list[StageRecord]]:
    """The teacher's own answers (when the mixture has a teacher share), then distillation of the pruned
    student toward the teacher. `after`/`teacher_key`: the stages the student and the teacher come from (their
    reuse keys); `prefix`: "draft-" for the draft's stages. Returns the distilled folder and the records."""
    from export import distill

    records: list[StageRecord] = []
    answers, inputs = None, dict(after)
    if dopts.teacher_answers and dopts.mixture.get("teacher"):
        from export import teacher_answers

        aopts = teacher_answers.AnswerOptions(count=dopts.teacher_answers, seed=dopts.seed, data=dopts.data,
                                              prompts=dopts.teacher_prompts, max_tokens=dopts.answer_tokens)
        a_dir, arec = stage(f"{prefix}teacher-answers", dataclasses.asdict(aopts) | teacher_key,
                            lambda d: teacher_answers.run(teacher_dir, d, aopts, threads))
        records.append(arec)
        log(f"[{prefix}teacher-answers] {arec.metrics['kept']} of {arec.metrics['asked']} answers kept "
            f"({arec.metrics['answer_tokens']} tokens)")
        answers, inputs = a_dir / teacher_answers.ANSWERS, inputs | {"answers": arec.finished}
    # the checkpoint is resumed only by a run of the same student and teacher's answers (its own check covers
    # the options): a rebuild after a new prune or new answers must not load another student's weights
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
    out_dir, rec = stage(f"{prefix}distill", dataclasses.asdict(dopts) | inputs,
                         lambda d: distill.run(teacher_dir, student_dir, d, dopts, ckpt_dir=ckpt / key, answers=answers))
    records.append(rec)
    if not rec.metrics.get("stopped_early"):  # finished: nothing left to resume (a cut-short run keeps it)
        shutil.rmtree(ckpt, ignore_errors=True)
    log(f"[{prefix}distill] {rec.metrics['steps']} steps, {rec.metrics['tokens_seen']} tokens "
        f"({rec.metrics.get('text', 'chat text')}), loss {rec.metrics['loss_first']:.3f} -> "
        f"{rec.metrics['loss_last']:.3f}")
    if rec.metrics.get("stopped_early"):
        log(f"[{prefix}distill] WARNING: {rec.metrics['stopped_early']}")
    mass = rec.metrics.get("teacher_topk_mass")
    if mass is not None and mass < 0.8:
        log(f"[{prefix}distill] warning: the teacher's top {dopts.teacher_topk} tokens held only {100 * mass:.0f}% of its "
            f"mass at temperature {dopts.temperature}; the rest went into one bucket. Raise teacher_topk or "
            "lower temperature (at T=1 SmolLM2's top 64 hold ~94%)")
    return out_dir, records


def _quantize_options(opts: BuildOptions, precision: str, nearest: bool = False):
    """The build's options for one precision's quantize stage. `nearest` (a draft's): round to nearest, no int4
    budget and no GPTQ settings (so they are not in its stage key): a draft's quality shows in its acceptance,
    not worth GPTQ's minutes (or its plain graph)."""
    from export import quantize

    extra: dict = {}
    if precision in (INT4_WEIGHT, INT4_QDQ):  # int4-qdq: the int4 engine's rounding, block and budget (trt_formats.py)
        extra = {"int4_rounding": "minmax" if nearest else opts.int4_rounding, "int4_block_size": opts.int4_block_size}
        if precision == INT4_WEIGHT:
            extra["int4_lm_head_bits"] = opts.int4_lm_head_bits
            if not nearest:  # a draft keeps the fast kernel: float activations decode 15x slower on CPU
                extra["accuracy_level"] = INT4_ACTIVATIONS[opts.int4_activations]
        if not nearest:
            extra |= {"int4_budget_mb": opts.int4_budget_mb, "int4_extra_ratio": opts.int4_extra_ratio,
                      "int4_gptq_damp": opts.int4_gptq_damp}
    elif precision in (INT8_DYNAMIC, INT8_QDQ, FP8):  # int8-qdq: on the smoothed inputs; fp8-qdq: on the E4M3 grid
        extra = {"int8_rounding": "minmax" if nearest else opts.int8_rounding}
        if precision == INT8_QDQ and opts.smoothquant_ablation:
            extra["smoothquant_ablation"] = True
        if precision in (INT8_QDQ, FP8):
            extra |= {"qdq_float_ratio": opts.qdq_float_ratio, "qdq_float_kl": opts.qdq_float_kl}
    if not nearest:
        extra["gptq_samples"] = opts.gptq_samples
        if opts.sensitivity_samples != quantize.QuantizeOptions.sensitivity_samples:  # the default: not in the stage key
            extra["sensitivity_samples"] = opts.sensitivity_samples
        if tuple(opts.gptq_domains) != ("chat", "news"):  # the default stays out of the stage key (no rebuilds)
            extra |= {"gptq_domains": tuple(opts.gptq_domains), "gptq_chat_share": 1 / len(opts.gptq_domains)}
    return quantize.QuantizeOptions(mode=precision, calibration=opts.calibration, samples=opts.calibration_samples,
                                    smoothquant_alpha=opts.smoothquant_alpha, **extra)


def _draft_stages(stage, opts: BuildOptions, target_dir: Path, target_from: str, engines: list, stamps: dict,
                  eopts, work: Path, log):
    """Prune the shipped model to the draft's blocks, distill it on the model's own answers, export the fused
    graph, quantize, package it as a bundle of its own and measure its acceptance against the target's engine."""
    from export import draft as dm, onnx_export, package, prune, quantize

    d = opts.draft
    popts = d.prune_options(dm.target_layers(target_dir))
    p_dir, prec = stage("draft-prune", dataclasses.asdict(popts) | {"target": target_from},
                        lambda dst: prune.run(target_dir, dst, popts))
    log(f"[draft-prune] {prune.describe(prec.metrics)}")
    d_hf, recs = _distill_stages(stage, target_dir, p_dir, {"prune": prec.finished}, {"target": target_from}, d.distill,
                                 opts.threads, work / ".draft-distill-checkpoint", log, prefix="draft-")
    e_dir, erec = stage("draft-export", dataclasses.asdict(eopts) | {"model": recs[-1].finished},
                        lambda dst: onnx_export.run(d_hf, dst, eopts))
    fused = e_dir / onnx_export.FUSED_DIR
    if not (fused / "model.onnx").is_file():
        raise RecipeError(f"the draft has no fused graph ({erec.metrics.get('fused', {}).get('reason', 'not written')}): "
                          "it could not roll back its cache; build without --draft")
    records = [prec, *recs, erec]
    graph, ids = fused, None
    if 0 < d.head_tokens < dm.vocab_size(d_hf):
        graph, hrec = stage("draft-head", {"head_tokens": d.head_tokens, "calibration": opts.calibration,
                                           "export": erec.finished},
                            lambda dst: dm.cut_head(fused, dst, d_hf, d.head_tokens, opts.calibration))
        records.append(hrec)
        ids = graph / dm.HEAD_IDS
        log(f"[draft-head] LM head cut to {hrec.metrics['head_tokens']} of {hrec.metrics['vocab']} tokens "
            f"({100 * hrec.metrics['chat_token_coverage']:.1f}% of the chat data's tokens)")
    qopts = _quantize_options(opts, d.precision, nearest=True)
    q_dir, qrec = stage(f"draft-quantize-{d.precision}", dataclasses.asdict(qopts) | {"graph": records[-1].finished},
                        lambda dst: quantize.run(graph, d_hf, dst, qopts))
    records.append(qrec)
    draft_root = work / "draft.bundle"
    package.run(d_hf, [package.EngineArtifact(d.precision, q_dir, d.precision, variant="fused", logit_ids=ids)],
                records, draft_root, opts.max_context)
    target = next(e for p in dm.PRECISIONS for e in engines if e.precision == p and e.variant == "fused")  # checked
    aparams = dataclasses.asdict(d) | {"draft": qrec.finished, "target_engine": target.name, "target": stamps[target.name],
                                       "data": opts.calibration}
    arec_dir, arec = stage("draft-acceptance", aparams,
                           lambda dst: dm.measure(target.folder / "model.onnx", target.variant, target_dir, draft_root, dst, d,
                                                  opts.max_context, opts.threads, opts.calibration,
                                                  target_kv_cache=target.kv_cache))
    log(f"[draft] {dm.describe(arec.metrics)}")
    if (arec.metrics.get("speedup_here") or 0) < 1:
        log(f"[draft] WARNING: drafting was slower than plain decoding here ({arec.metrics['speedup_here']:.2f}x at "
            f"k={d.k}): edge-chat's pacing keeps the cost to a few tries per answer, --no-draft turns it off; a draft "
            "pays when more of its tokens are kept (more layers, longer distillation: docs/speed.md)")
    return package.DraftArtifact(draft_root, d.precision, target.name, records + [arec], arec.metrics)


def summary(records: list[StageRecord], bundle: Bundle) -> str:
    """The table a build ends with: each stage's time, peak memory and output; each engine's size and quality."""
    from export.console import fmt_seconds, table

    rows = []
    for r in records:
        out = bundle.root.with_name(bundle.root.name + ".work") / r.name
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else None
        rows.append([r.name, fmt_seconds(r.seconds), fmt_bytes(r.memory.get("peak_rss_bytes")), fmt_bytes(size)])
    text = "\n" + table(rows, ["stage", "time", "peak memory", "output"])
    erows = []
    for e in bundle.manifest.engines:
        q = e.quality
        size = bundle.manifest.engine_bytes(e.name)
        kl, d = q.get("kl_to_fp32"), q.get("perplexity_delta_pct")
        erows.append([e.name, fmt_bytes(size), "-" if kl is None else f"{kl:.4f}", "-" if d is None else f"{d:+.2f}%",
                      q.get("golden_passed", "-"), "-" if "decode_tok_s" not in q else f"{q['decode_tok_s']:.0f}"])
    text += "\n\n" + table(erows, ["engine", "size", "KL to fp32", "perplexity", "golden", "decode tok/s"])
    return text
