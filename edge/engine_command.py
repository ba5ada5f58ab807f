"""`edge-chat build-engine` (on the device) and `edge-export engines` (workstation T4/L4): one command, two CLIs."""

from __future__ import annotations

import argparse

from edge import precisions
from edge.args import Bounded
from edge.errors import EdgeChatError


def build_engine_command(args: argparse.Namespace, profile: str) -> int:
    """Shared by `edge-chat build-engine` (on the device) and `edge-export engines` (workstation T4/L4)."""
    import json

    from edge.bundle import Bundle
    from edge.device.machine import detect
    from edge.backends.tensorrt.builder import build_engine, plan_build
    from edge.decode.golden import engine_recheck

    here = detect()
    bundle = Bundle.open(args.bundle, verify="full")
    plan = plan_build(bundle, profile, args.precision, tensorrt_version=args.tensorrt or here.tensorrt,
                      max_batch=args.max_batch, max_context=args.max_context,
                      optimization_level=args.optimization_level, version_compatible=args.version_compatible)
    s = plan.settings
    print(f"engine   {plan.engine_name} for {plan.profile.display_name} from {plan.source.file}, TensorRT "
          f"{plan.tensorrt_version}{' (strongly typed)' if s.strongly_typed else ''}, flags {', '.join(s.flags) or '-'}")
    print(f"shapes   batch <= {s.max_batch}, context <= {s.max_context}; workspace {s.workspace_bytes >> 20} MiB; "
          f"build needs ~{plan.ram_needed_gb:.1f} GB host RAM"
          + (f" of {plan.ram_available_gb:.1f} GB available" if plan.ram_available_gb else ""))
    if args.dry_run:
        print(json.dumps(plan.summary(), indent=2))
        return 0
    if here.has_gpu and str(here.gpu_sm) != s.gpu_sm:
        raise EdgeChatError(f"this GPU is SM {here.gpu_sm} ({here.gpu_name}) but {plan.profile.display_name} is SM "
                            f"{s.gpu_sm}: an engine runs only on the GPU architecture it was built on; build it on "
                            "the target (or pick the profile of this GPU)")
    entry = build_engine(plan, here, recheck=engine_recheck(bundle, plan.source.name))
    q = entry.quality
    print(f"built    {entry.file} in {q.get('build_seconds')} s; golden answers same as {q.get('built_from')}: "
          f"{q.get('golden_same_as_source', '?')}, passed {q.get('golden_passed', '?')}")
    return 0


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder (the engine is added to it)")
    p.add_argument("--precision", default=precisions.FP16, choices=precisions.TENSORRT,
                   help="fp16 (from the fp32 graph) or int8-qdq (the SmoothQuant Q/DQ graph)")
    p.add_argument("--max-context", type=Bounded(int, 1), help="longest sequence the engine takes (default: the profile's)")
    p.add_argument("--max-batch", type=Bounded(int, 1), help="most sequences decoded together (default: the profile's)")
    p.add_argument("--optimization-level", type=Bounded(int, 0, 5), default=3, help="TensorRT builder optimization level 0-5")
    p.add_argument("--version-compatible", action="store_true",
                   help="engine that also runs on later TensorRT of the same major version (a little slower)")
    p.add_argument("--tensorrt", help="TensorRT version to plan for (default: the installed one)")
    p.add_argument("--dry-run", action="store_true", help="print the builder settings and stop")


