#!/usr/bin/env python
"""Decode speed, side by side in one run: our runtime vs transformers generate (and
onnxruntime-genai / llama-cpp-python when installed), same model, same prompt, same threads.

Prints a table and writes JSON. Each row: TTFT, decode tok/s (median of --runs after a
warm-up, 128 greedy tokens, EOS ignored), peak RSS, and the fraction of the memory-bandwidth
roofline (measured read bandwidth / bytes of weights read per token).

  .venv/bin/python scripts/bench_decode.py smollm2.bundle
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
PROMPT = [{"role": "user", "content": "Tell me about the history of the city of Kyoto, its temples and gardens, "
                                      "and why so many people like to visit it in the autumn months."}]


def read_bandwidth_gbs(size_mb: int = 1024, reps: int = 5) -> float:
    a = np.ones(size_mb * (1 << 20) // 8, dtype=np.float64)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t))
    return best / 1e9


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))


def bench_ours(bundle_dir: str, engine: str, threads: int, new: int, runs: int) -> dict:
    from edge.bundle import Bundle
    from edge.runtime import Generator
    from export.evaluate import speed

    b = Bundle.open(bundle_dir)
    g = Generator.from_bundle(b, engine=engine, threads=threads)
    ids = g.tokenizer.encode_chat(PROMPT)
    r = speed(g.decoder, ids, new, runs)
    return r | {"prompt_tokens": len(ids), "weight_bytes": weight_bytes(b.path(b.manifest.engine(engine).file))}


def bench_transformers(hf_dir: Path, threads: int, new: int, runs: int, prompt_ids: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    x = torch.tensor([prompt_ids])
    ttfts, rates = [], []
    with torch.no_grad():
        for r in range(runs + 1):
            t0 = time.perf_counter()
            m.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.perf_counter()
            t2 = time.perf_counter()
            m.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            t3 = time.perf_counter()
            if r:
                ttfts.append(t1 - t0)
                rates.append((new - 1) / ((t3 - t2) - (t1 - t0)))
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    return {"ttft_ms": statistics.median(ttfts) * 1000, "decode_tok_s": statistics.median(rates), "weight_bytes": nbytes,
            "prompt_tokens": len(prompt_ids)}


def bench_llama_cpp(gguf: Path, threads: int, new: int, runs: int, prompt_ids: list[int]) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=threads, n_ctx=1024, verbose=False)
    ttfts, rates = [], []
    for r in range(runs + 1):
        llm.reset()
        t0 = time.perf_counter()
        n, t1 = 0, None
        for tok in llm.generate(prompt_ids, temp=0.0):
            if t1 is None:
                t1 = time.perf_counter()
            n += 1
            if n >= new:
                break
        t2 = time.perf_counter()
        if r:
            ttfts.append(t1 - t0)
            rates.append((n - 1) / (t2 - t1))
    return {"ttft_ms": statistics.median(ttfts) * 1000, "decode_tok_s": statistics.median(rates),
            "weight_bytes": gguf.stat().st_size, "prompt_tokens": len(prompt_ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--engines", nargs="*", help="bundle engines to time (default: all ONNX engines)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="bench-results/decode.json")
    a = ap.parse_args()

    from edge.bundle import Bundle
    from edge.runtime import Generator

    b = Bundle.open(a.bundle)
    engines = a.engines or [e.name for e in b.manifest.engines if e.fingerprint.format == "onnx"]
    prompt_ids = Generator.from_bundle(b, engine=engines[0], threads=a.threads).tokenizer.encode_chat(PROMPT)
    bw = read_bandwidth_gbs()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, read bandwidth {bw:.1f} GB/s; "
          f"threads {a.threads}, prompt {len(prompt_ids)} tokens, {a.new_tokens} greedy tokens, median of {a.runs}")
    rows = {}
    for e in engines:
        rows[f"edgechat {e}"] = bench_ours(a.bundle, e, a.threads, a.new_tokens, a.runs) | {"rss_mb": rss_mb()}
        print(f"  measured edgechat {e}", flush=True)
    hf_dir = Path(str(b.root) + ".work") / "load"
    if not a.no_transformers and hf_dir.is_dir():
        rows["transformers fp32 eager"] = bench_transformers(hf_dir, a.threads, a.new_tokens, a.runs, prompt_ids) | {"rss_mb": rss_mb()}
    elif not a.no_transformers:
        print(f"  (transformers row skipped: {hf_dir} not found; it is the build's load stage)")
    if importlib.util.find_spec("llama_cpp"):
        from export.model_source import default_gguf

        rows["llama.cpp Q4_1 (shipped GGUF)"] = bench_llama_cpp(default_gguf(), a.threads, a.new_tokens, a.runs, prompt_ids) | {"rss_mb": rss_mb()}
    else:
        print("  (llama.cpp row skipped: pip install llama-cpp-python)")
    if not importlib.util.find_spec("onnxruntime_genai"):
        print("  (onnxruntime-genai row skipped: pip install onnxruntime-genai)")
    ref = rows.get("transformers fp32 eager", {}).get("decode_tok_s")
    print(f"\n{'runtime':34s} {'TTFT ms':>8s} {'decode tok/s':>13s} {'vs HF':>6s} {'roofline':>9s} {'proc RSS':>9s}")
    for name, r in rows.items():
        roof = bw * 1e9 / r["weight_bytes"]
        r["roofline_tok_s"] = roof
        r["roofline_fraction"] = r["decode_tok_s"] / roof
        r["vs_transformers"] = r["decode_tok_s"] / ref if ref else None
        vs = f"{r['vs_transformers']:.2f}x" if ref else "-"
        print(f"{name:34s} {r['ttft_ms']:8.0f} {r['decode_tok_s']:13.1f} {vs:>6s} {100 * r['roofline_fraction']:8.0f}% {r['rss_mb']:8.0f}M")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpu": platform.processor(), "cores": os.cpu_count(), "read_bandwidth_gbs": bw},
                               "threads": a.threads, "new_tokens": a.new_tokens, "prompt_tokens": len(prompt_ids),
                               "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
