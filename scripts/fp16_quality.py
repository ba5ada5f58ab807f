"""What the fp16 graph's fp32 islands buy on a real model: the figures in docs/tensorrt.md.

    .venv/bin/python scripts/fp16_quality.py [--model default] [--work DIR] [--chats 8] [--typed-tokens 48]

Exports the model's plain fp32 graph (export/onnx_export.py, no fused graph; reused from --work when there),
converts it with export/fp16.py with all islands, with the norms alone in fp32, with everything but the norms,
and with none, then prints, on held-out chats:
- ONNX Runtime CPU, fp16 graph against fp32: mean KL per position, top-1 agreement, max |logit difference|
  (ONNX Runtime CPU computes the fp16 graph's MatMuls and elementwise ops in fp32: this measures fp16 weights
  and K/V);
- onnx's reference evaluator (every op in its declared type, as a strongly typed TensorRT network) on the
  first chat's first --typed-tokens tokens, per variant;
- the largest |x| entering an RMSNorm in the fp32 graph, and how many norms see |x| > 256 (x**2 > 65504).
About 4 minutes for SmolLM2-135M on 2 cores (the export's parity check is most of it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    import onnx
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from export import load, onnx_export
    from export.data import load_chats
    from export.evaluate import log_softmax
    from export.fp16 import Fp16Options, run
    from export.load import chat_tokenizer
    from export.model_source import resolve

    # numpy's fp16 Sigmoid warns where exp(-x) overflows (its result, 0, is right); x**2 overflowing is the point
    np.seterr(over="ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--work", default="fp16-quality.work")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--typed-tokens", type=int, default=48)
    a = ap.parse_args()
    work = Path(a.work)
    if not (work / "load" / "config.json").exists():
        (work / "load").mkdir(parents=True, exist_ok=True)
        load.run(resolve(a.model), work / "load")
    if not (work / "export" / "model.onnx").exists():
        (work / "export").mkdir(exist_ok=True)
        onnx_export.run(work / "load", work / "export", onnx_export.ExportOptions(fused=False, greedy_tokens=16))
    norm = r"/[A-Za-z0-9_]*norm/"
    variants = {"islands": Fp16Options(),
                "norms only": Fp16Options(fp32_scopes=(norm,), fp32_softmax=False, check_islands=False),
                "all but norms": Fp16Options(fp32_scopes=(r"/rotary_emb/",), check_islands=False),
                "none": Fp16Options(fp32_scopes=(), fp32_softmax=False, check_islands=False)}
    for name, opts in variants.items():
        dst = work / name.replace(" ", "-")
        dst.mkdir(exist_ok=True)
        t = time.perf_counter()
        m = run(work / "export", dst, opts)
        print(f"{name}: converted in {time.perf_counter() - t:.1f} s, {m['size_bytes'] / 1e6:.1f} MB "
              f"({m['size_ratio']:.3f} of fp32)")

    cfg = json.loads((work / "load" / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

    def feeds(ids: list[int], dtype) -> dict:
        n = len(ids)
        f = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
        for i in range(layers):
            for kv in ("key", "value"):
                f[f"past_key_values.{i}.{kv}"] = np.zeros((1, kv_heads, 0, head_dim), dtype)
        return f

    def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, int, float]:
        lr, lg = log_softmax(ref), log_softmax(got)
        return float((np.exp(lr) * (lr - lg)).sum()), int((ref.argmax(-1) == got.argmax(-1)).sum()), \
            float(np.abs(ref - got).max())

    tok = chat_tokenizer(work / "load")
    texts = [tok.encode_chat(c, add_generation_prompt=False)[:256] for c in load_chats(None, "evaluation", a.chats)]
    s32 = ort.InferenceSession(str(work / "export" / "model.onnx"))
    s16 = ort.InferenceSession(str(work / "islands" / "model.onnx"))
    kl = agree = n = 0
    worst = 0.0
    for ids in texts:
        k, ag, d = compare(s32.run(["logits"], feeds(ids, np.float32))[0][0],
                           s16.run(["logits"], feeds(ids, np.float16))[0][0])
        kl, agree, n, worst = kl + k, agree + ag, n + len(ids), max(worst, d)
    print(f"ONNX Runtime CPU, {len(texts)} held-out chats ({n} positions): mean KL {kl / n:.2e}, top-1 {agree / n:.4f}, "
          f"max |dlogit| {worst:.3f}")
    ids = texts[0][: a.typed_tokens]
    ref = s32.run(["logits"], feeds(ids, np.float32))[0][0]
    for name in variants:
        t = time.perf_counter()
        got = ReferenceEvaluator(onnx.load(str(work / name.replace(" ", "-") / "model.onnx"))).run(
            ["logits"], feeds(ids, np.float16))[0][0]
        k, ag, d = compare(ref, got)
        print(f"fp16 arithmetic (reference evaluator, {len(ids)} tokens, {time.perf_counter() - t:.0f} s), {name}: "
              f"mean KL {k / len(ids):.2e}, top-1 {ag / len(ids):.3f}, max |dlogit| {d:.3f}")
    model = onnx.load(str(work / "export" / "model.onnx"))
    into = [n.input[0] for n in model.graph.node if n.op_type == "Pow"]
    model.graph.output.extend([onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None) for x in into])
    peaks = [float(np.abs(v).max()) for v in ort.InferenceSession(model.SerializeToString()).run(into, feeds(ids, np.float32))]
    print(f"largest |x| into a norm: {max(peaks):.0f}; norms with |x| > 256 (x**2 past fp16's 65504): "
          f"{sum(p > 256 for p in peaks)} of {len(peaks)}")


if __name__ == "__main__":
    main()
