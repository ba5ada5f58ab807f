#!/usr/bin/env python3
"""A random-init Llama-3-shape checkpoint on disk, and what the streaming build costs to turn it into engines.

    python scripts/synthetic_checkpoint.py write /tmp/llama-3b --shape llama-3.2-3b     # bf16 safetensors shards
    python scripts/synthetic_checkpoint.py build /tmp/llama-3b /tmp/llama-3b.engines    # int8-dynamic + int4-weight

`write` writes config.json, bf16 safetensors shards (about 2 GB each, an index beside them), one tensor
generated at a time, so a model bigger than this machine's RAM can be written, and SmolLM2's tokenizer and chat
template. The weights are random: the point is memory and time, not quality. The folder builds with
`edge-export build DIR --streaming --skip-eval --int8-rounding minmax --int4-rounding minmax`.

`build` writes each engine with the streaming build (export/stream_build.py, round to nearest: GPTQ needs
calibration runs of the model), each in its own process so each peak is its own (VmHWM, export/memory.py), then
loads it in ONNX Runtime and decodes a few tokens greedily. It prints a Markdown table (docs/models.md has it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # the released configs' dims (Meta's config.json files)
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, tie_word_embeddings=False),
}
SHARD_BYTES = 2 << 30


def config(shape: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
            "bos_token_id": 128000, "eos_token_id": 128009, "torch_dtype": "bfloat16",
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, **SHAPES[shape]}


def tensors(cfg: dict):
    """(name, shape) of every weight, in a checkpoint's order."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        yield from ((f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (q, h)),
                    (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                    (f"{p}.self_attn.o_proj.weight", (h, q)), (f"{p}.post_attention_layernorm.weight", (h,)),
                    (f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                    (f"{p}.mlp.down_proj.weight", (h, i)))
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (cfg["vocab_size"], h)


def _bf16(shape: tuple[int, ...], rng, std: float) -> np.ndarray:
    """Random bf16 bits (as uint16): normal(0, std) rounded to bf16, or ones for a norm's weight."""
    if len(shape) == 1:
        return np.full(shape, 0x3F80, np.uint16)  # 1.0
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def write(dst: Path, shape: str, seed: int = 0) -> None:
    """config.json + bf16 shards; each shard's header first, then its tensors one at a time."""
    cfg = config(shape)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    shards, cur, size = [], [], 0
    for name, shp in tensors(cfg):
        nbytes = 2 * int(np.prod(shp))
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shp))
        size += nbytes
    shards.append(cur)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shp in shard:
            n = 2 * int(np.prod(shp))
            header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dst / file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name, shp in shard:
                f.write(_bf16(shp, rng, 0.02).tobytes())
        print(f"{file}: {len(shard)} tensors, {off / 1e9:.2f} GB", flush=True)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    write_tokenizer(dst)


def write_tokenizer(dst: Path) -> None:
    """SmolLM2's tokenizer and chat template (from the default GGUF), so `edge-export build` takes the folder. Its
    49,152 tokens are fewer than the model's 128,256 rows: ids past them decode to nothing (the weights are random)."""
    from transformers import AutoTokenizer

    from export.gguf_tokenizer import check_and_fix
    from export.model_source import default_gguf

    gguf = default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dst)
    check_and_fix(dst / "tokenizer.json", gguf)


def _engine(src: str, out: str, mode: str, q) -> None:
    """Child process: one engine written, its peak RSS measured; then loaded and a few tokens decoded."""
    from export import quantize, stream_build
    from export.memory import PeakRSS
    from export.weight_source import SafetensorsSource

    opts = quantize.QuantizeOptions(mode=mode, int8_rounding="minmax", int4_rounding="minmax")
    t = time.time()
    with PeakRSS() as mem:
        metrics = stream_build.write_quantized(SafetensorsSource(Path(src)), Path(out), opts)
    build_s = time.time() - t
    t = time.time()
    with PeakRSS() as run_mem:
        tokens = _decode(Path(out) / "model.onnx", json.loads((Path(src) / "config.json").read_text()))
    q.put({"mode": mode, "build_seconds": build_s, "build_peak_rss_bytes": mem.peak_bytes, "exact": mem.exact,
           "size_bytes": metrics["size_bytes"], "decode_seconds": time.time() - t,
           "decode_peak_rss_bytes": run_mem.peak_bytes, "tokens": tokens})


def _decode(path: Path, cfg: dict, steps: int = 4) -> list[int]:
    """Greedy tokens after a 5-token prompt, through ONNX Runtime with the fused graph's in-place KV buffers."""
    import onnxruntime as ort

    from edge.io_contract import FUSED_IO as io

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    L, kv, d = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    bufs = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv, 16, d), np.float32)) for _ in range(2 * L)]
    ids, past, out = np.array([[128000, 9906, 11, 1917, 0]]), 0, []
    for _ in range(steps + 1):
        b = s.io_binding()
        b.bind_output(io.logits)
        b.bind_cpu_input(io.input_ids, ids)
        b.bind_cpu_input(io.seqlens_k, np.array([past + ids.shape[1] - 1], np.int32))
        b.bind_cpu_input(io.total_sequence_length, np.array(past + ids.shape[1], np.int32))
        b.bind_cpu_input(io.logit_positions, np.array([[ids.shape[1] - 1]]))
        for name, present, v in zip(io.past_names(L), io.present_names(L), bufs):
            b.bind_ortvalue_input(name, v)
            b.bind_ortvalue_output(present, v)
        s.run_with_iobinding(b)
        logits = b.get_outputs()[0].numpy()
        assert np.isfinite(logits).all(), "non-finite logits"
        past += ids.shape[1]
        out.append(int(logits[0, -1].argmax()))
        ids = np.array([[out[-1]]])
    return out[:steps]


def build(src: Path, out: Path, modes: tuple[str, ...]) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows = []
    for mode in modes:
        q = ctx.Queue()
        p = ctx.Process(target=_engine, args=(str(src), str(out / mode), mode, q))
        p.start()
        row = q.get()
        p.join()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dst", type=Path)
    w.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    b = sub.add_parser("build")
    b.add_argument("src", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--modes", default="int8-dynamic,int4-weight")
    b.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.cmd == "write":
        write(a.dst, a.shape)
        return 0
    rows = build(a.src, a.out, tuple(a.modes.split(",")))
    print("\n| engine | build wall time | build peak RSS | engine size | load + 4 tokens peak RSS |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['build_seconds'] / 60:.1f} min | {r['build_peak_rss_bytes'] / 1e9:.2f} GB | "
              f"{r['size_bytes'] / 1e9:.2f} GB | {r['decode_peak_rss_bytes'] / 1e9:.2f} GB |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
