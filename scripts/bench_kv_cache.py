#!/usr/bin/env python
"""The 8-bit KV cache against the float cache it replaces, on one bundle built with --kv-cache int8.

The reference is the same engine with a float32 cache (export.kv_int8.float_twin: same weights, same nodes; what
the build writes without the flag), so only the cache differs. Measured:

- KV bytes per token: the cache buffers the runtime allocates, per token of capacity.
- KL(float || int8) of the next-token distribution on held-out prose (gensim's Lee corpus, "eval" split, never
  used to calibrate): each prompt of L tokens is prefilled but for its last `--tail` tokens, which are then fed
  one decode step at a time (every step reads the int8 cache), and the distributions compared at each.
- Decode tok/s at `--context` tokens of context: `--steps` single-token steps after the same prefill, rounds
  interleaved A B A B so a neighbour's load hits both; median and min-max per cache, and the median of the
  per-round ratios.
- What the design passed over costs: dequantizing a per-token-scaled int8 cache of `--context` tokens to float32
  with numpy before each step (GroupQueryAttention takes only static scales, so a per-token cache would be
  dequantized outside the op, every step).

Prints a table and writes JSON (docs/bench/ by default).

  .venv/bin/python scripts/bench_kv_cache.py smollm2-kv8.bundle
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def tail_logits(dec, ids: list[int], tail: int) -> np.ndarray:
    """Logits at the last `tail` positions, each from a decode step on the cache the prefill left."""
    cache = dec.new_cache(1, len(ids))
    dec.prefill(ids[:-tail], cache)
    return np.stack([dec.forward(np.array([[t]]), cache)[0] for t in ids[-tail:]])


def decode_rate(dec, cache, start: int, steps: int) -> float:
    """Tokens/s of `steps` single-token steps from `start` cached tokens (the cache is rewound each time)."""
    cache.length = start
    t = time.perf_counter()
    for i in range(steps):
        dec.forward(np.array([[100 + i]]), cache)
    return steps / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--engine", default="int8-dynamic")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4000])
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per length")
    ap.add_argument("--tail", type=int, default=32, help="decode steps compared per prompt")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-only", action="store_true", help="skip the KL part")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from tokenizers import Tokenizer

    from edge.backends.onnxruntime import OrtDecoder
    from edge.bundle import Bundle
    from edge.device.probe import cpu_name
    from edge.io_contract import DecoderIO
    from export.kv_int8 import float_twin
    from export.prose import prose_texts

    load0 = os.getloadavg()
    bundle = Bundle.open(a.bundle)
    m = bundle.manifest
    entry = m.engine(a.engine)
    io = DecoderIO.from_dict(m.engine_io(entry))
    if not io.kv_int8:
        sys.exit(f"{a.bundle}'s {a.engine} has no int8 KV cache: build it with edge-export build --kv-cache int8")
    longest = max(a.lengths + [a.context + a.steps])
    dims = dataclasses.replace(m.model, max_context=longest)  # past the bundle's context: the graph's rotary tables allow it
    twin_dir = Path(tempfile.mkdtemp(prefix="kv-float-"))
    float_twin(bundle.path(entry.file).parent, twin_dir, io)
    float_io = dataclasses.replace(io, kv_cache="", kv_scale_key="", kv_scale_value="")
    decs = {"float": OrtDecoder(twin_dir / "model.onnx", dims, float_io, threads=a.threads),
            "int8": OrtDecoder(bundle.path(entry.file), dims, io, threads=a.threads)}
    per_token = {k: sum(x.nbytes for x in d.new_cache(1, 64).arrays) / 64 for k, d in decs.items()}

    tok = Tokenizer.from_file(str(bundle.path("tokenizer.json")))
    stream: list[int] = []
    for doc in prose_texts("eval"):
        stream += tok.encode(doc + "\n\n").ids
    quality = []
    for length in [] if a.speed_only else a.lengths:
        kls, top1 = [], []
        for p in range(a.prompts):
            start = (p * length) % max(1, len(stream) - length)
            ids = stream[start:start + length]
            ref, got = (tail_logits(decs[k], ids, a.tail) for k in ("float", "int8"))
            lp, lq = log_softmax(ref), log_softmax(got)
            kls += list((np.exp(lp) * (lp - lq)).sum(-1))
            top1 += list(ref.argmax(-1) == got.argmax(-1))
        quality.append({"prompt_tokens": length, "prompts": a.prompts, "positions": len(kls),
                        "kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)), "top1_agree": float(np.mean(top1))})
        print(f"KL at {length} tokens: mean {quality[-1]['kl_mean']:.4f}, max {quality[-1]['kl_max']:.4f}, "
              f"top-1 {quality[-1]['top1_agree']:.3f}", flush=True)

    ctx_ids = (stream * 2)[: a.context]
    caches = {}
    for k, d in decs.items():
        caches[k] = d.new_cache(1, a.context + a.steps)
        d.prefill(ctx_ids, caches[k])
        decode_rate(d, caches[k], a.context, 4)  # warm-up
    rates: dict[str, list[float]] = {"float": [], "int8": []}
    for _ in range(a.rounds):
        for k in ("float", "int8"):
            rates[k].append(decode_rate(decs[k], caches[k], a.context, a.steps))
    ratios = [b / f for f, b in zip(rates["float"], rates["int8"])]

    L, H, D = m.model.num_layers, m.model.num_kv_heads, m.model.head_dim
    q = [np.random.default_rng(i).integers(-127, 128, (1, H, a.context, D), dtype=np.int8) for i in range(2 * L)]
    s = [np.random.default_rng(i).random((1, H, a.context, 1), dtype=np.float32) for i in range(2 * L)]
    deq = []
    for _ in range(5):
        t = time.perf_counter()
        for x, sc in zip(q, s):
            np.multiply(x, sc, dtype=np.float32)
        deq.append(time.perf_counter() - t)

    def spread(v: list[float]) -> dict:
        return {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}

    result = {
        "what": "8-bit KV cache (GroupQueryAttention int8, per-channel static scales) vs the same engine's float32 cache",
        "bundle": m.bundle_id, "engine": a.engine, "model": m.model_name, "threads": a.threads,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.platform()}",
        "load_average_before": load0, "load_average_after": os.getloadavg(),
        "command": " ".join(["scripts/bench_kv_cache.py", *sys.argv[1:]]),
        "kv_bytes_per_token": per_token, "kl": quality,
        "kl_mean_all": float(np.mean([r["kl_mean"] for r in quality])) if quality else None,
        "niceness": os.nice(0),
        "decode_tok_s": {"context": a.context, "steps": a.steps, "float": spread(rates["float"]),
                         "int8": spread(rates["int8"]), "int8_over_float": spread(ratios)},
        "dequantize_per_token_cache_ms": {"context": a.context, **spread([x * 1000 for x in deq])},
    }
    print(f"\n{'':28}{'float32 cache':>16}{'int8 cache':>16}")
    print(f"{'KV bytes per token':28}{per_token['float']:>16,.0f}{per_token['int8']:>16,.0f}")
    print(f"{'decode tok/s at ' + str(a.context):28}"
          + "".join(f"{statistics.median(rates[k]):>9.1f} ({min(rates[k]):.0f}-{max(rates[k]):.0f})" for k in ("float", "int8")))
    print(f"int8 / float per round: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    for r in quality:
        print(f"KL(float || int8) at {r['prompt_tokens']:>5} tokens: mean {r['kl_mean']:.4f} max {r['kl_max']:.4f} "
              f"top-1 agree {r['top1_agree']:.3f} ({r['positions']} positions)")
    print(f"dequantizing a per-token int8 cache of {a.context} tokens with numpy: {statistics.median(deq) * 1000:.1f} ms "
          "per step (the design not taken)")
    print(f"load average before {load0[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    out = a.out or ROOT / "docs" / "bench" / f"kv-cache-int8-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
