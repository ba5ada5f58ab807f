"""Prune stage: a smaller model of the same architecture, chosen by what calibration chats actually use.

Importance is measured on calibration chats, as in NVIDIA's Minitron: mean |activation| of each MLP
channel (the input of down_proj), the norm of each attention head's output (the input of o_proj;
a KV head is scored with the query heads that share it, and kept or dropped with them), mean
|activation| of each hidden channel (the outputs of every RMSNorm), and for depth the block importance
1 - cos(block input, block output). Pruning is uniform across layers, so the result is a standard
checkpoint (same config.json keys, smaller numbers) that plain transformers, optimum and our export
load without special code.

Axes: depth (`drop_layers`), attention (`kv_groups` kept), hidden (`hidden_ratio`), vocabulary
(`vocab_size`: the tokens chat text uses, export/vocab.py), and the MLP width, which is solved last
so the whole model lands on `target_ratio` of the parameters (or on what fits a device, `fit`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge.errors import RecipeError
from edge.precisions import INT8_DYNAMIC
from export import vocab

METHODS = ("activation", "random")


@dataclass(frozen=True)
class PruneOptions:
    target_ratio: float | None = 0.6  # fraction of the parameters kept (embeddings included)
    fit: str | None = None  # or: a device profile the INT8 model must fit (with `fit_context`)
    fit_context: int = 4096
    drop_layers: int = 0  # whole blocks removed, least important first
    kv_groups: int | None = None  # KV heads kept per layer (each with its query heads); None: all
    hidden_ratio: float = 1.0  # hidden/embedding channels kept
    vocab_size: int | None = None  # tokens kept (embedding + LM head rows); None: the whole vocabulary
    method: str = "activation"  # or "random" (the baseline importance is compared against)
    samples: int = 64  # calibration chats used to measure importance
    max_tokens: int = 256
    multiple: int = 32  # MLP and hidden sizes rounded down to a multiple of this (kernel-friendly)
    calibration: str | None = None
    prose_samples: int = 0  # general-prose documents (export/prose.py "train") measured beside the chats
    vocab_prose: bool = False  # count the prose "train" documents' tokens too when choosing the vocabulary
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fit is None and self.target_ratio is None:
            raise RecipeError("prune needs a target: target_ratio (e.g. 0.6) or fit (a device profile)")
        if self.target_ratio is not None and not 0 < self.target_ratio <= 1:
            raise RecipeError(f"prune target_ratio must be in (0, 1] (the fraction of parameters kept), "
                              f"got {self.target_ratio}")
        if not 0 < self.hidden_ratio <= 1:
            raise RecipeError(f"prune hidden_ratio must be in (0, 1], got {self.hidden_ratio}")
        if self.drop_layers < 0:
            raise RecipeError(f"prune drop_layers must be >= 0, got {self.drop_layers}")
        if self.kv_groups is not None and self.kv_groups < 1:
            raise RecipeError(f"prune kv_groups must be >= 1 (KV heads kept per layer), got {self.kv_groups}")
        if self.method not in METHODS:
            raise RecipeError(f"prune method {self.method!r} unknown: choose from {', '.join(METHODS)}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise RecipeError(f"prune vocab_size must be >= 1 (tokens kept), got {self.vocab_size}")
        if self.samples < 1 or self.multiple < 1 or self.prose_samples < 0:
            raise RecipeError("prune samples and multiple must be >= 1, prose_samples >= 0")


@dataclass
class Importance:
    mlp: list[np.ndarray]  # per layer, [intermediate]
    heads: list[np.ndarray]  # per layer, [num_heads]
    hidden: np.ndarray  # [hidden]
    blocks: np.ndarray  # [layers], 1 - cos(in, out)
    tokens: int


def _check_arch(model) -> None:
    from export.architectures import arch_spec

    spec = arch_spec((model.config.architectures or [type(model).__name__])[0])
    if not spec.prunable:
        raise RecipeError(f"pruning does not support {spec.hf_name} yet: {spec.not_prunable}")
    inner = getattr(model, "model", None)
    layer = inner.layers[0] if inner is not None and hasattr(inner, "layers") else None
    need = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    packed = layer is not None and _get(layer, "self_attn.qkv_proj") is not None  # Phi-3: one module each
    need += ("self_attn.qkv_proj", "mlp.gate_up_proj") if packed else (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    if layer is None or any(_get(layer, n) is None for n in need) or not hasattr(inner, "embed_tokens"):
        raise RecipeError(f"pruning supports Llama-style decoders (Llama, SmolLM, Mistral, Qwen2/3, Phi-3): "
                          f"{type(model).__name__} does not have their module layout")


def _get(mod, dotted: str):
    for part in dotted.split("."):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


def measure(model, sequences: list[list[int]], method: str = "activation", seed: int = 0) -> Importance:
    """Importance of every channel, head and block, from forward passes over the sequences."""
    import torch

    _check_arch(model)
    cfg = model.config
    L, H, Hd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size
    D = getattr(cfg, "head_dim", None) or Hd // H
    if method == "random":
        g = np.random.default_rng(seed)
        return Importance([g.random(cfg.intermediate_size) for _ in range(L)], [g.random(H) for _ in range(L)],
                          g.random(Hd), g.random(L), 0)
    mlp = [torch.zeros(cfg.intermediate_size, dtype=torch.float64) for _ in range(L)]
    heads = [torch.zeros(H, dtype=torch.float64) for _ in range(L)]
    hidden = torch.zeros(Hd, dtype=torch.float64)
    blocks = torch.zeros(L, dtype=torch.float64)
    hooks = []

    def add(mod, fn, pre=False):
        def hook(*a):  # a hook that returns something replaces the module's input/output: return None
            fn(*a)

        hooks.append(mod.register_forward_pre_hook(hook) if pre else mod.register_forward_hook(hook))

    for i, layer in enumerate(model.model.layers):
        add(layer.mlp.down_proj, lambda m, a, i=i: mlp[i].add_(a[0].abs().sum((0, 1)).double()), pre=True)
        add(layer.self_attn.o_proj,
            lambda m, a, i=i: heads[i].add_(a[0].reshape(*a[0].shape[:2], H, D).norm(dim=-1).sum((0, 1)).double()),
            pre=True)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            add(norm, lambda m, a, out: hidden.add_(out.abs().sum((0, 1)).double()))

        def block(m, args, kwargs, out, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            blocks[i] += (1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).sum().double()

        hooks.append(layer.register_forward_hook(block, with_kwargs=True))
    add(model.model.norm, lambda m, a, out: hidden.add_(out.abs().sum((0, 1)).double()))
    tokens = 0
    try:
        with torch.no_grad():
            for ids in tqdm(sequences, desc="prune: measure importance", unit="chat"):
                model(torch.tensor([ids]))
                tokens += len(ids)
    finally:
        for h in hooks:
            h.remove()
    n = max(tokens, 1)
    return Importance([(m / n).numpy() for m in mlp], [(h / n).numpy() for h in heads], (hidden / n).numpy(),
                      (blocks / n).numpy(), tokens)


@dataclass(frozen=True)
class Shape:
    layers: list[int]  # original indices of the blocks kept
    kv_groups: int
    hidden: int
    intermediate: int
    vocab: int | None = None  # tokens kept; None: all


def _config_for(cfg, shape: Shape):
    new = cfg.__class__.from_dict(cfg.to_dict())
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    new.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    new.num_hidden_layers = len(shape.layers)
    new.num_key_value_heads = shape.kv_groups
    new.num_attention_heads = shape.kv_groups * rep
    new.hidden_size = shape.hidden
    new.intermediate_size = shape.intermediate
    if shape.vocab is not None:
        new.vocab_size = shape.vocab
    for per_layer in ("layer_types", "no_rope_layers"):  # per-layer lists follow the blocks kept (SmolLM3, Gemma 3)
        if getattr(cfg, per_layer, None):
            setattr(new, per_layer, [getattr(cfg, per_layer)[i] for i in shape.layers])
    return new


def count_params(cfg, shape: Shape | None = None) -> int:
    """Parameters of the model a config (optionally reshaped) describes; tied weights counted once."""
    import torch
    from transformers import AutoModelForCausalLM

    c = _config_for(cfg, shape) if shape else cfg
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(c)
    return sum(p.numel() for p in m.parameters())


def fit_ratio(hf_dir: Path, profile: str, context: int, precision: str = INT8_DYNAMIC) -> float:
    """The largest fraction of the parameters whose `precision` model fits `profile` at `context`."""
    from edge.device.profiles import load_profile
    from export.load import model_dims
    from export.planner import PlanOptions, plan

    dims = model_dims(hf_dir)
    prof = load_profile(profile)
    opts = PlanOptions(context=context, prompt_tokens=min(256, context))
    scaled = lambda r: type(dims)(**{**dims.__dict__, "num_parameters": int(dims.num_parameters * r)})  # noqa: E731
    if plan(scaled(1.0), prof, precision, opts).fits:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if plan(scaled(mid), prof, precision, opts).fits else (lo, mid)
    if lo < 0.05:
        raise RecipeError(f"even 5% of {dims.num_parameters / 1e6:.0f}M parameters does not fit {profile} at "
                          f"{context} tokens (the KV cache alone is too large): lower --fit-context")
    return lo


def solve_shape(cfg, imp: Importance, opts: PruneOptions, target_ratio: float, vocab: int | None = None) -> Shape:
    """Depth, heads and hidden as asked; then the widest MLP that keeps the model within target_ratio."""
    L, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    if opts.drop_layers >= L:
        raise RecipeError(f"prune drop_layers={opts.drop_layers} but the model has {L} layers: keep at least one")
    groups = opts.kv_groups if opts.kv_groups is not None else kv
    if groups > kv:
        raise RecipeError(f"prune kv_groups={groups} but the model has {kv} KV heads per layer "
                          f"({cfg.num_attention_heads} query heads): choose 1..{kv}")
    keep_layers = sorted(np.argsort(-imp.blocks, kind="stable")[: L - opts.drop_layers].tolist())
    m = opts.multiple
    hidden = cfg.hidden_size if opts.hidden_ratio >= 1 else max(m, int(cfg.hidden_size * opts.hidden_ratio) // m * m)
    rope = getattr(cfg, "rope_scaling", None) or {}
    if rope.get("type", rope.get("rope_type")) == "longrope" and getattr(cfg, "model_type", "") == "phi3" and (
            hidden * cfg.num_attention_heads != cfg.hidden_size * groups * (cfg.num_attention_heads // kv)):
        raise RecipeError("Phi-3's config checks its LongRoPE factors against hidden_size / num_attention_heads, "
                          "so pruning must keep that ratio: prune depth (drop_layers) and the MLP only, or keep "
                          "hidden_ratio and kv_groups in proportion")
    full = count_params(cfg)
    budget = int(full * target_ratio)
    shape = lambda inter: Shape(keep_layers, groups, hidden, inter, vocab)  # noqa: E731
    top = cfg.intermediate_size
    if count_params(cfg, shape(top)) <= budget:
        return shape(top)
    if count_params(cfg, shape(m)) > budget:
        raise RecipeError(f"cannot reach {target_ratio:.0%} of the parameters by narrowing the MLP alone "
                          f"(at its narrowest the model keeps {count_params(cfg, shape(m)) / full:.0%}): also drop "
                          "layers (drop_layers), attention groups (kv_groups), hidden channels (hidden_ratio) or "
                          "tokens (vocab_size)")
    lo, hi = 1, top // m  # in units of `multiple`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count_params(cfg, shape(mid * m)) <= budget else (lo, mid - 1)
    return shape(lo * m)


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    return np.sort(np.argsort(-scores, kind="stable")[:k])


def prune_state(model, imp: Importance, shape: Shape, vocab_ids: list[int] | None = None):
    """The pruned model: a fresh model of the smaller config, loaded with the kept rows and columns
    (`vocab_ids`: the token rows of the embedding and LM head kept, with shape.vocab)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = model.config
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    new_cfg = _config_for(cfg, shape)
    hid = torch.from_numpy(_top(imp.hidden, shape.hidden))
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    ix = lambda t, dim, idx: t.index_select(dim, idx)  # noqa: E731
    tok_rows = lambda t: ix(t, 0, torch.as_tensor(vocab_ids)) if vocab_ids is not None else t  # noqa: E731
    out["model.embed_tokens.weight"] = ix(tok_rows(sd["model.embed_tokens.weight"]), 1, hid)
    out["model.norm.weight"] = ix(sd["model.norm.weight"], 0, hid)
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ix(tok_rows(sd["lm_head.weight"]), 1, hid)
        if "lm_head.bias" in sd:
            out["lm_head.bias"] = tok_rows(sd["lm_head.bias"])
    for new_i, old_i in enumerate(shape.layers):
        p, q = f"model.layers.{old_i}.", f"model.layers.{new_i}."
        group_score = imp.heads[old_i].reshape(cfg.num_key_value_heads, rep).sum(1)
        groups = _top(group_score, shape.kv_groups)
        qh = np.concatenate([np.arange(g * rep, (g + 1) * rep) for g in groups])
        q_rows = torch.from_numpy(np.concatenate([np.arange(h * D, (h + 1) * D) for h in qh]))
        kv_rows = torch.from_numpy(np.concatenate([np.arange(g * D, (g + 1) * D) for g in groups]))
        ch = torch.from_numpy(_top(imp.mlp[old_i], shape.intermediate))
        rows = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows,
                "mlp.gate_proj": ch, "mlp.up_proj": ch}
        if p + "self_attn.qkv_proj.weight" in sd:  # Phi-3's packed modules: the same rows, at each part's offset
            nq, nkv, inter = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.intermediate_size
            rows = {"self_attn.qkv_proj": torch.cat([q_rows, nq + kv_rows, nq + nkv + kv_rows]),
                    "mlp.gate_up_proj": torch.cat([ch, inter + ch])}
        cols = {"self_attn.o_proj": q_rows, "mlp.down_proj": ch}
        for name, r in rows.items():
            out[q + name + ".weight"] = ix(ix(sd[p + name + ".weight"], 0, r), 1, hid)
            if p + name + ".bias" in sd:
                out[q + name + ".bias"] = ix(sd[p + name + ".bias"], 0, r)
        for name, c in cols.items():
            out[q + name + ".weight"] = ix(ix(sd[p + name + ".weight"], 1, c), 0, hid)
            if p + name + ".bias" in sd:
                out[q + name + ".bias"] = ix(sd[p + name + ".bias"], 0, hid)
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[q + name + ".weight"] = ix(sd[p + name + ".weight"], 0, hid)
        for k, v in sd.items():  # anything else a variant carries per layer (e.g. q/k norms), kept as is if it fits
            if k.startswith(p) and q + k[len(p):] not in out:
                out[q + k[len(p):]] = v
    small = AutoModelForCausalLM.from_config(new_cfg)
    missing, unexpected = small.load_state_dict(out, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and new_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RecipeError(f"pruning {type(model).__name__} left weights unmatched (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}): this variant of the architecture is not supported")
    if new_cfg.tie_word_embeddings:
        small.tie_weights()
    return small.eval()


def calibration_sequences(hf_dir: Path, source: str | None, samples: int, max_tokens: int,
                          prose: int = 0) -> list[list[int]]:
    """Calibration chats (and `prose` general-prose "train" documents), as token ids cut at max_tokens.

    Why prose: importance measured on small talk alone keeps the channels small talk uses; a student meant
    to stay a general model is measured on general text too (as Minitron calibrates on pretraining data)."""
    from export.data import load_chats
    from export.load import chat_tokenizer

    tok = chat_tokenizer(hf_dir)
    seqs = [tok.encode_chat(c, add_generation_prompt=False)[:max_tokens] for c in load_chats(source, "calibration", samples)]
    if prose:
        from export.mixture import prose_train

        seqs += [tok.encode(t)[:max_tokens] for t in prose_train(prose)]
    return [s for s in seqs if len(s) >= 2]


def run(hf_dir: Path, dst: Path, opts: PruneOptions) -> dict:
    """Prune the model in hf_dir into dst (a Hugging Face folder, like the load stage's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.load import META, copy_side_files

    torch.manual_seed(opts.seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    _check_arch(model)
    target = opts.target_ratio if opts.fit is None else fit_ratio(hf_dir, opts.fit, opts.fit_context)
    if opts.fit is not None and opts.target_ratio is not None:
        target = min(target, opts.target_ratio)
    seqs = calibration_sequences(hf_dir, opts.calibration, opts.samples, opts.max_tokens, opts.prose_samples)
    imp = measure(model, seqs, opts.method, opts.seed)
    kept, coverage = None, None
    if opts.vocab_size is not None and opts.vocab_size != model.config.vocab_size:
        counts = vocab.token_counts(hf_dir, opts.calibration)
        if opts.vocab_prose:
            from export.load import chat_tokenizer
            from export.mixture import prose_train

            tok = chat_tokenizer(hf_dir)
            for text in prose_train():
                counts.update(tok.encode(text))
        kept = vocab.choose(json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8")), counts, opts.vocab_size)
        kept_set = set(kept)
        coverage = sum(c for i, c in counts.items() if i in kept_set) / max(1, sum(counts.values()))
    shape = solve_shape(model.config, imp, opts, target, len(kept) if kept else None)
    small = prune_state(model, imp, shape, kept)
    small.save_pretrained(dst)
    copy_side_files(hf_dir, dst)
    if kept:
        t_map = vocab.teacher_ids(hf_dir)
        vocab.write_trimmed(dst, kept, t_map.tolist() if t_map is not None else None)
    before = sum(p.numel() for p in model.parameters())
    after = sum(p.numel() for p in small.parameters())
    meta = json.loads((hf_dir / META).read_text())
    meta |= {"num_parameters": after, "pruned_from": {"name": meta["name"], "num_parameters": before},
             "pruned_layers": shape.layers}
    (dst / META).write_text(json.dumps(meta, indent=2))
    cfg = model.config
    dropped = sorted(set(range(cfg.num_hidden_layers)) - set(shape.layers))
    return {
        "method": opts.method, "importance": "mean |activation| (MLP, hidden), head output norm, 1 - cos per block"
        if opts.method == "activation" else "random (baseline)",
        "calibration_tokens": imp.tokens, "target_ratio": round(target, 4),
        "params_before": before, "params_after": after, "ratio": round(after / before, 4),
        "layers": f"{cfg.num_hidden_layers} -> {len(shape.layers)}", "dropped_layers": dropped,
        "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} -> "
                 f"{small.config.num_attention_heads}/{small.config.num_key_value_heads} (query/KV)",
        "hidden": f"{cfg.hidden_size} -> {shape.hidden}",
        "intermediate": f"{cfg.intermediate_size} -> {shape.intermediate}",
        "vocab": f"{cfg.vocab_size} -> {small.config.vocab_size}",
        "vocab_coverage": round(coverage, 5) if coverage is not None else None,
        "vocab_counted": "chat + prose" if opts.vocab_prose else "chat",
        "prose_samples": opts.prose_samples,
        "block_importance": [round(float(x), 5) for x in imp.blocks],
    }


def describe(metrics: dict) -> str:
    return (f"{metrics['params_before'] / 1e6:.1f}M -> {metrics['params_after'] / 1e6:.1f}M parameters "
            f"({metrics['ratio']:.0%}); layers {metrics['layers']}, heads {metrics['heads']}, hidden {metrics['hidden']}, "
            f"MLP {metrics['intermediate']}"
            + (f", vocabulary {metrics['vocab']} ({metrics['vocab_coverage']:.1%} of the "
               f"{metrics.get('vocab_counted', 'chat')} tokens kept)"
               if metrics.get("vocab_coverage") is not None else ""))

