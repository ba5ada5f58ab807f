"""What the evaluate stage's time goes to, measured under the same load (the machine is shared):

    python scripts/eval_cost.py scoring smollm2.bundle.work --chats 6 --prose 2   # metrics old vs new, interleaved
    python scripts/eval_cost.py qdq smollm2.bundle --chats 8                      # int8-qdq: Q/DQ as written vs fused

`scoring`: the stage's loop over a full recipe's six graphs, text by text, once with the old metrics (float64
log-softmaxes for each engine, the reference's recomputed each time: token_metrics_f64) and once with the new
(the reference's softmax once per text, float32 work with float64 sums: token_metrics), alternating which goes
first; forward passes and metrics timed apart. `qdq`: the int8-qdq graph on ONNX Runtime's CPU provider as
written (session.disable_quant_qdq=1, what the runtime sets for it) and with its Q/DQ fused into ORT's int8
kernels (=0): scoring and decode speed, and KL to fp32 and between the two on held-out chats. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _forward(d, ids: list[int]) -> np.ndarray:
    x = np.array([ids[:-1]])
    return d.forward(x, d.new_cache(capacity=x.shape[1]), last_only=False)[0]


def scoring(work: Path, n_chats: int, n_prose: int) -> dict:
    from edge.backends.onnxruntime import OrtDecoder
    from edge.io_contract import io_for_variant
    from export.data import load_chats
    from export.evaluate import Reference, prose_windows, token_metrics, token_metrics_f64
    from export.load import chat_tokenizer, model_dims
    from export.prose import prose_texts

    hf = work / "load"
    tok, dims = chat_tokenizer(hf), model_dims(hf, 2048)
    eng = {"fp32": (work / "export", "plain", "fp32"), "fp16": (work / "fp16", "plain", "fp16"),
           "int8-dynamic": (work / "quantize-int8-dynamic", "fused", "int8-dynamic"),
           "int8-qdq": (work / "quantize-int8-qdq", "plain", "int8-qdq"),
           "int4-weight": (work / "quantize-int4-weight", "fused", "int4-weight"),
           "int8-qdq-no-smoothquant": (work / "quantize-int8-qdq" / "no-smoothquant", "plain", "int8-qdq")}
    decs = {n: OrtDecoder(d / "model.onnx", dims, io_for_variant(v), name=n, precision=p) for n, (d, v, p) in eng.items()}
    chats = [tok.encode_chat(c, add_generation_prompt=False)[:256] for c in load_chats(None, "evaluation", n_chats)]
    prose = prose_windows(tok, prose_texts("eval"), 512, 4096)[:n_prose]
    t = {v: {"forward": 0.0, "metrics": 0.0} for v in ("old", "new")}
    per_engine = dict.fromkeys(decs, 0.0)
    toks = 0
    for ids in chats + prose:
        y = np.array(ids[1:])
        toks += len(ids) - 1
        for version in ("old", "new") if toks % 2 else ("new", "old"):  # alternate which goes first
            t0 = time.perf_counter()
            teacher = _forward(decs["fp32"], ids)
            t[version]["forward"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = Reference.of(teacher) if version == "new" else teacher
            t[version]["metrics"] += time.perf_counter() - t0
            for n, d in decs.items():
                s = teacher
                if n != "fp32":
                    t0 = time.perf_counter()
                    s = _forward(d, ids)
                    dt = time.perf_counter() - t0
                    t[version]["forward"] += dt
                    per_engine[n] += dt / 2
                t0 = time.perf_counter()
                token_metrics(s, ref, y) if version == "new" else token_metrics_f64(s, teacher, y)
                t[version]["metrics"] += time.perf_counter() - t0
    return {"texts": len(chats) + len(prose), "chats": len(chats), "prose": len(prose), "tokens": toks,
            "seconds": t, "forward_s_per_engine_mean_of_two": per_engine}


def qdq(bundle_dir: Path, n_chats: int) -> dict:
    from edge.backends.onnxruntime import OrtDecoder
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.decode.tokenizer import ChatTokenizer
    from edge.io_contract import DecoderIO
    from export.data import load_chitchat
    from export.evaluate import Reference, summarize, token_metrics

    b = Bundle.open(bundle_dir)
    m = b.manifest
    tok = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer)
    chats = [tok.encode_chat(c, add_generation_prompt=False)[:256] for c in load_chitchat("evaluation", n_chats)]

    def make(e, cfg):
        return OrtDecoder(b.path(e.file), m.model, DecoderIO.from_dict(m.engine_io(e)), threads=2,
                          precision=e.fingerprint.precision, session_config=cfg)

    q = m.engine("int8-qdq")
    decs = {"fp32": make(m.engine("fp32"), None), "qdq as written": make(q, None),
            "qdq fused kernels": make(q, {"session.disable_quant_qdq": "0"})}
    parts: dict[str, list] = {k: [] for k in ("written vs fp32", "fused vs fp32", "fused vs written")}
    secs = dict.fromkeys(decs, 0.0)
    toks = 0
    for ids in chats:
        out = {}
        for n, d in decs.items():
            t0 = time.perf_counter()
            out[n] = _forward(d, ids)
            secs[n] += time.perf_counter() - t0
        toks += len(ids) - 1
        y = np.array(ids[1:])
        r32, rw = Reference.of(out["fp32"]), Reference.of(out["qdq as written"])
        parts["written vs fp32"].append(token_metrics(out["qdq as written"], r32, y))
        parts["fused vs fp32"].append(token_metrics(out["qdq fused kernels"], r32, y))
        parts["fused vs written"].append(token_metrics(out["qdq fused kernels"], rw, y))
    res: dict = {"chats": n_chats, "tokens": toks, "scoring_tok_s": {n: toks / s for n, s in secs.items()}}
    for k, p in parts.items():
        s = summarize(p)
        res[k] = {"kl": s["kl_to_fp32"], "kl_ci95": s["kl_ci95"], "top1": s["top1_agreement"]}
    cfg = SamplingConfig(max_new_tokens=48, ignore_eos=True)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of Japan?"}])
    res["decode_tok_s"], res["answers"] = {}, {}
    for n, d in decs.items():
        g = Generator(tok, d)
        list(g.stream(prompt, cfg))  # warm-up
        res["decode_tok_s"][n] = list(g.stream(prompt, cfg))[-1].stats["decode_tok_s"]
        res["answers"][n] = g.complete(prompt, SamplingConfig(max_new_tokens=24))[0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scoring")
    s.add_argument("work", type=Path, help="a full recipe build's OUT.work folder")
    s.add_argument("--chats", type=int, default=6)
    s.add_argument("--prose", type=int, default=2)
    q = sub.add_parser("qdq")
    q.add_argument("bundle", type=Path, help="a bundle with fp32 and int8-qdq engines")
    q.add_argument("--chats", type=int, default=8)
    a = ap.parse_args()
    res = scoring(a.work, a.chats, a.prose) if a.what == "scoring" else qdq(a.bundle, a.chats)
    print(json.dumps(res | {"machine_load_at_end": open("/proc/loadavg").read().split()[:3]}, indent=1))


if __name__ == "__main__":
    main()
