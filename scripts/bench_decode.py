#!/usr/bin/env python
"""Decode speed, side by side in one run: our runtime vs transformers generate, llama.cpp
(llama-cpp-python) and onnxruntime-genai when installed; same model, same prompt tokens, same threads.

Each row runs in its own process (so its peak RSS is its own and no thread pool leaks between rows):
TTFT (prefill + first token), decode tok/s (median of --runs after a warm-up, 128 greedy tokens,
EOS ignored), peak RSS, and the fraction of the memory-bandwidth roofline (measured read bandwidth /
bytes of weights read per token). Prints a table and writes JSON.

  .venv/bin/python scripts/bench_decode.py smollm2.bundle
  .venv/bin/python scripts/bench_decode.py smollm2.bundle --concurrency 8   # + the same engines through the server

llama.cpp rows: Q8_0 and Q4_0 GGUFs of the same weights, made here from the GGUF the model came from
(dequantized to F32, then quantized by llama.cpp itself; cached under ~/.cache/edgechat/gguf), plus
that GGUF as shipped. onnxruntime-genai rows: its model builder on the same HF folder (the build's
load stage). Missing runtimes are skipped with the command that installs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edge.probe import cpu_name  # noqa: E402
# 55 tokens with SmolLM2's chat template (system prompt included)
PROMPT = [{"role": "user", "content": "Tell me about the history of the city of Kyoto, its temples and gardens, "
                                      "and why so many people like to visit it in the autumn months."}]
CACHE = Path(os.environ.get("EDGECHAT_CACHE", Path.home() / ".cache" / "edgechat")) / "gguf"


def read_bandwidth_gbs(threads: int, size_mb: int = 1024, reps: int = 5) -> float:
    """Best read rate over a 1 GiB array (far past any cache), `threads` readers at once (numpy's
    reductions release the GIL), as the decoders read their weights."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(size_mb * (1 << 20) // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t))
    return best / 1e9


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike getrusage's maxrss it does not carry the parent's over exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def onnx_bytes_read_per_token(path: Path) -> int:
    """Weight bytes a decode step reads: every initializer except tables only Gathered from (one row per token)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    size = {}
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        size[t.name] = int(ext["length"]) if "length" in ext else len(t.raw_data) or t.ByteSize()
    users: dict[str, set] = {}
    for n in m.graph.node:
        for k, i in enumerate(n.input):
            if i in size:
                users.setdefault(i, set()).add((n.op_type, k))
    gathered_only = {i for i, u in users.items() if u == {("Gather", 0)} and size[i] > 1 << 20}
    return sum(v for k, v in size.items() if k not in gathered_only)


def files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))


def timed(prefill, step, new: int, runs: int) -> dict:
    """prefill() -> first token; step(tok) -> next token. Median TTFT and decode rate after one warm-up."""
    ttfts, rates = [], []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        tok = prefill()
        t1 = time.perf_counter()
        for _ in range(new - 1):
            tok = step(tok)
        t2 = time.perf_counter()
        if r:
            ttfts.append(t1 - t0)
            rates.append((new - 1) / (t2 - t1))
    return {"ttft_ms": statistics.median(ttfts) * 1000, "decode_tok_s": statistics.median(rates)}


# ----------------------------------------------------------------------------- one row each (in a child process)


def row_edgechat(spec: dict) -> dict:
    from edge.bundle import Bundle
    from edge.runtime import Generator

    b = Bundle.open(spec["bundle"])
    g = Generator.from_bundle(b, engine=spec["engine"], threads=spec["threads"])
    d, ids, new = g.decoder, spec["prompt_ids"], spec["new"]
    state = {}

    def prefill():
        state["cache"] = d.new_cache(capacity=len(ids) + new)
        return int(np.argmax(d.prefill(ids, state["cache"])[0]))

    r = timed(prefill, lambda t: int(np.argmax(d.forward(np.array([[t]]), state["cache"])[0])), new, spec["runs"])
    e = b.manifest.engine(spec["engine"])
    return r | {"weight_bytes": onnx_bytes_read_per_token(b.path(e.file)), "file_bytes": files_bytes(b.path(e.file)),
                "graph": e.fingerprint.variant, "precision": e.fingerprint.precision}


def row_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    m = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    state = {}

    @torch.no_grad()
    def prefill():
        out = m(torch.tensor([spec["prompt_ids"]]), use_cache=True)
        state["past"] = out.past_key_values
        return int(out.logits[0, -1].argmax())

    @torch.no_grad()
    def step(t):
        out = m(torch.tensor([[t]]), past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return int(out.logits[0, -1].argmax())

    r = timed(prefill, step, spec["new"], spec["runs"])
    return r | {"weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters())}


def row_llama_cpp(spec: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=512,
                n_batch=512, verbose=False)
    ids = spec["prompt_ids"]

    def prefill():
        llm.reset()
        llm.eval(ids)
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def step(t):
        llm.eval([t])
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    r = timed(prefill, step, spec["new"], spec["runs"])
    return r | {"weight_bytes": Path(spec["gguf"]).stat().st_size}


def row_genai(spec: dict) -> dict:
    import onnxruntime_genai as og

    model = og.Model(spec["model_dir"])
    ids, new = spec["prompt_ids"], spec["new"]
    state = {}

    def prefill():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new + 1, do_sample=False)
        state["g"] = og.Generator(model, params)
        state["g"].append_tokens(ids)
        state["g"].generate_next_token()
        return int(state["g"].get_next_tokens()[0])

    def step(_):
        state["g"].generate_next_token()
        return int(state["g"].get_next_tokens()[0])

    r = timed(prefill, step, new, spec["runs"])
    return r | {"weight_bytes": files_bytes(Path(spec["model_dir"]) / "model.onnx")}


ROWS = {"edgechat": row_edgechat, "transformers": row_transformers, "llama.cpp": row_llama_cpp, "genai": row_genai}


def run_row(spec: dict) -> dict:
    """Run one row in a fresh process; its own peak RSS comes back with it."""
    p = subprocess.run([sys.executable, __file__, "--_row", json.dumps(spec)], capture_output=True, text=True,
                       cwd=ROOT, timeout=3600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- competitors' model files


class quiet_stderr:
    """Silence C-level writes to fd 2 (and Python's) for a block."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def gguf_variants(src: Path) -> dict[str, Path]:
    """Q8_0 and Q4_0 of the weights in `src`, made by llama.cpp from an F32 copy (cached by source name)."""
    import ctypes

    import gguf
    import llama_cpp
    from gguf.quants import dequantize

    out = CACHE / src.stem
    want = {"Q8_0": (out / "q8_0.gguf", 7), "Q4_0": (out / "q4_0.gguf", 2)}  # llama_ftype MOSTLY_Q8_0 / MOSTLY_Q4_0
    if all(p.is_file() for p, _ in want.values()):
        return {k: p for k, (p, _) in want.items()}
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "f32.gguf.partial"
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(f32), r.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        val = 0 if f.name == gguf.Keys.General.FILE_TYPE else f.contents()  # 0 = ALL_F32
        w.add_key_value(f.name, val, vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"  making llama.cpp Q8_0 / Q4_0 of {src.name} (once, cached in {out})", flush=True)
    for name, (path, ftype) in want.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, os.cpu_count() or 1
        tmp = path.with_suffix(".partial")
        with quiet_stderr():  # llama.cpp prints a line per tensor
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src.name} to {name}")
        tmp.rename(path)
    f32.unlink()
    return {k: p for k, (p, _) in want.items()}


def genai_model(hf_dir: Path, precision: str) -> tuple[Path | None, str]:
    """onnxruntime-genai's model builder on the same HF folder, CPU, cached next to the bundle's work folder."""
    out = hf_dir.parent / f"genai-{precision}"
    if (out / "genai_config.json").is_file():
        return out, ""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out), "-p",
           precision, "-e", "cpu", "-c", str(out / "hf-cache")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["builder failed"])[-1][:200]
    return out, ""


def serve_rows(bundle: str, engines: list[str], users: int, threads: int) -> dict:
    """The same engines through `edge-chat serve` with `users` streaming clients (scripts/bench_serve.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_serve

    rows = {}
    for e in engines:
        proc, url = bench_serve.start_server(bundle, e, users, threads)
        try:
            bench_serve.one_request(url, "Hello!", 8)
            one = bench_serve.run_level(url, 1, 2, 128)
            many = bench_serve.run_level(url, users, 2, 128)
        finally:
            proc.terminate()
            proc.wait(30)
        rows[e] = {"one_user": one, f"{users}_users": many, "speedup": many["total_tok_s"] / one["total_tok_s"]}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--engines", nargs="*", help="bundle engines to time (default: all ONNX engines)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--concurrency", type=int, help="also serve the INT8 and INT4 engines to this many clients")
    ap.add_argument("--out", default="bench-results/decode.json")
    ap.add_argument("--_row", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._row:
        spec = json.loads(a._row)
        print(json.dumps(ROWS[spec["kind"]](spec) | {"rss_mb": peak_rss_mb()}))
        return 0
    if not a.bundle:
        ap.error("the bundle folder is required")

    from edge.bundle import Bundle
    from edge.tokenizer import ChatTokenizer

    b = Bundle.open(a.bundle)
    m = b.manifest
    engines = a.engines or [e.name for e in m.engines if e.fingerprint.format == "onnx"]
    prompt_ids = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer).encode_chat(PROMPT)
    base = {"threads": a.threads, "new": a.new_tokens, "runs": a.runs, "prompt_ids": prompt_ids}
    bw = read_bandwidth_gbs(a.threads)
    cpu = cpu_name()
    print(f"machine: {cpu}, {os.cpu_count()} CPUs, read bandwidth {bw:.1f} GB/s; threads {a.threads}, prompt "
          f"{len(prompt_ids)} tokens, {a.new_tokens} greedy tokens, median of {a.runs} after a warm-up")
    specs: dict[str, dict] = {f"edgechat {e}": {"kind": "edgechat", "bundle": str(b.root), "engine": e} for e in engines}
    hf_dir = Path(str(b.root) + ".work") / "load"
    skipped = []
    if a.no_transformers:
        pass
    elif hf_dir.is_dir():
        specs["transformers fp32"] = {"kind": "transformers", "hf_dir": str(hf_dir)}
    else:
        skipped.append(f"transformers: {hf_dir} not found (it is the build's load stage)")
    if importlib.util.find_spec("onnxruntime_genai") and hf_dir.is_dir():
        for prec in ("int8", "int4", "fp32"):
            mdir, err = genai_model(hf_dir, prec)
            if mdir:
                specs[f"onnxruntime-genai {prec}"] = {"kind": "genai", "model_dir": str(mdir)}
            else:
                skipped.append(f"onnxruntime-genai {prec}: model builder failed: {err}")
    else:
        skipped.append("onnxruntime-genai: not installed (pip install onnxruntime-genai; not on every index)")
    source = json.loads((hf_dir / "edgechat_source.json").read_text()).get("source", "") if hf_dir.is_dir() else ""
    gguf_src = Path(source[len("gguf:"):]) if source.startswith("gguf:") else None  # the GGUF the bundle was built from
    if a.no_llama_cpp:
        pass
    elif not importlib.util.find_spec("llama_cpp"):
        skipped.append("llama.cpp: pip install llama-cpp-python (compiles from source, a few minutes)")
    else:
        if gguf_src is None or not gguf_src.is_file():
            skipped.append("llama.cpp: the bundle was not built from a GGUF, so there is no same-weights GGUF to compare")
        else:
            for q, path in gguf_variants(gguf_src).items():
                specs[f"llama.cpp {q}"] = {"kind": "llama.cpp", "gguf": str(path)}
            specs[f"llama.cpp {gguf_src.stem.split('.')[-1]} (as shipped)"] = {"kind": "llama.cpp", "gguf": str(gguf_src)}
    for s in skipped:
        print(f"  skipped {s}")
    rows = {}
    for name, spec in specs.items():
        rows[name] = run_row(base | spec)
        print(f"  measured {name}" + (f": ERROR {rows[name]['error']}" if "error" in rows[name] else ""), flush=True)
    ok = {k: r for k, r in rows.items() if "error" not in r}
    ref = ok.get("transformers fp32", {}).get("decode_tok_s")
    print(f"\n{'runtime':34s} {'TTFT ms':>8s} {'decode tok/s':>13s} {'vs HF':>6s} {'MB/token':>9s} {'roofline':>9s} "
          f"{'peak RSS':>9s}")
    for name, r in ok.items():
        r["roofline_tok_s"] = bw * 1e9 / r["weight_bytes"]
        r["roofline_fraction"] = r["decode_tok_s"] / r["roofline_tok_s"]
        r["vs_transformers"] = r["decode_tok_s"] / ref if ref else None
        vs = f"{r['vs_transformers']:.2f}x" if ref else "-"
        print(f"{name:34s} {r['ttft_ms']:8.0f} {r['decode_tok_s']:13.1f} {vs:>6s} {r['weight_bytes'] / 1e6:9.0f} "
              f"{100 * r['roofline_fraction']:8.0f}% {r['rss_mb']:8.0f}M")
    ratios = {}
    for ours, theirs in (("edgechat int8-dynamic", "onnxruntime-genai int8"), ("edgechat int8-dynamic", "llama.cpp Q8_0"),
                         ("edgechat int4-weight", "onnxruntime-genai int4"), ("edgechat int4-weight", "llama.cpp Q4_0")):
        if ours in ok and theirs in ok:
            ratios[f"{ours} / {theirs}"] = {"decode": ok[ours]["decode_tok_s"] / ok[theirs]["decode_tok_s"],
                                            "ttft": ok[ours]["ttft_ms"] / ok[theirs]["ttft_ms"]}
    if ratios:
        print(f"\n{'ratio':58s} {'decode':>7s} {'TTFT':>6s}")
        for k, v in ratios.items():
            print(f"{k:58s} {v['decode']:6.2f}x {v['ttft']:5.2f}x")
    served = {}
    if a.concurrency:
        pick = [e for e in ("int8-dynamic", "int4-weight") if e in engines] or engines[:1]
        served = serve_rows(str(b.root), pick, a.concurrency, a.threads)
        print(f"\nthrough the server ({a.concurrency} streaming clients, 128 tokens each, 2 answers per client):")
        print(f"{'engine':16s} {'1 user tok/s':>13s} {f'{a.concurrency} users tok/s':>15s} {'speedup':>8s} "
              f"{'per user':>9s} {'TTFT p50':>9s}")
        for e, r in served.items():
            many = r[f"{a.concurrency}_users"]
            print(f"{e:16s} {r['one_user']['total_tok_s']:13.1f} {many['total_tok_s']:15.1f} {r['speedup']:7.2f}x "
                  f"{many['per_user_tok_s']:9.1f} {many['ttft_p50_ms']:7.0f}ms")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpu": cpu, "cpus": os.cpu_count(), "read_bandwidth_gbs": bw,
                                           "platform": platform.platform()},
                               "threads": a.threads, "new_tokens": a.new_tokens, "prompt_tokens": len(prompt_ids),
                               "rows": rows, "ratios": ratios, "skipped": skipped, "served": served}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
