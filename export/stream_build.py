"""The streaming build: a checkpoint -> a quantized graph, one tensor at a time, no fp32 graph on disk.

Today's path loads the model in torch (fp32), writes the fp32 fused graph, then the quantize stage reads it back
tensor by tensor. Here the fused graph (export/fused_graph.py, the same writer) is built in memory with every
weight a promise on the checkpoint (export/weight_source.py: safetensors read at each tensor's offset, or a GGUF), the CPU
engines' quantization (export/nbits.py: int8-dynamic's 8-bit MatMulNBits, int4-weight's 4-bit) is set on those
promises, and the save computes each quantized weight from its one source tensor as it writes it into the
graph's external data. Memory: the libraries, the graph's records, and one weight (its fp32 copy and its
quantized form; the largest is the embedding / LM head) at a time.

The result is the graph the quantize stage makes from the fp32 fused graph with the same options
(tests/test_stream_build.py compares them). TensorRT's int4-qdq is written the same way from the plain graph
(export/plain_graph.py, standard ONNX ops, the traced graph's contract and names), made fp16 with its fp32
islands (export/fp16.py) and each weight's INT4 blocks computed as it is saved (export/trt_formats.py): the
quantize stage's engine, bit for bit (tests/test_plain_graph.py). GPTQ rounding reads statistics collected one decoder block at a time
with that block's weights read from the checkpoint (export/hessians.py `StreamedLayerHessians`), shared by the
build's engines on disk where it has room (export/gptq_statistics.py). `edge-export build --streaming` runs it
as the build's stages: `load` links the checkpoint's files (a safetensors folder or a GGUF file), then one
`quantize-<precision>` stage per engine (each compared with the fp32 model run one decoder block at a time on a
few prompts, export/stream_reference.py), then the evaluate stage against that block-by-block reference (its
logits on the held-out texts on disk, one engine in ONNX Runtime at a time), then the package. What it does not
do (yet): the int4 byte budget (its sensitivity measure runs the fp32 graph), int8-qdq and fp8-qdq (their
activation ranges), fp16, prune / distill / draft, the int8 K/V cache, models whose blocks differ in attention type
(Gemma 3: the block-by-block reference and statistics are refused for it), and a plain graph for the families
export/plain_graph.py does not write (Phi-3, Gemma 3, SmolLM3, sliding windows).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge import precisions
from edge.errors import RecipeError
from edge.precisions import INT4_QDQ, INT4_WEIGHT, INT8_DYNAMIC
from export.onnx_weights import INLINE_MAX, GraphWeights, graph_bytes, lm_head_matmul, untie_lm_head

STREAMED = (INT8_DYNAMIC, INT4_WEIGHT, INT4_QDQ)  # each written as its precision's graph variant (edge.precisions)


def build_graph(source, dst: Path, variant: str = "fused") -> GraphWeights:
    """The fused (or `variant` "plain": export/plain_graph.py) fp32 graph of `source` (a WeightSource) in memory:
    its large tensors read when saved."""
    from onnx import TensorProto, helper, numpy_helper

    from export import fused_graph, plain_graph
    from export.weight_source import empty_model

    cfg = source.config
    if variant == "plain":
        check_plain(cfg, ["the plain graph"])
    else:
        fused_graph.check(cfg)
    lazies: dict[str, object] = {}

    def tensor(name: str, value):
        shape = value.shape
        dtype = value.dtype
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize <= INLINE_MAX:  # small: made now, kept inline
            return numpy_helper.from_array(np.ascontiguousarray(value() if callable(value) else value), name)
        t = TensorProto()
        t.name = name
        t.dims.extend(int(d) for d in shape)
        t.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        lazies[name] = value
        return t

    proto = (plain_graph if variant == "plain" else fused_graph).graph(empty_model(cfg), source, cfg, tensor)
    return GraphWeights.in_memory(proto, dst, lazies)


def check_plain(cfg: dict, engines: list[str]) -> None:
    """Refuse a plain-graph engine of a family export/plain_graph.py does not write, naming the way out."""
    from export import plain_graph

    why = plain_graph.supported(cfg)
    if why:
        raise RecipeError(f"the streaming build cannot write {', '.join(engines)} for this model ({why}): build it "
                          "without --streaming")


def write_quantized(source, dst: Path, opts, num_layers: int | None = None, hessian=None, statistics=None) -> dict:
    """`source` (a WeightSource) -> dst/model.onnx (+ .data), quantized as the quantize stage's `opts` (a
    QuantizeOptions for int8-dynamic with the nbits kernel, or int4-weight without a byte budget) say.
    GPTQ rounding reads `hessian` (MatMul name -> its input's X^T X), or makes its statistics with
    `statistics(input_of, widths)` (the graph's MatMul name -> input, input -> K; returns an object with the
    `LayerHessians` interface, closed here) once the graph's names are known."""
    from export.onnx_weights import weight_matmuls

    if opts.mode not in STREAMED or opts.mode == INT8_DYNAMIC and opts.int8_kernel != "nbits":
        raise RecipeError(f"the streaming build makes {', '.join(STREAMED)} (int8-dynamic with the nbits kernel), not "
                          f"{opts.mode}: build it from the fp32 graph")
    if opts.mode in (INT4_WEIGHT, INT4_QDQ) and (opts.int4_budget_mb is not None or opts.int4_extra_ratio > 0):
        raise RecipeError("the streaming build has no int4 byte budget yet (its sensitivity runs the fp32 graph): "
                          "leave int4_budget_mb and int4_extra_ratio unset")
    rounding = opts.int8_rounding if opts.mode == INT8_DYNAMIC else opts.int4_rounding
    if rounding == "gptq" and hessian is None and statistics is None:
        raise RecipeError("gptq rounding needs the inputs' statistics: pass hessian= or statistics=, or round with "
                          "'minmax'")
    dst.mkdir(parents=True, exist_ok=True)
    variant = precisions.get(opts.mode).variant
    gw = build_graph(source, dst, variant)
    layers = num_layers or int(source.config["num_hidden_layers"])
    if variant == "plain":  # TensorRT's graph is fp16 with fp32 islands, as export/fp16.py makes it from the trace
        from export import fp16

        fp16.convert(gw)
    untie_lm_head(gw)
    hess = None
    if rounding == "gptq" and hessian is None:
        nodes = weight_matmuls(gw.model)
        hess = hessian = statistics({n.name: n.input[0] for n in nodes},
                                    {n.input[0]: gw.shape(n.input[1])[0] for n in nodes})
    try:
        metrics = _quantize_and_save(gw, dst, opts, layers, rounding, hessian)
    finally:
        if hess is not None:
            hess.close()
    if hess is not None:
        metrics |= {"gptq_tokens": hess.rows, "gptq_passes": hess.passes, "gptq_statistics": hess.method,
                    "gptq_statistics_loaded": getattr(hess, "loaded_from_disk", 0),
                    "gptq_statistics_computed": getattr(hess, "computed", None)}
    return metrics


def _quantize_and_save(gw, dst: Path, opts, layers: int, rounding: str, hessian) -> dict:
    """Set the engine's quantization on the streamed graph's weights, then save it (each weight computed as it
    is written)."""
    from export.embedding import quantize_embedding
    from export.nbits import quantize_matmuls
    from export.quantize import _weight_of, lm_head_block, matching_matmuls

    metrics: dict = {"mode": opts.mode, "streamed": True}
    if opts.mode == INT4_QDQ:
        from export.trt_formats import int4_qdq_graph

        metrics |= int4_qdq_graph(gw, dst, opts.int4_block_size, hessian if rounding == "gptq" else None, set(),
                                  damp=opts.int4_gptq_damp, lazy=True)
        metrics |= {"int4_block_size": opts.int4_block_size, "int4_rounding": f"{rounding} (symmetric)",
                    "size_bytes": graph_bytes(dst / "model.onnx")}
        return metrics
    if opts.mode == INT8_DYNAMIC:
        special = {name: (8, 16) for name in matching_matmuls(gw.model, tuple(opts.block16_nodes), layers)}
        quantize_matmuls(gw, bits=8, accuracy_level=opts.accuracy_level, special=special, rounding=rounding,
                         hessian=hessian, lazy=True, gptq_damp8=opts.int8_gptq_damp)
        metrics |= {"block16_nodes": sorted(special), "int8_rounding": rounding}
    else:
        head = getattr(lm_head_matmul(gw.model), "name", None)
        special = {head: (opts.int4_lm_head_bits, lm_head_block(gw.shape(_weight_of(gw, head))[0], opts))} \
            if head and opts.int4_lm_head_bits != 4 else {}
        quantize_matmuls(gw, bits=4, accuracy_level=opts.accuracy_level, symmetric=opts.int4_symmetric,
                         special=special, rounding=rounding, block_size=opts.int4_block_size, hessian=hessian,
                         lazy=True, gptq_damp4=opts.int4_gptq_damp)
        metrics |= {"lm_head_bits": opts.int4_lm_head_bits if head else None, "int4_rounding": rounding,
                    "int4_block_size": opts.int4_block_size}
    metrics["embedding_bytes_saved"] = quantize_embedding(gw)
    gw.save(dst / "model.onnx")
    metrics["size_bytes"] = graph_bytes(dst / "model.onnx")
    return metrics


def load(ref, dst: Path, chat_template: str | None = None) -> dict:
    """The load stage of a streaming build: the checkpoint's config, tokenizer and weights made available in `dst`
    without loading a weight. A Hugging Face folder's safetensors are hard-linked (copied where a link cannot be
    made); a GGUF file is linked whole and its config.json and tokenizer written from its metadata, the tokenizer
    checked against the GGUF's own (export/gguf_tokenizer.py) as the normal load stage does. `source_of(dst)`
    then reads the weights one tensor at a time."""
    import os
    import shutil
    from types import SimpleNamespace

    from transformers import AutoTokenizer, GenerationConfig

    from export.load import META, check_architecture, copy_side_files, eos_ids
    from export.weight_source import GGUFSource, SafetensorsSource

    if ref.kind not in ("hf-folder", "gguf"):
        raise RecipeError(f"the streaming build reads a local Hugging Face folder (safetensors) or a GGUF file, not "
                          f"{ref.kind} {ref.name}: download it first, or build without --streaming")
    check_architecture(ref)  # a GGUF transformers misreads is refused here, as in the normal load stage
    src = Path(ref.location)
    dst.mkdir(parents=True, exist_ok=True)

    def link(f: Path) -> None:
        (dst / f.name).unlink(missing_ok=True)
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)

    metrics: dict = {"streamed": True}
    record: dict = {"name": ref.name, "source": f"{ref.kind}:{ref.location}"}
    if ref.gguf_file:
        source = GGUFSource(src / ref.gguf_file)
        link(src / ref.gguf_file)
        (dst / "config.json").write_text(json.dumps(source.config, indent=2))
        tok = AutoTokenizer.from_pretrained(src, gguf_file=ref.gguf_file)
        record |= {"source": f"gguf:{src / ref.gguf_file}", "gguf_file": ref.gguf_file}
    else:
        source = SafetensorsSource(src)  # refuses a folder without safetensors
        for f in src.iterdir():
            if f.suffix == ".safetensors" or f.name in ("config.json", "model.safetensors.index.json"):
                link(f)
        copy_side_files(src, dst)
        tok = AutoTokenizer.from_pretrained(src)
    if chat_template is not None:
        tok.chat_template = chat_template
    if not tok.chat_template:
        raise RecipeError(f"{ref.name} has no chat template (a base model?): give it one with --chat-template FILE")
    if ref.gguf_file or chat_template is not None:
        tok.save_pretrained(dst)
    if ref.gguf_file:  # the converted tokenizer must split text as the GGUF's own does
        from export.gguf_tokenizer import check_and_fix

        metrics["tokenizer_check"] = check_and_fix(dst / "tokenizer.json", src / ref.gguf_file)
    gen = GenerationConfig.from_pretrained(src) if not ref.gguf_file and (src / "generation_config.json").is_file() \
        else GenerationConfig(eos_token_id=source.config.get("eos_token_id"))
    holder = SimpleNamespace(generation_config=gen, config=SimpleNamespace(eos_token_id=source.config.get("eos_token_id")))
    n = sum(int(np.prod(source.shape(k), dtype=np.int64)) for k in source.names())
    (dst / META).write_text(json.dumps(record | {"eos_token_ids": eos_ids(holder, tok), "num_parameters": n}, indent=2))
    return metrics | {"num_parameters": n}


def source_of(hf_dir: Path):
    """The weight source of a streaming build's load stage folder (its GGUF, or its safetensors)."""
    from export.load import META
    from export.weight_source import GGUFSource, SafetensorsSource

    gguf_file = json.loads((hf_dir / META).read_text()).get("gguf_file")
    return GGUFSource(hf_dir / gguf_file) if gguf_file else SafetensorsSource(hf_dir)


def check_options(opts) -> None:
    """What a streaming build (BuildOptions.streaming) can make, refused up front with what to change."""
    bad = [p for p in opts.precisions if p not in STREAMED]
    if bad:
        raise RecipeError(f"the streaming build makes {', '.join(STREAMED)}, not {', '.join(bad)}: drop --streaming or "
                          f"choose --precision {' --precision '.join(STREAMED)}")
    if opts.prune is not None or opts.draft is not None:
        raise RecipeError("the streaming build has no prune, distill or draft stage yet: drop --streaming for those")
    if {INT4_WEIGHT, INT4_QDQ} & set(opts.precisions) and (opts.int4_budget_mb is not None or opts.int4_extra_ratio > 0):
        raise RecipeError("the streaming build has no int4 byte budget yet: drop --int4-budget-mb / --int4-extra-ratio "
                          "(recipe keys int4_budget_mb, int4_extra_ratio) for all 4 bits, or drop --streaming")
    if getattr(opts, "kv_cache", "float") != "float":
        raise RecipeError("the streaming build writes a float K/V cache (the int8 cache's scales are calibrated on the "
                          "built engine's K/V, after the build): drop --kv-cache or --streaming")


def _engine(hf_dir: Path, dst: Path, opts, check: bool = True) -> dict:
    """One streamed engine, then (`check`) compared with the fp32 model run one block at a time on the export stage's
    parity prompts (export/stream_reference.py): the build's only quality figure when it skips the evaluate stage,
    which otherwise measures the same against the same reference on its held-out texts."""
    from export.load import model_dims
    from export.memory import release_memory
    from export.stream_reference import compare

    dims = model_dims(hf_dir)

    def statistics(input_of: dict[str, str], widths: dict[str, int]):
        from export.gptq_statistics import streamed_statistics
        from export.quantize import gptq_feeds

        source = source_of(hf_dir)
        files = [f for f in hf_dir.iterdir() if f.suffix in (".safetensors", ".gguf")]
        return streamed_statistics(source, files, dst, gptq_feeds(hf_dir, opts, dims), input_of, widths)

    metrics = write_quantized(source_of(hf_dir), dst, opts, dims.num_layers, statistics=statistics)
    if not check:
        return metrics
    release_memory()
    try:
        metrics["reference"] = compare(source_of(hf_dir), dst / "model.onnx", hf_dir, opts.mode,
                                       precisions.get(opts.mode).variant)
    except ValueError as e:  # a family the block-by-block reference does not run yet (mixed attention types)
        metrics["reference"] = {"skipped": str(e)}
    return metrics


def check_blocks(hf_dir: Path, opts) -> None:
    """Refuse before any engine is written what needs every decoder block run alike (the block-by-block reference
    of the evaluate stage, GPTQ's statistics) on a model whose blocks differ in attention type (Gemma 3's
    sliding-window and global layers: each gets its own mask), naming the flags that build it."""
    from export.weight_source import empty_model

    cfg = json.loads((hf_dir / "config.json").read_text())
    kinds = {getattr(layer, "attention_type", None) for layer in empty_model(cfg).model.layers}
    if len(kinds) < 2:
        return
    rounding = {INT8_DYNAMIC: opts.int8_rounding, INT4_WEIGHT: opts.int4_rounding, INT4_QDQ: opts.int4_rounding}
    need = ([] if opts.skip_eval else ["--skip-eval"]) + \
        [f"--{p.split('-')[0]}-rounding minmax" for p in opts.precisions if rounding[p] == "gptq"]
    if need:
        raise RecipeError(f"{cfg.get('architectures', ['this model'])[0]}'s decoder blocks differ in attention type "
                          f"({', '.join(sorted(map(str, kinds)))}), which the streaming build cannot run one block at a "
                          f"time yet (its evaluate stage's reference, GPTQ's statistics): add {' '.join(need)}, or "
                          "build without --streaming")


def stages(stage, opts, hf_dir: Path, loaded: str, quantize_options) -> tuple[list, list]:
    """The engines of a streaming build, one quantize stage each, written from the loaded checkpoint."""
    import dataclasses

    from export import package

    check_blocks(hf_dir, opts)
    plain = [p for p in opts.precisions if precisions.get(p).variant == "plain"]
    if plain:
        check_plain(json.loads((hf_dir / "config.json").read_text()), plain)
    engines, records = [], []
    for precision in opts.precisions:
        qopts = quantize_options(opts, precision)
        check = opts.skip_eval  # else the evaluate stage compares each engine with the same reference
        qdir, rec = stage(f"quantize-{precision}", dataclasses.asdict(qopts) | {"load": loaded, "streamed": True,
                                                                               "reference_check": check},
                          lambda d, q=qopts, c=check: _engine(hf_dir, d, q, c))
        records.append(rec)
        engines.append(package.EngineArtifact(precision, qdir, precision, variant=precisions.get(precision).variant))
    return engines, records


def reference_artifact(hf_dir: Path):
    """The fp32 reference of a streaming build's evaluate stage: no graph (its logits come from
    `reference_logits`), measured for the report, not shipped."""
    from edge.precisions import FP32
    from export import package

    return package.EngineArtifact(FP32, hf_dir, FP32, report_only=True, reference=True)


def reference_logits(hf_dir: Path):
    """The evaluate stage's fp32 logits on its texts: the model run one decoder block at a time from the checkpoint
    (export/stream_reference.py), each text's logits yielded in turn."""
    def run(prompts: list[list[int]]):
        from export.stream_reference import iter_reference_logits

        return iter_reference_logits(source_of(hf_dir), prompts, progress=True)
    return run
