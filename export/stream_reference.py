"""The Hugging Face model's logits with one decoder block's weights in memory at a time.

The parity reference of a model too large to load: the model's module tree is built with no weights
(export/weight_source.py `empty_model`), the first block's inputs are captured as `LayerHessians`
(export/hessians.py) captures them, then each block in turn gets its weights from the checkpoint, runs on every
prompt's hidden states and gives its memory back. Memory: one block's weights, the embedding or LM head, and the
prompts' hidden states.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from export.weight_source import EMBED, HEAD, WeightSource


class _Captured(Exception):
    pass


def _materialize(module, prefix: str, source: WeightSource) -> None:
    """Give a meta-device module its weights from `source` (names under `prefix`), as fp32 on the CPU: each
    parameter is the array read from the checkpoint itself (no empty tensor allocated and copied into: one copy
    of the embedding, not two, while it is set)."""
    import torch

    for name, _ in list(module.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._parameters[leaf] = torch.nn.Parameter(torch.from_numpy(source.get(f"{prefix}.{name}")),
                                                     requires_grad=False)


def reference_logits(source: WeightSource, prompts: list[list[int]]) -> list[np.ndarray]:
    """Logits [len(ids), vocab] for each prompt, as the fp32 HF model computes them."""
    return list(iter_reference_logits(source, prompts))


def iter_reference_logits(source: WeightSource, prompts: list[list[int]], progress: bool = False):
    """Each prompt's logits [len(ids), vocab] in turn, computed once every block has run on every prompt: one
    text's logits in memory at a time (the evaluate stage writes each to disk before the next is made)."""
    import torch
    from tqdm import tqdm

    from export.weight_source import empty_model

    model = empty_model(source.config)
    inner, layers = model.model, model.model.layers
    if len({getattr(layer, "attention_type", None) for layer in layers}) > 1:
        raise ValueError("the decoder blocks differ in attention type (each gets its own mask): no block-by-block "
                         "reference for this model yet")
    _materialize(inner.embed_tokens, "model.embed_tokens", source)
    hidden, args = [], []

    def hook(mod, a, kw):
        hidden.append(a[0] if a else kw["hidden_states"])
        args.append((a[1:], {k: v for k, v in kw.items() if k != "hidden_states"}))
        raise _Captured

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for ids in prompts:
                try:
                    inner(input_ids=torch.tensor([ids]), use_cache=False)
                except _Captured:
                    pass
    finally:
        handle.remove()
    inner.embed_tokens.to("meta")
    bar = tqdm(total=len(layers), desc="fp32 reference, block by block", unit="block", disable=not progress)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            _materialize(layer, f"model.layers.{i}", source)
            for k, (a, kw) in enumerate(args):
                out = layer(hidden[k], *a, **kw)
                hidden[k] = out[0] if isinstance(out, tuple) else out
            layer.to("meta")
            bar.update()
        bar.close()
        _materialize(inner.norm, "model.norm", source)
        head = torch.from_numpy(source.get(HEAD if source.has(HEAD) else EMBED))
        cap = getattr(model.config, "final_logit_softcapping", None)
        for k in range(len(hidden)):
            h, hidden[k] = hidden[k], None  # each text's hidden states go as its logits are made
            z = inner.norm(h)[0] @ head.T
            yield (torch.tanh(z / cap) * cap if cap else z).numpy()


def compare(source: WeightSource, graph, hf_dir, precision: str | None = None, variant: str = "fused") -> dict:
    """The streamed engine at `graph` against the block-by-block reference on the export stage's parity prompts:
    mean KL(reference || engine) per position and top-1 agreement (a quantized engine is not expected to match
    to 1e-3: these are what the evaluate stage would measure, on a few prompts, in bounded memory)."""
    from edge.backends.onnxruntime import OrtDecoder
    from edge.io_contract import io_for_variant
    from export.load import chat_tokenizer, model_dims
    from export.onnx_export import PARITY_PROMPTS

    tok = chat_tokenizer(hf_dir)
    prompts = [tok.encode_chat(m, add_generation_prompt=True) for m in PARITY_PROMPTS]
    refs = reference_logits(source, prompts)
    from export.cpu_twin import scored_graph

    scratch = Path(graph).parent / "cpu-twin"
    graph = scored_graph(graph, precision, scratch)  # int4-qdq: its CPU twin, as the evaluate stage scores it
    dec = OrtDecoder(graph, model_dims(hf_dir), io_for_variant(variant), precision=precision)  # its CPU settings
    kls, agree, n = [], 0, 0
    for ids, ref in zip(prompts, refs):
        got = dec.forward(np.array([ids]), dec.new_cache(capacity=len(ids)), last_only=False)[0]
        p, q = _log_softmax(ref), _log_softmax(got)
        kls.append(float((np.exp(p) * (p - q)).sum(-1).mean()))
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        n += len(ids)
    del dec
    shutil.rmtree(scratch, ignore_errors=True)
    return {"prompts": len(prompts), "tokens": n, "kl_to_reference": float(np.mean(kls)), "top1_agreement": agree / n,
            "reference": "fp32, one decoder block at a time"}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
