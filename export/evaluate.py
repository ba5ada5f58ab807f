"""Evaluate stage: measure what ships, with the edge runtime itself.

On held-out chats (never the calibration split) and on held-out general prose (export/prose.py: chat
text alone hides what 4 bits cost), with the same token ids for every engine: mean KL divergence to the
fp32 reference (the headline: it sees every token's whole distribution), top-1 next-token agreement,
perplexity and bits per UTF-8 byte; greedy answers to fixed golden prompts (saved in the bundle so a
device can re-check them); decode tokens/s and time-to-first-token on this machine; size on disk.
Writes the report too.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge.decode.generate import Generator
from edge.backends.onnxruntime import OrtDecoder
from edge.decode.sampling import SamplingConfig
from edge import precisions
from edge.precisions import FP32, INT4_QDQ
from export import vocab
from export.cpu_twin import scored_graph
from export.onnx_weights import graph_bytes

TWINS = "cpu-twins"  # the evaluate stage's scratch folder of int4-qdq's CPU twins (export/cpu_twin.py)

GOLDEN = [
    {"prompt": "What is the capital of Japan?", "expect": ["Tokyo"]},
    {"prompt": "What is the capital of France?", "expect": ["Paris"]},
    {"prompt": "How many legs does a spider have?", "expect": ["8", "eight"]},
    {"prompt": "Write one sentence about the ocean.", "expect": []},
    {"prompt": "Give me a short tip for staying focused while studying.", "expect": []},
]
BENCH_PROMPT = [{"role": "user", "content": "Tell me about the history of the city of Kyoto, its temples and "
                                              "gardens, and why people visit it in autumn."}]


@dataclass(frozen=True)
class EvalOptions:
    samples: int = 64
    data: str | None = None
    max_tokens: int = 256
    golden_tokens: int = 48
    bench_tokens: int = 64
    bench_runs: int = 3
    threads: int | None = None
    max_context: int = 2048
    prose_tokens: int = 4096  # held-out prose scored per engine, in windows of prose_window tokens
    prose_window: int = 512


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Reference:
    """The reference's side of `token_metrics` for one text, computed once and compared with every engine."""

    logits: np.ndarray  # [seq, vocab] float32
    probs: np.ndarray  # its softmax, float32
    lse: np.ndarray  # log-sum-exp per position, float64
    top1: np.ndarray

    @classmethod
    def of(cls, logits: np.ndarray) -> "Reference":
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        m = logits.max(axis=-1, keepdims=True)
        e = np.exp(logits - m)
        z = e.sum(axis=-1, dtype=np.float64)
        e /= z[:, None].astype(np.float32)
        return cls(logits, e, m[:, 0].astype(np.float64) + np.log(z), logits.argmax(-1))


def _lse(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=-1, dtype=np.float64))


METRIC_ROWS = 64  # positions whose float temporaries (vocabulary-wide) are alive at once in `token_metrics`


def token_metrics(student: np.ndarray, teacher: np.ndarray | Reference, targets: np.ndarray) -> dict:
    """Per-position sums for one sequence: NLL of targets, KL(teacher || student), top-1 agreement.

    student/teacher: [seq, vocab] logits predicting targets [seq] (teacher: or its `Reference`, computed once
    for all engines). KL = sum_v p_t (t_v - s_v) - (lse_t - lse_s): float32 element-wise work with float64
    sums, ~8x faster than float64 log-softmaxes and within ~1e-7 nats of them (tests/test_eval.py checks).
    Teacher logits given as an array are taken `METRIC_ROWS` positions at a time (its softmax and the difference
    are vocabulary-wide temporaries: a 512-token text of a 152k vocabulary holds 311 MB per copy); each position's
    terms are the same numbers either way, summed once at the end.
    """
    if not isinstance(teacher, Reference) and len(targets) > METRIC_ROWS:
        kl, nll, agree = np.empty(len(targets)), np.empty(len(targets)), 0
        for a in range(0, len(targets), METRIC_ROWS):
            b = min(a + METRIC_ROWS, len(targets))
            part = _terms(student[a:b], Reference.of(teacher[a:b]), targets[a:b])
            kl[a:b], nll[a:b], agree = part[0], part[1], agree + part[2]
        return {"nll": float(nll.sum()), "kl": float(kl.sum()), "agree": agree, "n": int(len(targets))}
    ref = teacher if isinstance(teacher, Reference) else Reference.of(teacher)
    kl, nll, agree = _terms(student, ref, targets)
    return {"nll": float(nll.sum()), "kl": float(kl.sum()), "agree": agree, "n": int(len(targets))}


def _terms(student: np.ndarray, ref: Reference, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-position KL and NLL (float64) and the count of agreeing top-1 tokens."""
    s = np.ascontiguousarray(student, dtype=np.float32)
    lse_s = _lse(s)
    d = ref.logits - s
    d *= ref.probs
    kl = d.sum(axis=-1, dtype=np.float64) - (ref.lse - lse_s)
    nll = lse_s - s[np.arange(len(targets)), targets]
    return kl, nll, int((s.argmax(-1) == ref.top1).sum())


def token_metrics_f64(student: np.ndarray, teacher: np.ndarray, targets: np.ndarray) -> dict:
    """`token_metrics` the direct way (float64 log-softmaxes): what the fast one is checked against."""
    ls, lt = log_softmax(student), log_softmax(teacher)
    nll = -ls[np.arange(len(targets)), targets]
    kl = (np.exp(lt) * (lt - ls)).sum(axis=-1)
    agree = student.argmax(-1) == teacher.argmax(-1)
    return {"nll": float(nll.sum()), "kl": float(kl.sum()), "agree": int(agree.sum()), "n": int(len(targets))}


def prose_windows(tok, texts: list[str], window: int, total: int) -> list[list[int]]:
    """Token windows of the held-out prose (each document's first `window` tokens) until `total` tokens."""
    out, n = [], 0
    for text in texts:
        ids = tok.encode(text)[:window]
        if len(ids) < 2:
            continue
        out.append(ids)
        n += len(ids)
        if n >= total:
            break
    return out


CI_RESAMPLES = 1000


def kl_interval(parts: list[dict], level: float = 0.95) -> tuple[float, float]:
    """A `level` confidence interval for the mean KL per token, by a bootstrap over texts (the texts are the
    sample; tokens of one text are not independent): `CI_RESAMPLES` resamples, a fixed seed."""
    kl = np.array([p["kl"] for p in parts])
    n = np.array([p["n"] for p in parts], dtype=np.float64)
    if len(parts) < 2:
        return (float(kl.sum() / n.sum()),) * 2
    idx = np.random.default_rng(0).integers(0, len(parts), (CI_RESAMPLES, len(parts)))
    means = kl[idx].sum(axis=1) / n[idx].sum(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def summarize(parts: list[dict]) -> dict:
    """Perplexity per reference token (`n_ref`: the teacher's token count for the same text, which a
    vocabulary-pruned student splits into more tokens), so models with different vocabularies compare on the
    same text; KL and agreement per position the model predicts, KL with its 95% interval over the texts."""
    n = sum(p["n"] for p in parts)
    n_ref = sum(p.get("n_ref", p["n"]) for p in parts)
    out = {"perplexity": float(np.exp(sum(p["nll"] for p in parts) / n_ref)), "kl_to_fp32": sum(p["kl"] for p in parts) / n,
           "top1_agreement": sum(p["agree"] for p in parts) / n, "eval_tokens": n_ref, "texts": len(parts),
           "kl_ci95": list(kl_interval(parts))}
    if all("bytes" in p for p in parts):
        from export.prose import bits_per_byte

        out["bits_per_byte"] = bits_per_byte(sum(p["nll"] for p in parts), sum(p["bytes"] for p in parts))
    return out


def speed(gen: Generator, prompt_ids: list[int], new_tokens: int, runs: int, done=lambda: None) -> dict:
    """Median TTFT (prefill + first token) and decode tok/s of a greedy answer of `new_tokens` tokens, EOS
    ignored, after a warm-up: through `Generator.stream`, the loop users run (its own timing of each answer).
    `done()` is called after each answer (progress)."""
    cfg = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    ttfts, rates = [], []
    for r in range(runs + 1):
        stats = list(gen.stream(prompt_ids, cfg))[-1].stats
        done()
        if r:  # run 0 is the warm-up
            ttfts.append(stats["ttft_s"])
            rates.append(stats["decode_tok_s"])
    return {"ttft_ms": statistics.median(ttfts) * 1000, "decode_tok_s": statistics.median(rates)}


def scored(d: OrtDecoder, ids: list[int], reference_rows) -> dict:
    """`token_metrics` of an engine on one text, summed over the runtime's own prefill calls (a fused graph: at most
    128 positions each; `Decoder.prefill_span`), each against the same rows of the reference (`reference_rows(a,
    b)`, read from disk): memory bounded by one call, not the text (a whole 512-token text of a 152k vocabulary is
    311 MB of logits per copy; the 1.5B Qwen's evaluate stage peaked at 4.1 GB holding both)."""
    x, targets = np.asarray(ids[:-1], dtype=np.int64), np.asarray(ids[1:])
    cache = d.new_cache(capacity=len(x))
    total = {"nll": 0.0, "kl": 0.0, "agree": 0, "n": 0}
    start = 0
    while start < len(x):
        end = min(start + d.prefill_span(cache.length), len(x))
        part = token_metrics(d.forward(x[start:end], cache, last_only=False)[0], reference_rows(start, end),
                             targets[start:end])
        total = {k: total[k] + part[k] for k in total}
        start = end
    return total


def scored_with(precision: str, dec: OrtDecoder) -> str:
    """How an engine's numbers were computed: the runtime, its provider and threads, and session settings
    that change the arithmetic (an explicit Q/DQ graph run as written, not fused into ORT's int8 kernels)."""
    providers = [p.removesuffix("ExecutionProvider") for p in dec.session.get_providers()]
    so = dec.session.get_session_options()
    text = f"ONNX Runtime {ort_version()} {'+'.join(providers)}, {so.intra_op_num_threads} threads"
    own = dict(precisions.get(precision).cpu_session_config) if providers == ["CPU"] else {}
    if own.get("session.disable_quant_qdq") == "1":
        text += (", Q/DQ run as written (session.disable_quant_qdq=1): float arithmetic between explicit quantize "
                 "points, as TensorRT's Q/DQ semantics define, not ORT's fused int8 kernels")
    if precision == INT4_QDQ and providers == ["CPU"]:
        text += ("; its CPU twin: each INT4 DequantizeLinear -> MatMul as MatMulNBits with fp32 compute (the same "
                 "levels and scales, W4A16's arithmetic; the weights stay 4-bit in memory, export/cpu_twin.py)")
    return text


def ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def golden_regressions(golden: list[dict], tok, next_logits) -> list[dict]:
    """Every golden prompt an engine fails that the fp32 graph passes, and why: where its greedy answer first
    leaves fp32's, and how sure fp32 itself was there (`next_logits(ids)`: fp32's logits after `ids`). A
    near tie at that token is the usual reason: a quantization error far below the model's own noise flips it."""
    ref = {g["prompt"]: g for g in golden if g["engine"] == FP32}
    out = []
    for g in golden:
        r = ref.get(g["prompt"])
        if g["engine"] == FP32 or r is None or not r["passed"] or g["passed"] is not False:
            continue
        a, b = r["token_ids"], g["token_ids"]
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        row = {"engine": g["engine"], "prompt": g["prompt"], "position": i}
        if i < len(a):  # fp32 goes on at token i: how sure was it of its own next token, and of the engine's
            lg = next_logits(tok.encode_chat([{"role": "user", "content": g["prompt"]}]) + a[:i]).astype(np.float64)
            p = np.exp(lg - lg.max())
            p /= p.sum()
            row |= {"fp32_token": tok.decode([a[i]]), "fp32_p": float(p[a[i]])}
        if i < len(a) and i < len(b):
            row |= {"engine_token": tok.decode([b[i]]), "engine_token_fp32_p": float(p[b[i]]),
                    "engine_token_fp32_rank": int((p > p[b[i]]).sum()) + 1}
            row["why"] = (f"its answer leaves fp32's at token {i + 1}, where fp32 itself gives {row['fp32_token']!r} "
                          f"p={row['fp32_p']:.2f} and {row['engine_token']!r} p={row['engine_token_fp32_p']:.2f}"
                          + (": a near tie that the quantization flips" if row["engine_token_fp32_p"] > 0.5 * row["fp32_p"]
                             else ": a real change of the model's choice, not a near tie"))
        elif i < len(a):
            row["why"] = (f"its answer is the start of fp32's and ends at token {i + 1} ({g.get('finish_reason') or 'EOS or a stop string'}), "
                          f"where fp32 goes on with {row['fp32_token']!r} p={row['fp32_p']:.2f}")
        else:
            row["why"] = f"its tokens match fp32's up to fp32's end (token {i}) and go on; the keyword check fails on the text"
        out.append(row)
    return out


@dataclass(frozen=True)
class HeldOut:
    """One held-out text as every engine scores it: the reference's token ids, the shipped model's (the same
    unless its vocabulary was pruned), and the text's UTF-8 bytes (bits per byte)."""

    kind: str
    ref_ids: list[int]
    ids: list[int]
    n_bytes: int


def held_out_texts(sets: dict[str, list[list[int]]], tok, ref_tok, t_ids, chat_limit: int, window: int) -> list[HeldOut]:
    """The texts to score, in order; a vocabulary-pruned model's tokens of the same text (`t_ids` given), cut
    until that fits too."""
    out = []
    for kind, seqs in sets.items():
        for ref_ids in seqs:
            if len(ref_ids) < 2:
                continue
            ids = ref_ids
            if t_ids is not None:
                limit = chat_limit if kind == "chats" else window
                while len(ids := tok.encode(ref_tok.decode(ref_ids, skip_special_tokens=False))) > limit:
                    ref_ids = ref_ids[: len(ref_ids) - (len(ids) - limit)]
            out.append(HeldOut(kind, ref_ids, ids, len(ref_tok.decode(ref_ids[1:], skip_special_tokens=False).encode("utf-8"))))
    return out


def run(hf_dir: Path, engines: list, dst: Path, opts: EvalOptions, stages: dict | None = None,
        reference_logits=None) -> dict:
    """Measure every engine; KL and agreement are against the teacher when there is one (a pruned
    build), else against the shipped fp32 graph. `stages`: prune/distill records for the report.

    One engine in ONNX Runtime at a time: the reference first, its logits on every held-out text written to
    disk (export/reference_logits.py), then each other engine scored against them, its speed and golden
    answers measured, and unloaded before the next one loads.

    `reference_logits` (the streaming build, which writes no fp32 graph): a function of the texts' token ids
    yielding each text's fp32 logits in turn (the model run one decoder block at a time,
    export/stream_reference.py); the reference is then scored from those alone (no speed, no golden answers)."""
    from export.data import load_chats
    from export.load import chat_tokenizer, model_dims
    from export.memory import release_memory
    from export.prose import SOURCE, prose_texts
    from export.reference_logits import ReferenceLogits
    from export.report import write_report

    tok = chat_tokenizer(hf_dir)
    by_name = {e.name: e for e in engines}
    ref = "teacher" if "teacher" in by_name else FP32
    chats = load_chats(opts.data, "evaluation", opts.samples)
    t_ids = vocab.teacher_ids(hf_dir) if ref == "teacher" else None  # the shipped model's tokens in the teacher's ids
    own_vocab = {e.name for e in engines if t_ids is not None and vocab.teacher_ids(getattr(e, "dims_dir", None) or hf_dir) is None}
    ref_tok = chat_tokenizer(by_name[ref].dims_dir) if t_ids is not None else tok

    def dims(e):
        return model_dims(getattr(e, "dims_dir", None) or hf_dir, opts.max_context)

    def load(e) -> OrtDecoder:
        path = scored_graph(e.folder / "model.onnx", e.precision, dst / TWINS / e.name)  # int4-qdq: its CPU twin
        return OrtDecoder(path, dims(e), e.io, threads=opts.threads, name=e.name, precision=e.precision)

    def logits(d: OrtDecoder, ids: list[int]) -> np.ndarray:
        x = np.array([ids[:-1]])
        return d.forward(x, d.new_cache(capacity=x.shape[1]), last_only=False)[0]

    chat_limit = min(opts.max_tokens, opts.max_context)  # a bundle built with a short context scores within it
    window = min(opts.prose_window, opts.max_context)
    sets = {"chats": [ref_tok.encode_chat(c, add_generation_prompt=False)[:chat_limit] for c in chats],
            "prose": prose_windows(ref_tok, prose_texts("eval"), window, opts.prose_tokens)}
    texts = held_out_texts(sets, tok, ref_tok, t_ids, chat_limit, window)
    ref_vocab = dims(by_name[ref]).vocab_size
    need = sum((len(t.ref_ids) - 1) * ref_vocab + (0 if t_ids is None else (len(t.ids) - 1) * len(t_ids)) for t in texts) * 4
    ReferenceLogits.check_room(dst, need)
    results: dict = {"engines": {}, "golden": [], "eval_chats": len(chats), "reference": ref,
                     "data": opts.data or "chitchat-dataset:evaluation", "stages": stages or {},
                     "prose": {"source": SOURCE, "texts": len(sets["prose"])}}
    bench_ids = tok.encode_chat(BENCH_PROMPT)
    greedy = SamplingConfig(max_new_tokens=opts.golden_tokens)

    def quality_only(e) -> bool:  # an ablation: scored, no golden answers or speed
        return getattr(e, "report_only", False) and not getattr(e, "lineage", False) and not getattr(e, "reference", False)

    timing: dict[str, dict] = {}  # what each engine cost, by step (the stage record)
    with ReferenceLogits(dst / "reference-logits.f32") as store:
        for e in [by_name[ref]] + [e for e in engines if e.name != ref]:  # the reference first: it writes the store
            t0 = time.perf_counter()
            streamed = e.name == ref and reference_logits is not None  # no graph: logits from the torch model
            d = None if streamed else load(e)
            timing[e.name] = t = {"load_s": time.perf_counter() - t0, "score_s": 0.0, "scored_tokens": 0}
            parts: dict[str, list[dict]] = {k: [] for k in sets}
            t0 = time.perf_counter()
            made = reference_logits([x.ref_ids[:-1] for x in texts]) if streamed else None
            for i, x in enumerate(tqdm(texts, desc=f"held-out texts ({e.name})", unit="text")):
                t["scored_tokens"] += len(x.ids) - 1
                own = None  # the reference's logits scored against themselves: the array just written, not read back
                if e.name == ref:  # its logits on the reference's tokens (and on the shipped model's) go to disk
                    own = next(made) if streamed else logits(d, x.ref_ids)
                    store.put((i, "ref"), own)
                    if t_ids is not None:  # over the kept tokens
                        store.put((i, "student"), logits(d, t_ids[x.ids].tolist())[:, t_ids])
                if e.name in own_vocab:  # the teacher on its own tokens
                    teacher = Reference.of(store.get((i, "ref")))
                    parts[x.kind].append(token_metrics(teacher.logits, teacher, np.array(x.ref_ids[1:])) | {"bytes": x.n_bytes})
                    continue
                key = (i, "ref" if t_ids is None else "student")
                if e.name == ref:  # against itself: the array just written (or, over the kept tokens, read back)
                    against = own if own is not None and t_ids is None else store.get(key)
                    m = token_metrics(against, against, np.array(x.ids[1:]))
                else:
                    m = scored(d, x.ids, lambda a, b: store.get(key, (a, b)))
                own = against = None
                parts[x.kind].append(m | {"n_ref": len(x.ref_ids) - 1, "bytes": x.n_bytes})
            t["score_s"] = time.perf_counter() - t0
            del made
            q = summarize(parts["chats"])
            if parts["prose"]:
                q["prose"] = summarize(parts["prose"])
            if streamed:  # no graph was written: what an fp32 graph's weights would weigh
                q["size_bytes"] = 4 * dims(e).num_parameters
                q["scored_with"] = ("PyTorch fp32 (the Hugging Face model), one decoder block's weights at a time "
                                    "(export/stream_reference.py); size: its fp32 weights, no graph written")
            else:
                q["size_bytes"] = graph_bytes(e.folder / "model.onnx")
                q["scored_with"] = scored_with(e.precision, d)
            q["shipped"] = not getattr(e, "report_only", False)
            q["timing"] = t
            results["engines"][e.name] = q
            if not quality_only(e) and not streamed:
                lineage = getattr(e, "lineage", False)  # teacher / pruned-only: speed too, golden answers only for what ships
                bar = tqdm(total=opts.bench_runs + 1 + (0 if lineage else len(GOLDEN)), unit="answer",
                           desc=("speed" if lineage else "speed + golden prompts") + f" ({e.name})")
                gen = Generator(tok, d)
                t0 = time.perf_counter()
                q |= speed(gen, bench_ids, opts.bench_tokens, opts.bench_runs, bar.update)
                t["speed_s"] = time.perf_counter() - t0
                q["bench_prompt_tokens"] = len(bench_ids)
                if not lineage:
                    t0 = time.perf_counter()
                    q["golden_passed"] = _golden(gen, tok, greedy, e.name, results["golden"], bar.update)
                    t["golden_s"] = time.perf_counter() - t0
                bar.close()
                del gen
            del d
            release_memory()  # the engine's arena back to the OS before the next one loads
            shutil.rmtree(dst / TWINS, ignore_errors=True)
        results["reference_logits_bytes"] = store.bytes
    order = {e.name: k for k, e in enumerate(engines)}
    results["engines"] = {n: results["engines"][n] for n in sorted(results["engines"], key=order.get)}
    results["golden"].sort(key=lambda g: order[g["engine"]])  # stable: each engine's prompts keep their order
    for t in timing.values():
        t |= {k: round(v, 2) for k, v in t.items() if k.endswith("_s")}
        t["total_s"] = round(sum(v for k, v in t.items() if k.endswith("_s")), 2)
    fp32: list[OrtDecoder] = []  # loaded again only if an engine fails a golden prompt fp32 passes

    def fp32_next(ids: list[int]) -> np.ndarray:
        if not fp32:
            fp32.append(load(by_name[FP32]))
        return logits(fp32[0], ids + [0])[-1]

    results["golden_regressions"] = golden_regressions(results["golden"], tok, fp32_next)
    fp32.clear()
    base = results["engines"][FP32]
    for q in results["engines"].values():
        q["perplexity_delta_pct"] = 100 * (q["perplexity"] / base["perplexity"] - 1)
        if "prose" in q and "prose" in base:
            q["prose"]["perplexity_delta_pct"] = 100 * (q["prose"]["perplexity"] / base["prose"]["perplexity"] - 1)
        if ref == "teacher":
            q["perplexity_vs_teacher_pct"] = 100 * (q["perplexity"] / results["engines"]["teacher"]["perplexity"] - 1)
    if ref == "teacher" and "pruned-only" in results["engines"]:
        t, p, f = (results["engines"][k]["perplexity"] for k in ("teacher", "pruned-only", FP32))
        results["recovered"] = (p - f) / (p - t) if p > t else None  # share of pruning's perplexity rise won back
    write_report(results, dst)
    return results


def _golden(gen: Generator, tok, greedy: SamplingConfig, name: str, into: list[dict], done) -> str:
    """Greedy answers to the golden prompts, appended to `into`; returns "passed/checked"."""
    passed = 0
    for g in GOLDEN:
        text, last = gen.complete(tok.encode_chat([{"role": "user", "content": g["prompt"]}]), greedy)
        ok = any(k.lower() in text.lower() for k in g["expect"]) if g["expect"] else None  # None: nothing to check
        passed += bool(ok)
        done()
        into.append({"engine": name, "prompt": g["prompt"], "answer": text.strip(), "expect": g["expect"],
                     "passed": ok, "token_ids": list(last.token_ids), "finish_reason": last.finish_reason})
    return f"{passed}/{sum(1 for g in GOLDEN if g['expect'])}"
