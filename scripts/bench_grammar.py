#!/usr/bin/env python
"""Which grammar engine EdgeChat uses, measured: per-token mask cost on this CPU, on a bundle's vocabulary.

For each engine installed (llguidance, outlines-core, xgrammar): compile a JSON schema against the bundle's
tokenizer, then walk a valid answer token by token, computing the allowed-token mask before each token
(timed) and advancing on it. Prints a table and writes JSON. The default bundle is SmolLM2-135M (49,152
tokens). Missing engines are skipped with the command that installs them.

  .venv/bin/python scripts/bench_grammar.py /tmp/soak/smol.bundle [--json out.json]

xgrammar needs torch and transformers as install dependencies, so it can only be measured here, never
shipped on the device side (numpy only); outlines-core compiles a schema to a regex and indexes the whole
vocabulary against it before the first token.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edge.device.probe import cpu_name  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["tea", "temples", "gardens", "trains"]},
                 "maxItems": 4},
        "score": {"type": "number"},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "score", "member"],
    "additionalProperties": False,
}
ANSWER = ('{"name": "Aiko Tanaka", "age": 34, "city": "Kyoto", "tags": ["tea", "temples", "gardens"], '
          '"score": 8.75, "member": true}')


def _run(name: str, compile_fn, tokens: list[int], vocab: int) -> dict:
    t = time.perf_counter()
    step = compile_fn()
    compile_ms = (time.perf_counter() - t) * 1e3
    times = []
    for tok in tokens:
        t = time.perf_counter()
        allowed = step.mask()
        times.append((time.perf_counter() - t) * 1e3)
        if not allowed[tok]:
            raise RuntimeError(f"{name}: token {tok} of a valid answer was masked out")
        step.advance(tok)
    return {"engine": name, "compile_ms": round(compile_ms, 1), "tokens": len(tokens),
            "mask_ms_mean": round(statistics.mean(times), 3), "mask_ms_p50": round(statistics.median(times), 3),
            "mask_ms_p95": round(sorted(times)[int(0.95 * (len(times) - 1))], 3), "mask_ms_max": round(max(times), 3),
            "vocab": vocab}


def _llguidance(tokenizer_json: str, eos: list[int], vocab: int):
    """(tokenizer build ms, compile function) for llguidance, through edge.decode.grammar (what the server runs)."""
    from edge.decode.grammar import GrammarVocab, compile_json

    t = time.perf_counter()
    gv = GrammarVocab(tokenizer_json, vocab, eos)
    tok_ms = (time.perf_counter() - t) * 1e3

    def compile_():
        m = compile_json(gv, SCHEMA).matcher()

        class Step:
            def mask(self):
                return m.allowed()

            def advance(self, tok_id):
                m.advance(tok_id)

        return Step()

    return tok_ms, compile_


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    manifest = json.loads((args.bundle / "manifest.json").read_text())
    tok_path = args.bundle / manifest["tokenizer"]["file"]
    tokenizer_json = tok_path.read_text()
    tk = Tokenizer.from_file(str(tok_path))
    vocab = manifest["model"]["vocab_size"]
    eos = manifest["tokenizer"]["eos_token_ids"]
    tokens = tk.encode(ANSWER, add_special_tokens=False).ids
    rows, skipped = [], []

    try:
        tok_ms, compile_ = _llguidance(tokenizer_json, eos, vocab)
        rows.append({**_run("llguidance", compile_, tokens, vocab), "tokenizer_ms": round(tok_ms, 1)})
    except ImportError:
        skipped.append("llguidance: pip install llguidance")

    try:
        import outlines_core

        from edge.decode.grammar import token_bytes

        t = time.perf_counter()
        by_bytes: dict[bytes, list[int]] = {}
        tbytes, special = token_bytes(tokenizer_json, vocab)
        for i, b in enumerate(tbytes):
            if b and i not in special and i != eos[0]:
                by_bytes.setdefault(b, []).append(i)
        ovocab = outlines_core.Vocabulary(eos[0], by_bytes)
        tok_ms = (time.perf_counter() - t) * 1e3

        def outlines_compile():
            regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
            guide = outlines_core.Guide(outlines_core.Index(regex, ovocab))

            class Step:
                def mask(self):
                    allowed = np.zeros(vocab, dtype=bool)
                    allowed[np.fromiter(guide.get_tokens(), dtype=np.int64)] = True
                    return allowed

                def advance(self, tok):
                    guide.advance(tok)

            return Step()

        rows.append({**_run("outlines-core", outlines_compile, tokens, vocab), "tokenizer_ms": round(tok_ms, 1)})
    except ImportError:
        skipped.append("outlines-core: pip install outlines-core")

    try:
        import xgrammar as xg

        t = time.perf_counter()
        encoded = [""] * vocab
        for s, i in tk.get_vocab().items():
            if i < vocab:
                encoded[i] = s
        info = xg.TokenizerInfo(encoded, vocab_type=xg.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
        compiler = xg.GrammarCompiler(info, max_threads=1)
        tok_ms = (time.perf_counter() - t) * 1e3

        def xgrammar_compile():
            matcher = xg.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True))
            bits = xg.allocate_token_bitmask(1, vocab)

            class Step:
                def mask(self):
                    matcher.fill_next_token_bitmask(bits, 0)
                    return np.unpackbits(bits[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)

                def advance(self, tok):
                    assert matcher.accept_token(tok)

            return Step()

        rows.append({**_run("xgrammar", xgrammar_compile, tokens, vocab), "tokenizer_ms": round(tok_ms, 1)})
    except ImportError as e:
        skipped.append(f"xgrammar: pip install xgrammar (needs torch, transformers) ({e})")

    print(f"grammar engines on {cpu_name()} ({platform.machine()}), vocabulary {vocab}, "
          f"{len(tokens)}-token JSON answer to a 6-field schema, one thread")
    head = ["engine", "tokenizer_ms", "compile_ms", "mask_ms_mean", "mask_ms_p50", "mask_ms_p95", "mask_ms_max"]
    print(" | ".join(f"{h:>13}" for h in head))
    for r in rows:
        print(" | ".join(f"{r.get(h, ''):>13}" for h in head))
    for s in skipped:
        print("skipped:", s)
    out = {"cpu": cpu_name(), "machine": platform.machine(), "bundle": str(args.bundle), "schema": SCHEMA,
           "answer": ANSWER, "rows": rows, "skipped": skipped}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
