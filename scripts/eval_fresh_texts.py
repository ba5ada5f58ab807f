"""Score candidate graphs and GGUFs on held-out texts that were NOT used to choose between them: the chats after
the first --skip-chats and the prose windows after the first --skip-prose tokens of `edge-export eval`'s sets
(KL to the bundle's fp32 graph, the same token ids for every row). Prints a table, writes JSON.

A quantization option chosen by looking at `edge-export eval --chats 12 --prose-tokens 2048` is checked here
on the next texts of the same held-out sets:

    python scripts/eval_fresh_texts.py smollm2.bundle --onnx share0.5=q-a/model.onnx --onnx share0.25=q-b/model.onnx \
        --gguf q4_k_m=q4_k_m.gguf --json fresh.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _pair(s: str) -> tuple[str, str]:
    name, sep, path = s.partition("=")
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"expected NAME=FILE with an existing file, got {s!r}")
    return name, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a bundle with an fp32 engine (the reference) and the candidates' I/O")
    ap.add_argument("--onnx", type=_pair, action="append", default=[], metavar="NAME=FILE",
                    help="a quantized graph with the I/O of the bundle's --io-engine")
    ap.add_argument("--gguf", type=_pair, action="append", default=[], metavar="NAME=FILE", help="a GGUF of the same weights")
    ap.add_argument("--io-engine", default="int4-weight", help="the bundle engine whose I/O the --onnx graphs share")
    ap.add_argument("--skip-chats", type=int, default=12)
    ap.add_argument("--skip-prose", type=int, default=2048)
    ap.add_argument("--chats", type=int, default=36)
    ap.add_argument("--prose-tokens", type=int, default=6144)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if min(a.skip_chats, a.skip_prose) < 0 or a.chats <= a.skip_chats or a.prose_tokens <= a.skip_prose:
        ap.error("need 0 <= --skip-chats < --chats and 0 <= --skip-prose < --prose-tokens")
    if not a.onnx and not a.gguf:
        ap.error("nothing to score: give --onnx NAME=FILE or --gguf NAME=FILE")

    from edge.bundle import Bundle
    from edge.decode.tokenizer import ChatTokenizer
    from export.bundle_eval import EvalRequest, _gguf_logits, _onnx_logits, eval_sets
    from export.evaluate import summarize, token_metrics

    b = Bundle.open(a.bundle)
    m = b.manifest
    tok = ChatTokenizer(b.path(m.tokenizer.file), m.tokenizer)
    seen = eval_sets(tok, EvalRequest(bundle=b.root, chats=max(a.skip_chats, 1), prose_tokens=max(a.skip_prose, 1)),
                     m.model.max_context)
    seen = {k: v if (a.skip_chats if k == "chats" else a.skip_prose) else [] for k, v in seen.items()}  # 0: skip none
    big = eval_sets(tok, EvalRequest(bundle=b.root, chats=a.chats, prose_tokens=a.prose_tokens), m.model.max_context)
    sets = {k: [s for s in v if tuple(s) not in {tuple(x) for x in seen[k]}] for k, v in big.items()}
    sizes = {k: {"texts": len(v), "tokens": sum(map(len, v))} for k, v in sets.items()}
    print("fresh texts:", sizes, flush=True)
    fp32 = m.engine("fp32")
    ref = _onnx_logits(b.path(fp32.file), m.model, m.engine_io(fp32), None)
    refs = {k: [ref(ids) for ids in v] for k, v in sets.items()}
    io = m.engine_io(m.engine(a.io_engine))
    rows = {}
    for kind, pairs in (("onnx", a.onnx), ("gguf", a.gguf)):
        for name, path in pairs:
            f = (_onnx_logits(Path(path), m.model, io, None) if kind == "onnx"
                 else _gguf_logits(path, m.model.max_context, m.model.vocab_size, None))
            rows[name] = {"file": str(path), "size_bytes": Path(path).stat().st_size if kind == "gguf" else None}
            for k, seqs in sets.items():
                s = summarize([token_metrics(f(ids), r, np.array(ids[1:])) for ids, r in zip(seqs, refs[k])])
                rows[name][k] = {"kl_to_fp32": s["kl_to_fp32"], "top1_agreement": s["top1_agreement"]}
            del f
    print(f"{'candidate':<24}" + "".join(f"{'KL ' + k:>12}{'top-1 ' + k:>14}" for k in sets))
    for name, r in rows.items():
        print(f"{name:<24}" + "".join(f"{r[k]['kl_to_fp32']:>12.4f}{r[k]['top1_agreement']:>14.1%}" for k in sets))
    if a.json:
        a.json.write_text(json.dumps({"sets": sizes, "skipped": {"chats": a.skip_chats, "prose_tokens": a.skip_prose},
                                      "results": rows}, indent=1))


if __name__ == "__main__":
    main()
