"""`edge-export eval`: score a built bundle's engines (and llama.cpp GGUFs) on the same token ids.

Every engine sees exactly the reference's token ids; the table gives KL to the reference (the headline),
top-1 agreement and perplexity, on held-out chats and held-out prose (or the user's own file).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from edge.errors import DataError
from edge.precisions import FP32, INT4_QDQ
from export.evaluate import prose_windows, summarize, token_metrics

Logits = Callable[[list[int]], np.ndarray]  # token ids -> [len - 1, vocab] logits predicting ids[1:]
Rows = Callable[[int, int], np.ndarray]  # (a, b) -> the reference's logits predicting ids[a + 1:b + 1]


class Scorer:
    """A model loaded for scoring: called, its logits on a text (the reference's, written to disk); `score`, its
    `token_metrics` against the reference's rows: an ONNX engine one prefill call at a time (`evaluate.scored`:
    memory bounded by a call, not the text), a GGUF on the whole text (llama.cpp computes it in one pass)."""

    def __init__(self, logits: Logits, score: Callable[[list[int], Rows], dict] | None = None) -> None:
        self.logits = logits
        self._score = score

    def __call__(self, ids: list[int]) -> np.ndarray:
        return self.logits(ids)

    def score(self, ids: list[int], reference_rows: Rows) -> dict:
        if self._score is not None:
            return self._score(ids, reference_rows)
        return token_metrics(self.logits(ids), reference_rows(0, len(ids) - 1), np.array(ids[1:]))


@dataclass(frozen=True)
class EvalRequest:
    bundle: Path
    data: str | None = None  # FILE.jsonl (chats) or FILE.txt (text, documents split by blank lines)
    ggufs: tuple[str, ...] = ()
    llama_cpp: bool = False  # add F32 / Q8_0 / Q4_0 / Q4_K_M of the GGUF the bundle was built from
    reference: str = FP32  # fp32 | an engine name | a .gguf path
    chats: int = 32
    max_tokens: int = 256
    prose_tokens: int = 4096
    window: int = 512
    threads: int | None = None


def _onnx_logits(path: Path, dims, io: dict, threads: int | None, precision: str | None = None) -> Scorer:
    from edge.io_contract import DecoderIO
    import tempfile

    from edge.backends.onnxruntime import OrtDecoder
    from export.cpu_twin import scored_graph
    from export.evaluate import scored

    scratch = tempfile.TemporaryDirectory(prefix="edgechat-twin-") if precision == INT4_QDQ else None
    path = scored_graph(path, precision, Path(scratch.name) if scratch else Path())  # int4-qdq: its CPU twin
    dec = OrtDecoder(path, dims, DecoderIO.from_dict(io), threads=threads, precision=precision)

    def run(ids: list[int]) -> np.ndarray:
        x = np.array([ids[:-1]])
        return dec.forward(x, dec.new_cache(capacity=x.shape[1]), last_only=False)[0]
    scorer = Scorer(run, lambda ids, rows: scored(dec, ids, rows))
    scorer.scratch = scratch  # the twin's folder lives as long as its session
    return scorer


def _gguf_logits(path: str, n_ctx: int, vocab: int, threads: int | None) -> Scorer:
    from export.eval_gguf import GGUFModel

    m = GGUFModel(path, n_ctx=n_ctx, threads=threads)
    if m.n_vocab != vocab:
        raise DataError(f"{path} has {m.n_vocab} tokens, the bundle {vocab}: compare a GGUF of the same model")
    return Scorer(lambda ids: m.logits(ids)[:, :vocab])


def eval_sets(tok, req: EvalRequest, max_context: int) -> dict[str, list[list[int]]]:
    """Token id sequences to score, by set name: the user's file, or held-out chats and held-out prose."""
    import dataclasses

    from export.data import load_chitchat, load_jsonl
    from export.prose import prose_texts

    req = dataclasses.replace(req, max_tokens=min(req.max_tokens, max_context), window=min(req.window, max_context))

    if req.data:
        p = Path(req.data)
        if p.suffix == ".jsonl":
            return {p.name: [tok.encode_chat(c, add_generation_prompt=False)[: req.max_tokens]
                             for c in load_jsonl(p, limit=req.chats)]}
        if not p.is_file():
            raise DataError(f"data file {p} does not exist")
        docs = [d.strip() for d in p.read_text(encoding="utf-8").split("\n\n") if d.strip()]
        if not docs:
            raise DataError(f"{p} holds no text")
        return {p.name: prose_windows(tok, docs, req.window, req.prose_tokens)}
    return {"chats": [tok.encode_chat(c, add_generation_prompt=False)[: req.max_tokens]
                      for c in load_chitchat("evaluation", req.chats)],
            "prose": prose_windows(tok, prose_texts("eval"), req.window, req.prose_tokens)}


def evaluate_bundle(req: EvalRequest, work: Path | None = None) -> dict:
    """Score every engine (and GGUF) against the reference, one model loaded at a time: the reference first,
    its logits on every text kept on disk (export/reference_logits.py) in a temporary folder in `work`, else
    beside the bundle (a disk the user chose; the system's temporary folder may be a RAM disk)."""
    import os
    import tempfile

    from edge.bundle import Bundle
    from edge.decode.tokenizer import ChatTokenizer
    from export.memory import release_memory
    from export.reference_logits import ReferenceLogits

    bundle = Bundle.open(req.bundle)
    m = bundle.manifest
    tok = ChatTokenizer(bundle.path(m.tokenizer.file), m.tokenizer)
    sets = eval_sets(tok, req, m.model.max_context)
    longest = max(len(s) for seqs in sets.values() for s in seqs)
    models: dict[str, tuple[Callable[[], Scorer], int]] = {}  # name -> (loads it, size in bytes): loaded one at a time
    for e in m.engines:
        if e.fingerprint.format == "onnx":
            models[e.name] = (lambda e=e: _onnx_logits(bundle.path(e.file), m.model, m.engine_io(e), req.threads,
                                                       e.fingerprint.precision), m.engine_bytes(e.name))
    ggufs = {f"llama.cpp {Path(g).stem}": g for g in req.ggufs}
    if req.llama_cpp:
        from export.eval_gguf import same_weights

        src = (m.source or "").removeprefix("gguf:")
        if not m.source or not m.source.startswith("gguf:") or not Path(src).is_file():
            raise DataError(f"--llama-cpp needs the GGUF the bundle was built from; this one was built from "
                            f"{m.source or 'an unrecorded source'}: pass GGUFs of the same weights with --gguf")
        ggufs |= {f"llama.cpp {k}": str(p) for k, p in same_weights(Path(src)).items()}
    for name, g in ggufs.items():
        models[name] = (lambda g=g: _gguf_logits(g, longest, m.model.vocab_size, req.threads), Path(g).stat().st_size)
    ref = req.reference
    if ref.endswith(".gguf"):
        ref_name = f"llama.cpp {Path(ref).stem}"
        models.setdefault(ref_name, (lambda: _gguf_logits(ref, longest, m.model.vocab_size, req.threads),
                                     Path(ref).stat().st_size))
        ref = ref_name
    elif ref == FP32 and FP32 not in models:
        work_graph = bundle.root.with_name(bundle.root.name + ".work") / "export" / "model.onnx"
        if not work_graph.is_file():
            raise DataError(f"{bundle.root} ships no fp32 engine and {work_graph} is gone: pass --reference ENGINE or a .gguf")
        models["fp32 (build reference)"] = (lambda: _onnx_logits(work_graph, m.model, _plain_io(), req.threads), 0)
        ref = "fp32 (build reference)"
    if ref not in models:
        raise DataError(f"reference {req.reference!r} is neither an engine of the bundle ({', '.join(models)}) nor a .gguf")
    texts = [(kind, ids) for kind, seqs in sets.items() for ids in seqs if len(ids) >= 2]
    parts: dict[str, dict[str, list[dict]]] = {s: {n: [] for n in models} for s in sets}
    seconds = dict.fromkeys(models, 0.0)  # scoring time per model (its side of the metrics included)
    if work is None and os.access(bundle.root.parent, os.W_OK):
        work = bundle.root.parent
    with tempfile.TemporaryDirectory(prefix=".edgechat-eval-", dir=work) as tmp:
        ReferenceLogits.check_room(Path(tmp), sum(len(ids) - 1 for _, ids in texts) * m.model.vocab_size * 4)
        with ReferenceLogits(Path(tmp) / "reference-logits.f32") as store:
            for name in [ref] + [n for n in models if n != ref]:  # the reference first: it writes the store
                run = models[name][0]()
                t0 = time.perf_counter()
                for i, (kind, ids) in enumerate(tqdm(texts, desc=f"{'held-out texts' if not req.data else req.data} ({name})",
                                                     unit="text")):
                    if name == ref:  # scored against itself: the array just written, not read back
                        teacher = run(ids)
                        store.put(i, teacher)
                        got = token_metrics(teacher, teacher, np.array(ids[1:]))
                    else:
                        got = run.score(ids, lambda a, b: store.get(i, (a, b)))
                    n_bytes = len(tok.decode(ids[1:], skip_special_tokens=False).encode("utf-8"))
                    parts[kind][name].append(got | {"bytes": n_bytes})
                seconds[name] += time.perf_counter() - t0
                del run
                release_memory()  # this model's memory back before the next one loads
    out: dict = {"bundle": str(bundle.root), "reference": ref, "sets": {k: len(v) for k, v in sets.items()},
                 "data": req.data or "held-out chats (chitchat-dataset) + held-out prose (export/prose.py)",
                 "engines": {}}
    for name, (_, size) in models.items():
        out["engines"][name] = {"size_bytes": size, "score_s": round(seconds[name], 2)} | {
            k: summarize(parts[k][name]) for k in sets}
    for k in sets:
        base = out["engines"][ref][k]["perplexity"]
        for q in out["engines"].values():
            q[k]["perplexity_delta_pct"] = 100 * (q[k]["perplexity"] / base - 1)
    return out


def _plain_io() -> dict:
    from edge.io_contract import io_for_variant

    return io_for_variant("plain").to_dict()


def table_text(res: dict) -> str:
    from export.console import table

    sets = list(res["sets"])
    head = ["engine", "size"] + [f"{h} {s}" for s in sets for h in ("KL", "top-1", "ppl")]
    rows = []
    for name, q in res["engines"].items():
        row = [name, f"{q['size_bytes'] / 1e6:.1f} MB" if q["size_bytes"] else "-"]
        for s in sets:
            r = q[s]
            row += [f"{r['kl_to_fp32']:.4f}", f"{100 * r['top1_agreement']:.1f}%",
                    f"{r['perplexity']:.2f} ({r['perplexity_delta_pct']:+.1f}%)"]
        rows.append(row)
    return table(rows, head)


def run(req: EvalRequest, json_path: Path | None) -> dict:
    res = evaluate_bundle(req)
    print(f"reference: {res['reference']}; " + ", ".join(f"{k}: {n} texts" for k, n in res["sets"].items())
          + "; KL in nats per token, the same token ids for every row")
    print(table_text(res))
    if json_path:
        json_path.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return res
