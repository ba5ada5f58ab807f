"""One prepared check for a machine with an NVIDIA GPU (scripts/gpu_check.sh runs it): what no CPU test shows.

1. ONNX Runtime CUDA EP decode of the bundle's fp32, fp16 and int8 graphs: greedy tokens against the same
   graph on CPU, and tokens/s on both (the fp16 graph's fp16 kernels run only here: ONNX Runtime CPU computes
   its MatMuls in fp32);
2. one distillation step with AMP on CUDA (bf16 where the GPU has it, else fp16 + GradScaler, as
   export.distill chooses) against the same step in fp32 on CPU: loss and gradient norm;
3. if TensorRT imports: build fp16 (from the bundle's fp16 graph, strongly typed) and int8-qdq engines into a
   copy of the bundle (edge.backends.tensorrt.builder) and decode with TensorRTDecoder, greedy tokens against ONNX
   Runtime CPU, tokens/s.

Writes one JSON (schema `SCHEMA`, checked by `validate`); on a machine without a GPU every CUDA part says
{"status": "no GPU", "reason": ...} and the file is still written (tests/test_gpu_check.py checks that).
Bundle: --bundle PATH, else a tiny random-init model is built (needs the export extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SCHEMA = "edgechat-gpu-check/1"
PROMPTS = ["What is the capital of Japan?", "Tell me a fun fact about octopuses.", "Hello! How are you today?"]
STATUSES = ("ok", "no GPU", "no TensorRT", "error", "skipped")


def _part(status: str, reason: str = "", **data) -> dict:
    return {"status": status, "reason": reason, **data}


def _error(e: BaseException) -> dict:
    return _part("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                 traceback=traceback.format_exc(limit=6))


def machine() -> dict:
    from edge.device.machine import detect

    m = detect()
    return {k: getattr(m, k) for k in ("arch", "gpu_name", "gpu_sm", "gpu_error", "tensorrt", "cuda", "cuda_bindings",
                                       "onnxruntime", "ort_providers", "profile")}


def _decode(gen, new_tokens: int) -> dict:
    from edge.decode.sampling import SamplingConfig

    cfg = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    tokens, n, seconds = [], 0, 0.0
    for p in PROMPTS:
        ids = gen.tokenizer.encode_chat([{"role": "user", "content": p}])
        t0 = time.perf_counter()
        out = gen.complete(ids, cfg)[1].token_ids
        seconds += time.perf_counter() - t0
        tokens.append(out)
        n += len(out)
    return {"tokens": tokens, "tok_s": round(n / seconds, 1) if seconds else None}


def _parity(ref: list[list[int]], got: list[list[int]]) -> dict:
    first = []
    for a, b in zip(ref, got):
        first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if a == b else min(len(a), len(b))))
    return {"identical_prompts": sum(f is None for f in first), "prompts": len(ref), "first_difference": first}


def ort_cuda(bundle_path: Path, new_tokens: int) -> dict:
    import onnxruntime as ort

    from edge.bundle import Bundle
    from edge.decode.generate import Generator

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return _part("no GPU", f"onnxruntime {ort.__version__} has {ort.get_available_providers()} "
                               "(install onnxruntime-gpu instead of onnxruntime)")
    bundle = Bundle.open(bundle_path)
    names = [e.name for e in bundle.manifest.engines if e.fingerprint.format == "onnx"
             and e.fingerprint.precision in ("fp32", "fp16", "int8-dynamic", "int8-qdq")]
    engines = {}
    for name in names:
        try:
            cpu = Generator.from_bundle(bundle, engine=name, providers=["CPUExecutionProvider"])
            gpu = Generator.from_bundle(bundle, engine=name, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
            if gpu.decoder.device != "cuda":
                engines[name] = _part("no GPU", f"ONNX Runtime ran {name} on {gpu.decoder.providers}")
                continue
            a, b = _decode(cpu, new_tokens), _decode(gpu, new_tokens)
            engines[name] = _part("ok", tok_s_cpu=a["tok_s"], tok_s_gpu=b["tok_s"],
                                  providers=gpu.decoder.providers, parity=_parity(a["tokens"], b["tokens"]))
        except Exception as e:  # noqa: BLE001  one engine failing is a result, not the end of the check
            engines[name] = _error(e)
    return _part("ok" if any(v["status"] == "ok" for v in engines.values()) else "error",
                 "" if engines else "no fp32/int8 ONNX graph in the bundle", engines=engines)


def distill_amp(model_dir: Path | None) -> dict:
    try:
        import torch
    except ImportError:
        return _part("skipped", "torch is not installed (pip install -e '.[export]')")
    if not torch.cuda.is_available():
        return _part("no GPU", f"torch {torch.__version__} sees no CUDA GPU")
    if model_dir is None:
        return _part("skipped", "no tiny model (a --bundle was given; the step needs the Hugging Face checkpoint)")
    from transformers import AutoModelForCausalLM

    from export.distill import DistillOptions, _amp, kd_loss

    torch.manual_seed(0)
    ids = torch.randint(3, 300, (2, 64))
    results = {}
    for device in ("cpu", "cuda"):
        student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
        with torch.no_grad():
            for p in teacher.parameters():  # a teacher that differs: the KL is not zero
                p.add_(0.02 * torch.randn_like(p))
        amp_dtype, scaler = _amp(DistillOptions(), device) if device == "cuda" else (None, None)
        x = ids.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type=device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            s = student(x).logits
            with torch.no_grad():
                t = teacher(x).logits
        loss = kd_loss(s, t, 2.0)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(torch.optim.SGD(student.parameters(), lr=0.0))
        grad = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in student.parameters() if p.grad is not None))
        if device == "cuda":
            torch.cuda.synchronize()
        results[device] = {"loss": float(loss), "grad_norm": float(grad), "seconds": round(time.perf_counter() - t0, 3),
                           "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "off"}
    c, g = results["cpu"], results["cuda"]
    return _part("ok", cpu=c, cuda=g, gpu=torch.cuda.get_device_name(0),
                 loss_rel_diff=abs(g["loss"] - c["loss"]) / max(abs(c["loss"]), 1e-12),
                 grad_norm_rel_diff=abs(g["grad_norm"] - c["grad_norm"]) / max(abs(c["grad_norm"]), 1e-12))


def tensorrt_part(bundle_path: Path, new_tokens: int, work: Path) -> dict:
    import importlib.util

    from edge.device.machine import detect

    here = detect()
    if not here.has_gpu:
        return _part("no GPU", here.gpu_error or "no GPU found")
    if importlib.util.find_spec("tensorrt") is None or not here.tensorrt:
        return _part("no TensorRT", "tensorrt does not import here (pip install tensorrt, or JetPack's python3-libnvinfer)")
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.backends.tensorrt.builder import build_engine, plan_build
    from edge.backends.tensorrt.runtime import TensorRTDecoder

    # a GPU EdgeChat has no profile for (an H100/H200, an A100) is planned with the L4's limits; the engine's
    # fingerprint still records this GPU's own SM
    profile = here.profile or {"7.5": "t4", "8.7": "orin-nano-8gb"}.get(str(here.gpu_sm), "l4")
    copy = work / "trt.bundle"
    shutil.copytree(bundle_path, copy, dirs_exist_ok=True)
    bundle = Bundle.open(copy)
    engines = {}
    for precision in ("fp16", "int8-qdq"):
        try:
            t0 = time.perf_counter()
            entry = build_engine(plan_build(bundle, profile, precision, tensorrt_version=here.tensorrt), here)
            build_s = round(time.perf_counter() - t0, 1)
            bundle = Bundle.open(copy)
            source = entry.quality["built_from"]
            cpu = Generator.from_bundle(bundle, engine=source, providers=["CPUExecutionProvider"])
            trt = Generator(cpu.tokenizer, TensorRTDecoder.from_entry(bundle, entry), bundle.manifest.generation, bundle)
            a, b = _decode(cpu, new_tokens), _decode(trt, new_tokens)
            engines[entry.name] = _part("ok", built_from=source, build_s=build_s, tok_s_cpu=a["tok_s"],
                                        tok_s_gpu=b["tok_s"], parity=_parity(a["tokens"], b["tokens"]))
        except Exception as e:  # noqa: BLE001
            engines[f"trt-{precision}"] = _error(e)
    return _part("ok" if any(v["status"] == "ok" for v in engines.values()) else "error",
                 tensorrt=here.tensorrt, profile=profile, profile_is_this_gpu=profile == here.profile, engines=engines)


def tiny_bundle(work: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_model

    from export.recipe import BuildOptions, build

    model = make_tiny_model(work / "tiny-llama", hidden=256, heads=4, kv_heads=2, intermediate=768, layers=4)
    out = work / "tiny.bundle"
    build(BuildOptions(output=out, model=str(model), precisions=("fp32", "fp16", "int8-dynamic", "int8-qdq"),
                       max_context=256, eval_samples=2, calibration_samples=4), log=lambda s: None)
    return out, model


def validate(report: dict) -> list[str]:
    """What is wrong with a report, against SCHEMA (empty: valid)."""
    problems = []
    for key, kind in (("schema", str), ("date", str), ("seconds", (int, float)), ("machine", dict), ("bundle", str),
                      ("ort_cuda", dict), ("distill_amp", dict), ("tensorrt", dict)):
        if not isinstance(report.get(key), kind):
            problems.append(f"'{key}' missing or not {kind}")
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, not {SCHEMA!r}")
    for part in ("ort_cuda", "distill_amp", "tensorrt"):
        p = report.get(part) or {}
        if p.get("status") not in STATUSES or not isinstance(p.get("reason"), str):
            problems.append(f"{part}: status {p.get('status')!r} / reason {p.get('reason')!r}")
        for name, e in (p.get("engines") or {}).items():
            if e.get("status") not in STATUSES:
                problems.append(f"{part}.{name}: status {e.get('status')!r}")
            if e.get("status") == "ok":
                par = e.get("parity") or {}
                if not {"identical_prompts", "prompts", "first_difference"} <= set(par) or \
                        not all(isinstance(e.get(k), (int, float)) for k in ("tok_s_cpu", "tok_s_gpu")):
                    problems.append(f"{part}.{name}: an 'ok' engine needs parity and tok_s_cpu/tok_s_gpu")
    d = report.get("distill_amp") or {}
    if d.get("status") == "ok" and not all(k in d for k in ("cpu", "cuda", "loss_rel_diff", "grad_norm_rel_diff")):
        problems.append("distill_amp: an 'ok' step needs cpu, cuda, loss_rel_diff, grad_norm_rel_diff")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="bundle to check (default: build a tiny random-init one)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="edgechat-gpu-check-"))
    report: dict = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        report["machine"] = machine()
        model = None
        if args.bundle:
            bundle = args.bundle
        else:
            bundle, model = tiny_bundle(work)
        report["bundle"] = str(bundle) if args.bundle else "tiny random-init model (built in a temp folder, removed)"
        for key, fn in (("ort_cuda", lambda: ort_cuda(bundle, args.new_tokens)), ("distill_amp", lambda: distill_amp(model)),
                        ("tensorrt", lambda: tensorrt_part(bundle, args.new_tokens, work))):
            try:
                report[key] = fn()
            except Exception as e:  # noqa: BLE001
                report[key] = _error(e)
            print(f"{key:12s} {report[key]['status']}  {report[key]['reason']}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        report["seconds"] = round(time.time() - t0, 1)
        args.out.write_text(json.dumps(report, indent=2))
    problems = validate(report)
    for p in problems:
        print(f"schema: {p}", file=sys.stderr)
    print(f"wrote {args.out} in {report['seconds']} s", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
