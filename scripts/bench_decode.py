#!/usr/bin/env python
"""Decode speed against the peers, in one interleaved run: our engines (plain and with prompt-lookup
speculative decoding), onnxruntime-genai int8/int4 (built by its own model builder, run in its own venv)
and llama.cpp Q8_0/Q4_0/Q4_K_M of the same weights (llama-bench); same prompt length, same threads.

Every row runs in its own process, once per round, rows in the same order each round (A B C A B C ...),
so a slow minute on this shared machine hits every row, not one. Per row: TTFT (prefill of the chat prompt),
decode tok/s (128 greedy tokens, EOS ignored, after a warm-up in the same process), peak RSS, the fraction
of the bandwidth roofline (measured read bandwidth / weight bytes read per token); the median over rounds
and the spread (min-max). Ratios are taken within each round, then the median. The load average before
each row is recorded: other work on the machine makes absolute figures noisy. Prints tables, writes JSON.

  bash scripts/peers-setup.sh                                   # once: llama.cpp tools + genai venv
  .venv/bin/python scripts/bench_decode.py smollm2.bundle
  .venv/bin/python scripts/bench_decode.py smollm2.bundle --concurrency 8   # + the engines through the server
  .venv/bin/python scripts/bench_decode.py fused.bundle --compare plain=plain.bundle --no-genai --no-llama-cpp
      # + the same engines of other bundles of the same tokenizer, in the same rounds, with per-round ratios

llama.cpp: Q8_0, Q4_0 and Q4_K_M made by llama-quantize from an F32 GGUF of the weights the bundle was
built from (cached under ~/.cache/edgechat/gguf), timed by llama-bench (pp of the prompt length at depth 0
for TTFT, tg 128 at depth = prompt length for decode). onnxruntime-genai: its model builder on a Hugging
Face folder of the same weights (the build's load stage, else made here). A missing peer is skipped with
the command that makes it.
"""

from __future__ import annotations

import argparse
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
from edge.decode.cache import cache_kind  # noqa: E402
from edge.errors import EdgeChatError  # noqa: E402
from edge.device.probe import cpu_name  # noqa: E402
# 55 tokens with SmolLM2's chat template (system prompt included)
PROMPT = [{"role": "user", "content": "Tell me about the history of the city of Kyoto, its temples and gardens, "
                                      "and why so many people like to visit it in the autumn months."}]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import CACHE, GENAI_PYTHON, LLAMA_BIN, PEERS  # noqa: E402,F401  where scripts/peers-setup.sh builds them


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


def timed(prefill, step, new: int) -> dict:
    """prefill() -> first token; step(tok) -> next token. One warm-up answer, then one timed answer."""
    for warm in (True, False):
        t0 = time.perf_counter()
        tokens = [prefill()]
        t1 = time.perf_counter()
        for _ in range(new - 1):
            tokens.append(step(tokens[-1]))
        t2 = time.perf_counter()
    return {"ttft_ms": (t1 - t0) * 1000, "decode_tok_s": (new - 1) / (t2 - t1), "tokens": tokens}


# ----------------------------------------------------------------------------- one row each (in a child process)


def _generator(spec: dict):
    from edge.bundle import Bundle
    from edge.decode.generate import Generator

    b = Bundle.open(spec["bundle"])
    return b, Generator.from_bundle(b, engine=spec["engine"], threads=spec["threads"], spin=not spec.get("no_spin"))


def _engine_facts(b, engine: str) -> dict:
    e = b.manifest.engine(engine)
    return {"weight_bytes": onnx_bytes_read_per_token(b.path(e.file)), "file_bytes": files_bytes(b.path(e.file)),
            "graph": e.fingerprint.variant, "precision": e.fingerprint.precision}


def row_edgechat(spec: dict) -> dict:
    """Our decoder, one token per call (the plain greedy loop)."""
    b, g = _generator(spec)
    d, ids, new = g.decoder, spec["prompt_ids"], spec["new"]
    state = {}

    def prefill():
        state["cache"] = d.new_cache(capacity=len(ids) + new)
        return int(np.argmax(d.prefill(ids, state["cache"])[0]))

    r = timed(prefill, lambda t: int(np.argmax(d.forward(np.array([[t]]), state["cache"])[0])), new)
    return r | _engine_facts(b, spec["engine"])


def row_edgechat_stream(spec: dict) -> dict:
    """What `edge-chat run` does: Generator.stream (the scheduler, detokenizing), greedy; with spec["draft"]
    a draft model's engine drafts (`--draft`: edge.decode.speculative.ModelDrafter, paced by Pacer)."""
    from edge.decode.sampling import SamplingConfig

    b, g = _generator(spec)
    dg = None
    if spec.get("draft"):
        # the draft's idle threads sleep, as edge-chat --draft loads it: spinning, they take the target's cores
        _, dg = _generator(spec | {"bundle": spec["draft"], "engine": spec["draft_engine"], "no_spin": True})
    cfg = SamplingConfig(max_new_tokens=spec["new"], ignore_eos=True)
    for warm in (True, False):
        if dg is not None:
            g.use_draft(dg)  # a fresh drafter: the timed answer pays the draft's prompt prefill, as a first one does
        last = list(g.stream(spec["prompt_ids"], cfg))[-1]
    out = {"ttft_ms": last.stats["ttft_s"] * 1000, "decode_tok_s": last.stats["decode_tok_s"],
           "tokens": last.token_ids} | _engine_facts(b, spec["engine"])
    if g.speculator is not None:
        out["speculative"] = g.speculator.stats.as_dict() | {"plain_steps": g.speculator.plain_steps}
    return out


def row_edgechat_lookup(spec: dict) -> dict:
    """Our decoder with prompt-lookup speculative decoding (edge.decode.speculative), greedy, through the
    scheduler's loop (Generator.stream), drafting at every step (k adapts to the acceptance; no pacing)."""
    from edge.decode.sampling import SamplingConfig
    from edge.decode.speculative import AdaptiveK, Pacer, RowSpeculator, lookup_draft

    b, g = _generator(spec)
    cfg = SamplingConfig(max_new_tokens=spec["new"], ignore_eos=True)
    for warm in (True, False):
        speculator = RowSpeculator(lookup_draft, AdaptiveK(k_max=spec.get("k_max", 8)), Pacer(always=True))
        last = list(g.stream(spec["prompt_ids"], cfg, speculator=speculator))[-1]
    return {"ttft_ms": last.stats["ttft_s"] * 1000, "decode_tok_s": last.stats["decode_tok_s"],
            "tokens": last.token_ids, "speculative": speculator.stats.as_dict(),
            "verify_cost": verify_cost(g.decoder, spec["prompt_ids"])} | _engine_facts(b, spec["engine"])


def verify_cost(d, ids: list[int], sizes=(1, 2, 3, 5, 9), reps: int = 8) -> dict:
    """What bounds speculation: the time of one target call of n tokens (pending + n - 1 drafts) over one of
    1 token, interleaved, median of `reps`. Speculation gains only when the tokens a call yields exceed it."""
    from edge.decode.speculative import rollback

    cache = d.new_cache(capacity=len(ids) + 16)
    d.prefill(ids, cache)
    base = cache.length
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            t = time.perf_counter()
            d.forward(np.arange(100, 100 + n)[None], cache, last_only=n == 1)
            times[n].append(time.perf_counter() - t)
            rollback(d, cache, base)  # a plain graph's past tensors are cut, not only its length
    one = statistics.median(times[1])
    return {str(n): statistics.median(v) / one for n, v in times.items()} | {"one_token_ms": one * 1000}


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

    return timed(prefill, step, spec["new"]) | {"weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters())}


def row_genai(spec: dict) -> dict:
    """onnxruntime-genai's own generator loop (runs in the genai venv's interpreter)."""
    import onnxruntime_genai as og

    cfg = og.Config(spec["model_dir"])
    model = og.Model(cfg)
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

    return timed(prefill, step, new) | {"weight_bytes": onnx_bytes_read_per_token(Path(spec["model_dir"]) / "model.onnx"),
                                        "genai_version": og.__version__}


ROWS = {"edgechat": row_edgechat, "edgechat-lookup": row_edgechat_lookup, "edgechat-stream": row_edgechat_stream,
        "transformers": row_transformers, "genai": row_genai}


def run_llama_bench(spec: dict) -> dict:
    """llama.cpp's own harness: pp<prompt> at depth 0 (TTFT) and tg<new> at depth <prompt> (decode)."""
    n = len(spec["prompt_ids"])
    cmd = [str(LLAMA_BIN / "llama-bench"), "-m", spec["gguf"], "-t", str(spec["threads"]), "-p", str(n), "-n",
           str(spec["new"]), "-d", f"0,{n}", "-r", "1", "-o", "json"] + (["--poll", "0"] if spec.get("no_spin") else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
    tests = json.loads(p.stdout)
    pp = next(t for t in tests if t["n_prompt"] == n and t["n_gen"] == 0 and t.get("n_depth", 0) == 0)
    tg = next(t for t in tests if t["n_gen"] == spec["new"] and t.get("n_depth", n) == n)
    return {"ttft_ms": 1000 * n / pp["avg_ts"], "decode_tok_s": tg["avg_ts"], "weight_bytes": tg["model_size"],
            "build": f"{tests[0].get('build_commit', '?')} ({tests[0].get('cpu_info', '')})"}


def run_row(spec: dict) -> dict:
    """Run one row in a fresh process (its own peak RSS comes back with it)."""
    if spec["kind"] == "llama.cpp":
        return run_llama_bench(spec)
    python = str(GENAI_PYTHON) if spec["kind"] == "genai" else sys.executable
    p = subprocess.run([python, __file__, "--_row", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT,
                       timeout=3600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- the peers' model files


def hf_folder(bundle) -> Path | None:
    """A Hugging Face folder of the bundle's weights: the build's load stage, else made here once from the
    manifest's source (export.load, in a child process: it needs torch and transformers)."""
    work = Path(str(bundle.root) + ".work") / "load"
    if (work / "config.json").is_file():
        return work
    source = bundle.manifest.source or ""
    if not source.startswith("gguf:"):
        return None
    out = CACHE / "bench" / bundle.manifest.bundle_id / "hf"
    if not (out / "config.json").is_file():
        print(f"  making a Hugging Face folder of {source} (once, cached in {out})", flush=True)
        code = ("import sys; from pathlib import Path; from export.load import run; from export.model_source import resolve; "
                "run(resolve(sys.argv[1]), Path(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, source[len("gguf:"):], str(out)], cwd=ROOT, check=True,
                       capture_output=True)
    return out


def gguf_variants(src: Path) -> dict[str, Path]:
    """Q8_0, Q4_0 and Q4_K_M of the weights in `src`, made by llama-quantize from an F32 copy (cached)."""
    from export.eval_gguf import f32_copy

    out = CACHE / "gguf" / src.stem
    want = {q: out / f"{q.lower()}.gguf" for q in ("Q8_0", "Q4_0", "Q4_K_M")}
    if all(p.is_file() for p in want.values()):
        return want
    out.mkdir(parents=True, exist_ok=True)
    f32 = f32_copy(src, out / "f32.gguf")
    print(f"  making llama.cpp {', '.join(want)} of {src.name} with llama-quantize (once, cached in {out})", flush=True)
    for q, path in want.items():
        if not path.is_file():
            p = subprocess.run([str(LLAMA_BIN / "llama-quantize"), str(f32), str(path) + ".partial", q],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"llama-quantize {q} failed: {p.stderr.strip().splitlines()[-1:]}")
            Path(str(path) + ".partial").rename(path)
    return want


def genai_model(hf_dir: Path, precision: str) -> tuple[Path | None, str]:
    """onnxruntime-genai's model builder on the same HF folder, CPU, in the genai venv (cached beside it)."""
    out = hf_dir.parent / f"genai-{precision}"
    if (out / "genai_config.json").is_file():
        return out, ""
    cmd = [str(GENAI_PYTHON), "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out), "-p",
           precision, "-e", "cpu", "-c", str(out / "hf-cache")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["builder failed"])[-1][:200]
    return out, ""


def serve_rows(bundle: str, engines: list[str], users: int, threads: int, draft: str | None = None,
               draft_engine: str | None = None) -> dict:
    """The same engines through `edge-chat serve` with `users` streaming clients (scripts/bench_serve.py);
    with `draft`, each engine again with `--draft` (it drafts while one answer decodes, not in a batch)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_serve

    configs = [(e, e, ("--no-draft",)) for e in engines]  # plain: not even the bundle's own draft
    if draft:
        configs += [(f"{e} + draft {draft_engine}", e, ("--draft", draft, "--draft-engine", draft_engine))
                    for e in engines]
    rows = {}
    for name, e, extra in configs:
        proc, url = bench_serve.start_server(bundle, e, users, threads, extra=extra)
        try:
            bench_serve.one_request(url, "Hello!", 8)
            one = bench_serve.run_level(url, 1, 2, 128)
            many = bench_serve.run_level(url, users, 2, 128)
        finally:
            proc.terminate()
            proc.wait(30)
        rows[name] = {"one_user": one, f"{users}_users": many, "speedup": many["total_tok_s"] / one["total_tok_s"]}
    return rows


# ----------------------------------------------------------------------------- the run


def peers(b, a, skipped: list[str]) -> dict[str, dict]:
    """Row specs for the peers that are set up here; what is missing goes to `skipped` with its fix."""
    specs: dict[str, dict] = {}
    hf_dir = None if a.no_genai and not a.with_transformers else hf_folder(b)
    if a.with_transformers and hf_dir:
        specs["transformers fp32"] = {"kind": "transformers", "hf_dir": str(hf_dir)}
    if a.no_genai:
        pass
    elif not GENAI_PYTHON.is_file():
        skipped.append(f"onnxruntime-genai: no {GENAI_PYTHON} (bash scripts/peers-setup.sh genai)")
    elif hf_dir is None:
        skipped.append("onnxruntime-genai: the bundle's weights are not in a Hugging Face folder here")
    else:
        for prec in ("int8", "int4"):
            mdir, err = genai_model(hf_dir, prec)
            if mdir:
                specs[f"onnxruntime-genai {prec}"] = {"kind": "genai", "model_dir": str(mdir)}
            else:
                skipped.append(f"onnxruntime-genai {prec}: model builder failed: {err}")
    source = b.manifest.source or ""
    gguf_src = Path(source[len("gguf:"):]) if source.startswith("gguf:") else None
    if a.no_llama_cpp:
        pass
    elif not (LLAMA_BIN / "llama-bench").is_file() or not (LLAMA_BIN / "llama-quantize").is_file():
        skipped.append(f"llama.cpp: no llama-bench/llama-quantize in {LLAMA_BIN} (bash scripts/peers-setup.sh llama)")
    elif gguf_src is None or not gguf_src.is_file():
        skipped.append("llama.cpp: the bundle was not built from a GGUF, so there is no same-weights GGUF to compare")
    else:
        for q, path in gguf_variants(gguf_src).items():
            specs[f"llama.cpp {q}"] = {"kind": "llama.cpp", "gguf": str(path)}
    return specs


def summarize(per_round: list[dict]) -> dict:
    """Median and spread over rounds of one row's figures."""
    ok = [r for r in per_round if "error" not in r]
    if not ok:
        return {"error": per_round[-1].get("error", "failed")}
    out = dict(ok[-1])
    out.pop("tokens", None)
    for key in ("decode_tok_s", "ttft_ms", "rss_mb"):
        vals = [r[key] for r in ok if key in r]
        if vals:
            out[key] = statistics.median(vals)
            out[key + "_range"] = [min(vals), max(vals)]
    out["rounds"] = len(ok)
    return out


RATIOS = [("edgechat int8-dynamic + lookup", "onnxruntime-genai int8"), ("edgechat int8-dynamic + lookup", "llama.cpp Q8_0"),
          ("edgechat int8-dynamic", "onnxruntime-genai int8"), ("edgechat int8-dynamic", "llama.cpp Q8_0"),
          ("edgechat int4-weight", "onnxruntime-genai int4"), ("edgechat int4-weight", "llama.cpp Q4_0"),
          ("edgechat int4-weight", "llama.cpp Q4_K_M"), ("edgechat int8-dynamic + lookup", "edgechat int8-dynamic")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--engines", nargs="*", help="bundle engines to time (default: int8-dynamic and int4-weight)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", help="the user message to answer (default: the bench's Kyoto question)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every row once per round)")
    ap.add_argument("--no-lookup", action="store_true", help="skip the prompt-lookup speculative rows")
    ap.add_argument("--draft", help="a draft bundle (same tokenizer): adds a row per engine drafting with it")
    ap.add_argument("--draft-engine", default="int4-weight", help="the draft bundle's engine (default int4-weight)")
    ap.add_argument("--with-transformers", action="store_true", help="add transformers fp32 (slow)")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--concurrency", type=int, help="also serve the INT8 and INT4 engines to this many clients")
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL=BUNDLE",
                    help="also time the same engines of this bundle (same tokenizer), rows named 'LABEL ENGINE', "
                         "and the ratio of each of ours to it per round (repeatable)")
    ap.add_argument("--no-spin", action="store_true", help="idle worker threads sleep instead of spinning (ours: ORT "
                    "allow_spinning 0; llama.cpp: --poll 0); fairer on a machine other work is loading")
    ap.add_argument("--out", default="bench-results/decode.json")
    ap.add_argument("--_row", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._row:
        spec = json.loads(a._row)
        print(json.dumps(ROWS[spec["kind"]](spec) | {"rss_mb": peak_rss_mb()}))
        return 0
    if not a.bundle:
        ap.error("the bundle folder is required")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if a.prompt is not None and not a.prompt.strip():
        ap.error("--prompt is empty: give the user message to answer, or leave it out for the Kyoto question")

    from edge.bundle import Bundle
    from edge.decode.tokenizer import ChatTokenizer

    b = Bundle.open(a.bundle)
    m = b.manifest
    if a.draft:  # here, not in every row's process: a bad draft is one error line, not an ERROR per row
        try:
            Bundle.open(a.draft).manifest.engine(a.draft_engine)
        except EdgeChatError as e:
            ap.error(f"--draft: {e}")
    compare: dict[str, Bundle] = {}
    for c in a.compare:
        label, sep, path = c.partition("=")
        if not sep or not label or not path:
            ap.error(f"--compare {c!r}: give LABEL=BUNDLE, e.g. plain=/tmp/plain.bundle")
        try:
            compare[label] = Bundle.open(path)
        except EdgeChatError as e:
            ap.error(f"--compare {label}: {e}")
    names = [e.name for e in m.engines if e.fingerprint.format == "onnx"]
    engines = a.engines or [e for e in ("int8-dynamic", "int4-weight") if e in names] or names
    prompt = [{"role": "user", "content": a.prompt}] if a.prompt else PROMPT
    prompt_ids = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer).encode_chat(prompt)
    for label, cb in compare.items():  # every row must answer the same prompt tokens
        if ChatTokenizer(cb.path(cb.manifest.tokenizer.file), cb.manifest.tokenizer).encode_chat(prompt) != prompt_ids:
            ap.error(f"--compare {label}: its tokenizer or chat template makes other prompt tokens than {a.bundle}'s")
    base = {"threads": a.threads, "new": a.new_tokens, "prompt_ids": prompt_ids, "no_spin": a.no_spin}
    bw = read_bandwidth_gbs(a.threads)
    cpu = cpu_name()
    load0 = os.getloadavg()
    print(f"machine: {cpu}, {os.cpu_count()} CPUs, read bandwidth {bw:.1f} GB/s, load average {load0[0]:.2f} "
          f"(other work on this machine adds noise); threads {a.threads}, prompt {len(prompt_ids)} tokens, "
          f"{a.new_tokens} greedy tokens, {a.rounds} interleaved rounds", flush=True)
    specs: dict[str, dict] = {}
    skipped: list[str] = []
    for e in engines:
        specs[f"edgechat {e}"] = {"kind": "edgechat", "bundle": str(b.root), "engine": e}
        if not a.no_lookup and e == "int8-dynamic":
            specs[f"edgechat {e} + lookup"] = {"kind": "edgechat-lookup", "bundle": str(b.root), "engine": e}
        if a.draft and not cache_kind(m.engine(e).fingerprint.variant == "fused").can_verify:  # as edge-chat asks
            skipped.append(f"edgechat {e} + draft: a {m.engine(e).fingerprint.variant} graph cannot verify drafts "
                           "(edge-chat --draft refuses it too)")
        elif a.draft:  # both through the scheduler, as edge-chat runs them
            specs[f"edgechat {e} stream"] = {"kind": "edgechat-stream", "bundle": str(b.root), "engine": e}
            specs[f"edgechat {e} stream + draft {a.draft_engine}"] = {
                "kind": "edgechat-stream", "bundle": str(b.root), "engine": e, "draft": a.draft,
                "draft_engine": a.draft_engine}
    compare_ratios = []
    for label, cb in compare.items():
        for e in engines:
            if e not in {x.name for x in cb.manifest.engines}:
                skipped.append(f"{label} {e}: {cb.root} has no such engine")
                continue
            specs[f"{label} {e}"] = {"kind": "edgechat", "bundle": str(cb.root), "engine": e}
            compare_ratios.append((f"edgechat {e}", f"{label} {e}"))
    specs |= peers(b, a, skipped)
    for s in skipped:
        print(f"  skipped {s}")
    rounds: dict[str, list[dict]] = {k: [] for k in specs}
    loads: list[dict] = []
    for r in range(a.rounds):
        for name, spec in specs.items():
            load = os.getloadavg()[0]
            res = run_row(base | spec)
            res["load_avg_1m"] = load
            rounds[name].append(res)
            loads.append({"round": r, "row": name, "load_avg_1m": load})
            msg = f"ERROR {res['error']}" if "error" in res else f"{res['decode_tok_s']:.1f} tok/s"
            print(f"  round {r + 1}/{a.rounds} {name}: {msg} (load {load:.2f})", flush=True)
    rows = {k: summarize(v) for k, v in rounds.items()}
    ok = {k: r for k, r in rows.items() if "error" not in r}
    print(f"\n{'runtime':34s} {'TTFT ms':>8s} {'decode tok/s':>13s} {'spread':>13s} {'MB/token':>9s} {'roofline':>9s} "
          f"{'peak RSS':>9s}")
    for name, r in ok.items():
        r["roofline_tok_s"] = bw * 1e9 / r["weight_bytes"]
        r["roofline_fraction"] = r["decode_tok_s"] / r["roofline_tok_s"]
        lo, hi = r["decode_tok_s_range"]
        rss = f"{r['rss_mb']:8.0f}M" if "rss_mb" in r else "-"
        print(f"{name:34s} {r['ttft_ms']:8.0f} {r['decode_tok_s']:13.1f} {f'{lo:.0f}-{hi:.0f}':>13s} "
              f"{r['weight_bytes'] / 1e6:9.0f} {100 * r['roofline_fraction']:8.0f}% {rss:>9s}")
    # output identity: each speculative answer against the plain one of its engine, every round
    identical: dict[str, bool] = {}
    for name, spec in specs.items():
        plain = rounds.get(f"edgechat {spec.get('engine')}", [])
        if not (spec["kind"] == "edgechat-lookup" or spec.get("draft")) or not plain:
            continue
        identical[name] = all("tokens" in p and "tokens" in s and p["tokens"] == s["tokens"]
                              for p, s in zip(plain, rounds[name]))
        acc = rows[name].get("speculative", {})
        plain_steps = f", {acc['plain_steps']} plain steps (Pacer)" if "plain_steps" in acc else ""
        print(f"\n{name}: output identical to plain greedy in every round: {identical[name]}; "
              f"acceptance {acc.get('acceptance', 0):.2f} ({acc.get('accepted', 0)} of {acc.get('drafted', 0)} drafted), "
              f"{acc.get('target_calls', 0)} target calls{plain_steps} for {a.new_tokens} tokens")
        cost = rows[name].get("verify_cost", {})
        if cost:
            print("  cost of one target call of n tokens, in single-token calls: " +
                  ", ".join(f"n={n}: {v:.2f}" for n, v in cost.items() if n != "one_token_ms"))
    ratios = {}
    for ours, theirs in RATIOS + compare_ratios + [(n, f"edgechat {s['engine']} stream") for n, s in specs.items()
                                                   if s.get("draft")]:
        pairs = [(x, y) for x, y in zip(rounds.get(ours, []), rounds.get(theirs, [])) if "error" not in x and "error" not in y]
        if pairs:
            dec = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in pairs]
            ttft = [x["ttft_ms"] / y["ttft_ms"] for x, y in pairs]
            ratios[f"{ours} / {theirs}"] = {"decode": statistics.median(dec), "decode_range": [min(dec), max(dec)],
                                            "ttft": statistics.median(ttft), "ttft_range": [min(ttft), max(ttft)]}
    if ratios:
        print(f"\n{'ratio (per round, median; min-max)':62s} {'decode':>16s} {'TTFT':>16s}")
        for k, v in ratios.items():
            d, t = v["decode_range"], v["ttft_range"]
            print(f"{k:62s} {v['decode']:5.2f}x {d[0]:.2f}-{d[1]:.2f} {v['ttft']:5.2f}x {t[0]:.2f}-{t[1]:.2f}")
    served = {}
    if a.concurrency:
        pick = [e for e in ("int8-dynamic", "int4-weight") if e in engines] or engines[:1]
        served = serve_rows(str(b.root), pick, a.concurrency, a.threads, a.draft, a.draft_engine)
        print(f"\nthrough the server ({a.concurrency} streaming clients, 128 tokens each, 2 answers per client):")
        print(f"{'engine':34s} {'1 user tok/s':>13s} {f'{a.concurrency} users tok/s':>15s} {'speedup':>8s} "
              f"{'per user':>9s} {'TTFT p50':>9s}")
        for e, r in served.items():
            many = r[f"{a.concurrency}_users"]
            print(f"{e:34s} {r['one_user']['total_tok_s']:13.1f} {many['total_tok_s']:15.1f} {r['speedup']:7.2f}x "
                  f"{many['per_user_tok_s']:9.1f} {many['ttft_p50_ms']:7.0f}ms")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "machine": {"cpu": cpu, "cpus": os.cpu_count(), "read_bandwidth_gbs": bw,
                                           "platform": platform.platform(), "load_avg_at_start": load0,
                                           "load_avg_at_end": os.getloadavg()},
                               "threads": a.threads, "no_spin": a.no_spin, "new_tokens": a.new_tokens,
                               "prompt_tokens": len(prompt_ids), "prompt": prompt,
                               "rounds": a.rounds, "rows": rows, "per_round": rounds, "loads": loads,
                               "ratios": ratios, "speculative_output_identical": identical, "skipped": skipped,
                               "served": served, "compare": {k: str(v.root) for k, v in compare.items()}}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
