"""The build recipe: which stages run, with which options, chained artifact to artifact.

A recipe is a small TOML file; CLI flags override it. Each stage runs into
`OUT.work/<stage>/` and is reused when its params have not changed, so an
interrupted build resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edge.bundle import Bundle, StageRecord
from edge.errors import RecipeError

BUILD_PRECISIONS = ("fp32", "int8-dynamic", "int8-qdq", "int4-weight")


@dataclass(frozen=True)
class BuildOptions:
    output: Path
    model: str = "default"
    precisions: tuple[str, ...] = ("fp32", "int8-dynamic")
    max_context: int = 2048
    opset: int = 17
    parity_atol: float = 1e-3
    calibration: str | None = None
    calibration_samples: int = 64
    smoothquant_alpha: float = 0.5
    eval_samples: int = 64
    skip_eval: bool = False
    fresh: bool = False
    online: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        bad = [p for p in self.precisions if p not in BUILD_PRECISIONS]
        if bad:
            raise RecipeError(f"unknown precision {bad[0]!r}: choose from {', '.join(BUILD_PRECISIONS)}")
        if "fp32" not in self.precisions:
            object.__setattr__(self, "precisions", ("fp32", *self.precisions))  # the reference everything is measured against
        if self.max_context < 64:
            raise RecipeError(f"max_context must be >= 64, got {self.max_context}")
        if not 0 <= self.smoothquant_alpha <= 1:
            raise RecipeError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")

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
                    fresh=a.fresh or None, online=a.online or None)
        if a.recipe:
            return cls.from_toml(a.recipe, **over)
        return cls(**{k: (Path(v) if k == "output" else v) for k, v in over.items() if v is not None})


def build(opts: BuildOptions, log=print) -> Bundle:
    """load -> export (+parity) -> quantize per precision -> evaluate -> package."""
    from export import load, onnx_export, package
    from export.model_source import resolve
    from export.stages import run_stage

    ref = resolve(opts.model)
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    records: list[StageRecord] = []

    hf_dir, rec = run_stage(work, "load", {"model": f"{ref.kind}:{ref.location}:{ref.gguf_file}"},
                            lambda d: load.run(ref, d, online=opts.online), opts.fresh, log)
    records.append(rec)
    eopts = onnx_export.ExportOptions(opset=opts.opset, parity_atol=opts.parity_atol)
    fp32_dir, rec = run_stage(work, "export", dataclasses.asdict(eopts), lambda d: onnx_export.run(hf_dir, d, eopts),
                              opts.fresh, log)
    records.append(rec)
    engines = [package.EngineArtifact("fp32", fp32_dir, "fp32", quality={"parity": rec.metrics})]
    report_only: list = []  # measured and shown in the report, not shipped
    exported = rec.finished  # later stages depend on this export: a new export invalidates them

    for precision in opts.precisions:
        if precision == "fp32":
            continue
        from export import quantize

        qopts = quantize.QuantizeOptions(mode=precision, calibration=opts.calibration,
                                         samples=opts.calibration_samples, smoothquant_alpha=opts.smoothquant_alpha)
        qdir, rec = run_stage(work, f"quantize-{precision}", dataclasses.asdict(qopts) | {"export": exported},
                              lambda d, q=qopts: quantize.run(fp32_dir, hf_dir, d, q), opts.fresh, log)
        records.append(rec)
        engines.append(package.EngineArtifact(precision, qdir, precision))
        if (qdir / quantize.ABLATION).is_dir():
            report_only.append(package.EngineArtifact(f"{precision}-{quantize.ABLATION}", qdir / quantize.ABLATION, precision,
                                                       report_only=True))

    golden: list[dict] = []
    extra: dict[str, Path] = {}
    if not opts.skip_eval:
        from export import evaluate

        evopts = evaluate.EvalOptions(samples=opts.eval_samples, data=opts.calibration, threads=opts.threads,
                                      max_context=opts.max_context)
        params = dataclasses.asdict(evopts) | {"engines": [e.name for e in engines + report_only],
                                               "inputs": [r.finished for r in records]}
        edir, rec = run_stage(work, "evaluate", params,
                              lambda d: evaluate.run(hf_dir, engines + report_only, d, evopts), opts.fresh, log)
        records.append(rec)
        results = rec.metrics
        for e in engines:
            e.quality.update(results["engines"].get(e.name, {}))
        golden = results.get("golden", [])
        extra = {p.name: p for p in sorted(edir.iterdir()) if p.suffix in (".png", ".html", ".md")}
        extra = {f"report/{k}": v for k, v in extra.items()}
    bundle = package.run(hf_dir, engines, records, opts.output, opts.max_context, golden, extra)
    log(f"[package] bundle {bundle.manifest.bundle_id} verified and written to {bundle.root}")
    return bundle
