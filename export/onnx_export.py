"""Export stage: HF folder -> ONNX decoder graphs (prefill + decode) with a KV cache.

Two variants of the same network:
- `model.onnx`, the plain graph (`edge.io_contract.DecoderIO`, standard ops): what TensorRT
  and the int8-qdq recipe build from. Written op by op from the weights where export/plain_graph.py
  covers the family, else traced by optimum-onnx's exporter (`text-generation-with-past`); both sit
  behind `EXPORTERS` (ExportOptions.exporter).
- `fused/model.onnx`, the fused graph (`FUSED_IO`, ONNX Runtime contrib ops, in-place KV
  buffer; see export/fused_graph.py), when the architecture has one: what the CPU/CUDA
  INT8 and INT4 engines are quantized from.
The parity check is part of the stage, for each graph: PyTorch vs ONNX Runtime logits on
several prompts, KV-cache decode vs full recompute, and greedy tokens for 64 steps.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edge.errors import MissingDependencyError, ParityError
from edge.io_contract import FUSED_IO, DecoderIO
from export.architectures import arch_spec, dims_from_hf_config

PARITY_PROMPTS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Hi! How are you today?"}, {"role": "assistant", "content": "Great, thanks!"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]


@dataclass(frozen=True)
class ExportOptions:
    opset: int = 18  # optimum's recommended minimum for these decoders; TensorRT 10's parser reads 9-20
    # "optimum" (the trace), "ops" (the plain graph written op by op, export/plain_graph.py: Llama, Mistral, Qwen2,
    # Qwen3; no trace's second copy of the weights: half the 1.5B's export memory) or "auto" (ops where it covers the
    # family, else the trace): the default since 2026-12-07 (docs/models.md says why not before)
    exporter: str = "auto"
    parity_atol: float = 1e-3
    greedy_tokens: int = 64
    fused: bool = True  # also write the fused graph (when the architecture has one)


def _export_optimum(src: Path, dst: Path, opts: ExportOptions) -> None:
    try:
        from optimum.exporters.onnx import main_export
    except ImportError:
        raise MissingDependencyError("optimum-onnx", "ONNX export", "pip install 'edgechat[export]'") from None
    cfg = json.loads((src / "config.json").read_text())
    spec = arch_spec((cfg.get("architectures") or ["LlamaForCausalLM"])[0])
    main_export(str(src), output=str(dst), task=spec.optimum_task, opset=opts.opset, device="cpu",
                do_validation=False, no_post_process=True,  # its tied-weight pass serialises the whole graph:
                # past 2 GB it fails (ByteSize), so tie_lm_head does the same job one tensor at a time
                **_with_position_ids(src, spec.optimum_task))


def _with_position_ids(src: Path, task: str) -> dict:
    """main_export's custom_onnx_configs when optimum's config for this model type has no position_ids input
    (Gemma's: the trace would count positions from the past length, wrong for the runtime's left-padded rows):
    the same config with the input added, as optimum's own Llama config has it."""
    import optimum.exporters.onnx.model_configs  # noqa: F401 - registers optimum's configs with the TasksManager
    from optimum.exporters.onnx.config import TextDecoderWithPositionIdsOnnxConfig
    from optimum.exporters.tasks import TasksManager
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
    make = TasksManager.get_exporter_config_constructor("onnx", task=task, model_type=config.model_type,
                                                        library_name="transformers")
    onnx_config = make(config)
    if "position_ids" in onnx_config.inputs:
        return {}
    cls = type(f"{type(onnx_config).__name__}WithPositionIds", (TextDecoderWithPositionIdsOnnxConfig, type(onnx_config)), {})
    return {"custom_onnx_configs": {"model": cls(config, **make.keywords, use_past_in_inputs=True)}}


def tie_lm_head(path: Path) -> bool:
    """Store a tied LM head once: when the head MatMul's weight is exactly the embedding table transposed,
    read it as Transpose(embedding) (what optimum's post-processing writes, without its 2 GB limit).

    The quantize stage recognises that pattern and stores one INT8 table for both. True if it tied."""
    from onnx import helper

    from export.onnx_weights import GraphWeights, lm_head_matmul

    gw = GraphWeights(path)
    g = gw.model.graph
    inits = gw.names()
    head = lm_head_matmul(gw.model)
    ids = {i.name for i in g.input}
    table = next((n.input[0] for n in g.node if n.op_type == "Gather" and n.input[0] in inits and n.input[1] in ids
                  and len(gw.shape(n.input[0])) == 2), None)
    if head is None or table is None or gw.shape(head.input[1]) != gw.shape(table)[::-1]:
        return False
    w, e = gw.array(head.input[1]), gw.array(table)
    same = all(np.array_equal(w[:, i:i + 4096], e[i:i + 4096].T) for i in range(0, e.shape[0], 4096))
    del w, e
    if not same:
        return False
    old = head.input[1]
    g.node.insert(list(g.node).index(head), helper.make_node("Transpose", [table], [table + "_T"],
                                                             name="/lm_head/TransposeTied", perm=[1, 0]))
    head.input[1] = table + "_T"
    if not any(old in n.input for n in g.node):
        gw.remove(old)
    gw.save(path)
    return True


def _export_ops(src: Path, dst: Path, opts: ExportOptions) -> None:
    """The plain graph written op by op from the HF folder's weights, one tensor at a time (export/plain_graph.py):
    no trace, so no second copy of the model's weights in memory."""
    import onnx

    from export import plain_graph
    from export.onnx_weights import TensorFile
    from export.weight_source import SafetensorsSource, empty_model

    cfg = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    with TensorFile(dst / "model.onnx.data") as data:
        proto = plain_graph.graph(empty_model(cfg), SafetensorsSource(src), cfg,
                                  lambda name, value: data.tensor(name, value() if callable(value) else value),
                                  opts.opset)
    onnx.save_model(proto, str(dst / "model.onnx"))


EXPORTERS: dict[str, Callable[[Path, Path, ExportOptions], None]] = {"optimum": _export_optimum, "ops": _export_ops}


def exporter_for(src: Path, asked: str) -> str:
    """"auto": the op-by-op writer where it covers the family (export/plain_graph.py), else optimum's trace."""
    if asked != "auto":
        if asked not in EXPORTERS:
            raise ValueError(f"unknown exporter {asked!r}: choose auto, {', '.join(EXPORTERS)}")
        return asked
    from export import plain_graph

    return "optimum" if plain_graph.supported(json.loads((src / "config.json").read_text())) else "ops"


def run(src: Path, dst: Path, opts: ExportOptions = ExportOptions()) -> dict:
    tmp = dst / "optimum-out"
    exporter = exporter_for(src, opts.exporter)
    EXPORTERS[exporter](src, tmp, opts)
    for name in ("model.onnx", "model.onnx_data", "model.onnx.data"):
        if (tmp / name).exists():
            shutil.move(str(tmp / name), dst / name)
    shutil.rmtree(tmp, ignore_errors=True)
    tied = tie_lm_head(dst / "model.onnx") if exporter == "optimum" else dims_from_hf_config(
        json.loads((src / "config.json").read_text())).tie_word_embeddings  # the op-by-op graph writes it tied
    if tied and (dst / "model.onnx_data").exists():  # the exporter's data file, now rewritten as model.onnx.data
        (dst / "model.onnx_data").unlink()
    # The PyTorch reference answers every parity prompt first; the fused graph is written from the same
    # loaded model; then the model is freed before any ONNX Runtime session loads its copy of the weights,
    # so the stage never holds torch's and ORT's weights at once.
    refs = TorchReference(src, opts.greedy_tokens)
    refs.compute(PARITY_PROMPTS)
    why = None
    if opts.fused:
        from export import fused_graph

        why = fused_graph.supported(json.loads((src / "config.json").read_text()))
        if not why:
            fused_graph.write(src, dst / FUSED_DIR, model=refs.model, opset=opts.opset)
    refs.release()
    metrics = check_parity(src, dst / "model.onnx", opts, refs=refs) | {"lm_head_tied": tied}
    if opts.fused:
        if why:
            metrics["fused"] = {"written": False, "reason": why}
        else:
            metrics["fused"] = {"written": True} | check_parity(src, dst / FUSED_DIR / "model.onnx", opts, FUSED_IO, refs=refs)
    return metrics | {"exporter": exporter}


FUSED_DIR = "fused"  # sub-folder of the export stage that holds the fused graph


class TorchReference:
    """The PyTorch model's logits and greedy tokens per parity prompt, computed once for every graph checked."""

    def __init__(self, src: Path, greedy_tokens: int) -> None:
        self.src, self.n, self._cache = src, greedy_tokens, {}
        self._model = self._tok = None

    @property
    def model(self):
        """The fp32 torch model (loaded on first use)."""
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self._model = AutoModelForCausalLM.from_pretrained(self.src, dtype=torch.float32).eval()
            self._tok = AutoTokenizer.from_pretrained(self.src)
        return self._model

    def compute(self, prompts: list[list[dict]]) -> None:
        for i, msgs in enumerate(prompts):
            self(i, msgs)

    def release(self) -> None:
        """Free the torch model (the answers stay cached)."""
        import gc

        self._model = None
        gc.collect()

    def __call__(self, i: int, msgs: list[dict]) -> tuple[list[int], np.ndarray, list[int]]:
        if i not in self._cache:
            import torch

            self.model  # noqa: B018 - loads it and the tokenizer
            ids = self._tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = list(ids)
            with torch.no_grad():
                logits = self._model(torch.tensor([ids])).logits[0].numpy()
            self._cache[i] = (ids, logits, _greedy_torch(self._model, ids, self.n))
        return self._cache[i]


def check_parity(src: Path, onnx_path: Path, opts: ExportOptions, io: DecoderIO = DecoderIO(),
                 prompts: list[list[dict]] = PARITY_PROMPTS, refs: TorchReference | None = None) -> dict:
    """Compare the ONNX graph with the PyTorch model it came from; raise ParityError listing every failure."""
    from edge.backends.onnxruntime import OrtDecoder

    refs = refs or TorchReference(src, opts.greedy_tokens)
    dims = dims_from_hf_config(json.loads((src / "config.json").read_text()))
    dec = OrtDecoder(onnx_path, dims, io)
    problems, max_diff, cache_diff = [], 0.0, 0.0
    greedy_ok = True
    for i, msgs in enumerate(prompts):
        ids, ref, t_ids = refs(i, msgs)
        # full-sequence logits, no past
        got = dec.forward(np.array([ids]), dec.new_cache(capacity=len(ids)), last_only=False)[0]
        d = float(np.abs(got - ref).max())
        max_diff = max(max_diff, d)
        if d > opts.parity_atol:
            problems.append(f"prompt {i}: max |Δlogit| {d:.2e} > {opts.parity_atol:.0e}")
        # KV-cache decode must equal full recompute
        cache = dec.new_cache(capacity=len(ids))
        dec.forward(np.array([ids[:-1]]), cache)
        step = dec.forward(np.array([[ids[-1]]]), cache)[0]
        cd = float(np.abs(step - got[-1]).max())
        cache_diff = max(cache_diff, cd)
        if cd > opts.parity_atol:
            problems.append(f"prompt {i}: cached decode differs from full recompute by {cd:.2e}")
        # greedy tokens, EOS ignored, same number of steps
        o_ids = _greedy_onnx(dec, ids, opts.greedy_tokens)
        if t_ids != o_ids:
            greedy_ok = False
            first = next(k for k, (a, b) in enumerate(zip(t_ids, o_ids)) if a != b)
            problems.append(f"prompt {i}: greedy tokens differ from step {first} of {opts.greedy_tokens}")
    metrics = {"max_abs_logit_diff": max_diff, "max_cache_vs_recompute_diff": cache_diff,
               "greedy_tokens_identical": greedy_ok, "greedy_tokens": opts.greedy_tokens, "prompts": len(prompts),
               "atol": opts.parity_atol}
    if problems:
        raise ParityError([f"{onnx_path.parent.name}/{onnx_path.name}: {p}" for p in problems])
    return metrics


def _greedy_torch(model, ids: list[int], n: int) -> list[int]:
    import torch

    out, past = [], None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = model(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            t = int(r.logits[0, -1].argmax())
            out.append(t)
            x = torch.tensor([[t]])
    return out


def _greedy_onnx(dec, ids: list[int], n: int) -> list[int]:
    cache = dec.new_cache(capacity=len(ids) + n)
    logits = dec.forward(np.array([ids]), cache)[0]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = dec.forward(np.array([[t]]), cache)[0]
    return out
