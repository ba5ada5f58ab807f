"""Draft stage: a small model cut from the target, distilled on the target's own answers, quantized and
shipped inside the target's bundle, so `edge-chat` speculates with it by default (edge.decode.speculative).

Why built from the target: a draft must spell every token as the target does and agree with its choices.
Dropping the target's least important blocks keeps its tokenizer, embedding and LM head; distilling on
answers the target wrote teaches the draft exactly what it is checked against. The acceptance rate that
decides whether drafting pays is measured here, on held-out chats, with the runtime that ships.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge.errors import RecipeError
from edge.precisions import INT4_WEIGHT, INT8_DYNAMIC
from export.distill import DistillOptions
from export.prune import PruneOptions

DRAFT_DIR = "draft"  # the draft bundle's folder inside the target's bundle
PRECISIONS = (INT8_DYNAMIC, INT4_WEIGHT)  # fused-graph engines: what the draft's KV cache rolls back on


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # TOML's true is not a count


def default_distill() -> DistillOptions:
    """Mostly the target's own answers to questions it wrote (what the draft will be checked against)."""
    return DistillOptions(steps=600, batch_size=4, seq_len=256, lr=5e-4, warmup=20, temperature=1.0,
                          mixture={"teacher": 0.7, "chat": 0.3}, teacher_answers=1000, teacher_prompts="teacher",
                          answer_tokens=256, teacher_topk=64, seq_kd=0.5, max_minutes=90, checkpoint_every=25)


@dataclass(frozen=True)
class DraftOptions:
    layers: int | None = None  # blocks the draft keeps (None: a sixth of the target's, at least one)
    precision: str = INT8_DYNAMIC
    samples: int = 64  # calibration chats for the blocks' importance
    distill: DistillOptions = field(default_factory=default_distill)
    acceptance_chats: int = 16  # held-out chats the acceptance rate is measured on
    acceptance_tokens: int = 64  # greedy tokens per chat
    k: int = 4  # draft length for the measurement (the runtime picks its own k as it goes)
    # the draft's LM head keeps this many tokens (those the chats use most, plus the special tokens and the
    # base alphabet); 0: the whole vocabulary. The head is a large part of a small draft's step (SmolLM2:
    # 28M of a 5-block draft's 46M parameters); a token it lacks the target still emits when it checks.
    head_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.layers is not None and (not _whole(self.layers) or self.layers < 1):
            raise RecipeError(f"draft layers must be a whole number >= 1 (blocks the draft keeps), got {self.layers!r}")
        if self.precision not in PRECISIONS:
            raise RecipeError(f"draft precision must be one of {', '.join(PRECISIONS)} (a fused CPU engine, whose KV "
                              f"cache rolls back after a rejected draft), got {self.precision!r}")
        for name in ("samples", "acceptance_chats", "acceptance_tokens", "k"):
            v = getattr(self, name)
            if not _whole(v) or v < 1:
                raise RecipeError(f"draft {name} must be a whole number >= 1, got {v!r}")
        if not _whole(self.head_tokens) or self.head_tokens < 0:
            raise RecipeError(f"draft head_tokens must be a whole number >= 0 (0: the whole vocabulary), got {self.head_tokens!r}")
        if self.k > 16:
            raise RecipeError(f"draft k must be <= 16 (tokens drafted per check), got {self.k}")

    @classmethod
    def from_section(cls, sec: dict, where: str) -> "DraftOptions":
        """A recipe's [draft] section, with an optional [draft.distill] table."""
        sec = dict(sec)
        distill = sec.pop("distill", None)
        known = {f.name for f in dataclasses.fields(cls)} - {"distill"}
        if set(sec) - known:
            raise RecipeError(f"recipe {where} [draft] has unknown options {sorted(set(sec) - known)} (known: {sorted(known)})")
        if distill is not None:
            if not isinstance(distill, dict):
                raise RecipeError(f"recipe {where} [draft] distill must be a table ([draft.distill])")
            dknown = {f.name for f in dataclasses.fields(DistillOptions)}
            if set(distill) - dknown:
                raise RecipeError(f"recipe {where} [draft.distill] has unknown options {sorted(set(distill) - dknown)}")
            sec["distill"] = dataclasses.replace(default_distill(), **distill)
        return cls(**sec)

    def prune_options(self, target_layers: int) -> PruneOptions:
        """Keep `layers` blocks of the target's (the most important), every head, channel and token."""
        # a sixth: the draft step should cost well under a third of the target's, and the embedding and LM
        # head it keeps whole already take a share (SmolLM2-135M: 28M of 135M parameters)
        keep = self.layers if self.layers is not None else max(1, -(-target_layers // 6))
        if keep >= target_layers:
            raise RecipeError(f"draft layers = {keep}, but the target has {target_layers} blocks: a draft keeps fewer "
                              f"(1..{target_layers - 1}), or it costs as much as the target")
        return PruneOptions(target_ratio=1.0, drop_layers=target_layers - keep, samples=self.samples)


HEAD_IDS = "logit_ids.npy"


def check(opts: DraftOptions, hf_dir: Path, prune: PruneOptions | None) -> None:
    """Refuse before the build what the draft's stages would refuse after it: too many layers for the model,
    a head too small for the tokens always kept. (`hf_dir`: the loaded model; a prune keeps its vocabulary
    unless it prunes that too.)"""
    if prune is not None and prune.drop_layers:
        opts.prune_options(target_layers(hf_dir) - prune.drop_layers)
    else:
        opts.prune_options(target_layers(hf_dir))
    if prune is not None and prune.vocab_size is not None:
        return  # the shipped model's tokens are chosen later; cut_head checks the head then
    if 0 < opts.head_tokens < vocab_size(hf_dir):
        from collections import Counter

        _head_ids(json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8")), Counter(), opts.head_tokens)


def _head_ids(tok_json: dict, counts, tokens: int) -> np.ndarray:
    """The ids a head of `tokens` keeps (export/vocab.py's choice), its bounds said in the draft's words."""
    from export import vocab

    try:
        return np.asarray(vocab.choose(tok_json, counts, tokens), np.int32)
    except RecipeError as e:
        raise RecipeError(str(e).replace("prune vocab_size", "draft head_tokens")) from None


def cut_head(src: Path, dst: Path, hf_dir: Path, tokens: int, calibration: str | None = None) -> dict:
    """Write the fp32 graph in src with its LM head cut to the `tokens` ids chat text uses most (export/vocab.py
    chooses them as for vocabulary pruning: special tokens and base alphabet always), and those ids to
    dst/logit_ids.npy. The embedding keeps every row: the draft reads any token, it only proposes fewer."""
    from onnx import helper

    from export import vocab
    from export.onnx_weights import GraphWeights, lm_head_matmul

    tok_json = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    counts = vocab.token_counts(hf_dir, calibration)
    ids = _head_ids(tok_json, counts, tokens)
    gw = GraphWeights(src / "model.onnx")
    model = gw.model
    producers = {o: n for n in model.graph.node for o in n.output}
    head = next((n for n in model.graph.node if n.op_type == "MatMul" and n.output[0] == model.graph.output[0].name), None)
    if head is None:
        raise RecipeError("the draft's graph has no MatMul writing its logits: cannot cut its LM head (head_tokens = 0 "
                          "keeps it whole)")
    tied = producers.get(head.input[1])
    if tied is not None and tied.op_type == "Transpose" and tied.input[0] in gw.names():
        source = tied.input[0]  # the embedding [vocab, hidden]: the head is its transpose
        rows = lambda: np.ascontiguousarray(gw.stored(source)[ids].T)  # noqa: E731
        hidden = gw.shape(source)[1]
    elif lm_head_matmul(model) is head:
        tied, source = None, head.input[1]  # [hidden, vocab]
        rows = lambda: np.ascontiguousarray(gw.stored(source)[:, ids])  # noqa: E731  (read after drop_unused removes it)
        hidden = gw.shape(source)[0]
    else:
        raise RecipeError("the draft's LM head is neither a weight nor a transposed embedding: cannot cut it "
                          "(head_tokens = 0 keeps it whole)")
    dtype = helper.tensor_dtype_to_np_dtype(gw.initializer(source).data_type)
    gw.set("lm_head.weight_cut", rows, dims=(hidden, len(ids)), dtype=dtype)
    head.input[1] = "lm_head.weight_cut"
    if tied is not None and not any(tied.output[0] in n.input for n in model.graph.node):
        model.graph.node.remove(tied)
    gw.drop_unused()
    model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value = len(ids)
    gw.save(dst / "model.onnx")
    np.save(dst / HEAD_IDS, ids)
    total = sum(counts.values())
    kept = set(ids.tolist())
    return {"head_tokens": len(ids), "vocab": len(tok_json["model"]["vocab"]),
            "chat_token_coverage": round(sum(c for i, c in counts.items() if i in kept) / max(1, total), 5)}


def target_layers(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"])


def vocab_size(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def measure(target_onnx: Path, target_variant: str, hf_dir: Path, draft_root: Path, dst: Path, opts: DraftOptions,
            max_context: int, threads: int | None = None, data: str | None = None, target_kv_cache: str = "") -> dict:
    """Greedy answers to held-out chats, each twice on the target's engine through the scheduler's loop (what
    edge-chat runs): plainly and with the draft proposing k tokens at every step (`RowSpeculator.fixed`),
    interleaved. Acceptance (accepted / drafted), tokens per target call, both speeds here, and whether the
    answers were the same (a quantized target's checked logits differ slightly from a single step's, so a near
    tie can flip; docs/speed.md)."""
    from tqdm import tqdm

    from edge.bundle import Bundle
    from edge.io_contract import io_for_variant
    from edge.backends.choose import load_decoder
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.cache import can_verify
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.decode.speculative import ModelDrafter, RowSpeculator, SpecStats
    from export.data import load_chats
    from export.load import chat_tokenizer, model_dims

    target = OrtDecoder(target_onnx, model_dims(hf_dir, max_context), io_for_variant(target_variant, target_kv_cache),
                        threads=threads, name="target")
    if not can_verify(target):
        raise RecipeError(f"the draft's acceptance is measured on a target engine that checks drafts; a "
                          f"{target_variant} graph on CPU does not (int8-dynamic or int4-weight do)")
    gen = Generator(chat_tokenizer(hf_dir), target)
    draft = Bundle.open(draft_root, verify="full")
    draft_dec, _ = load_decoder(draft, opts.precision, threads, providers=["CPUExecutionProvider"], spin=False)
    chats = load_chats(data, "evaluation", opts.acceptance_chats)  # held out: the user's chats if given
    cfg = SamplingConfig(max_new_tokens=opts.acceptance_tokens)
    stats = SpecStats()
    steps = 0  # the scheduler's decode steps with the draft (target calls after each prefill)
    seconds = {"plain": 0.0, "draft": 0.0}
    tokens = {"plain": 0, "draft": 0}
    same = 0
    for chat in tqdm(chats, desc="draft acceptance", unit="chat"):
        prompt = gen.tokenizer.encode_chat(chat[:1])
        answers = {}
        for mode in ("plain", "draft"):
            spec = None
            if mode == "draft":  # a fresh draft model's cache per chat; one count over them all
                spec = RowSpeculator.fixed(ModelDrafter(draft_dec, target.dims.vocab_size), opts.k)
                spec.stats = stats
            t = time.perf_counter()
            answers[mode] = list(gen.stream(prompt, cfg, speculator=spec))[-1].token_ids
            seconds[mode] += time.perf_counter() - t
            tokens[mode] += len(answers[mode])
            if spec is not None and gen.scheduler is not None:
                steps += gen.scheduler.steps
        same += answers["plain"] == answers["draft"]
    rate = {m: tokens[m] / seconds[m] if seconds[m] else 0.0 for m in seconds}
    out = {"acceptance": round(stats.acceptance, 4), "k": opts.k, "drafted": stats.drafted, "accepted": stats.accepted,
           "tokens_per_target_call": round(tokens["draft"] / max(1, steps + len(chats)), 3),
           "chats": len(chats), "tokens": tokens["draft"], "identical_answers": f"{same}/{len(chats)}",
           "plain_tok_s": round(rate["plain"], 1), "draft_tok_s": round(rate["draft"], 1),
           "speedup_here": round(rate["draft"] / rate["plain"], 3) if rate["plain"] else None,
           "draft_parameters": draft.manifest.model.num_parameters,
           "draft_bytes": draft.manifest.engine_bytes(opts.precision)}
    (dst / "acceptance.json").write_text(json.dumps(out, indent=2))
    return out


def describe(m: dict) -> str:
    return (f"acceptance {m['acceptance']:.2f} at k={m['k']} ({m['tokens_per_target_call']:.2f} tokens per target call, "
            f"{m['chats']} held-out chats); {m['draft_parameters'] / 1e6:.1f}M parameters, "
            f"{m['draft_bytes'] / 1e6:.1f} MB; here {m['plain_tok_s']:.0f} -> {m['draft_tok_s']:.0f} tok/s "
            f"at a fixed k (the runtime adapts k and turns drafting off where it does not pay)")
