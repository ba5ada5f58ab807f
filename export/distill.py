"""Distill stage: teach the pruned student back what the teacher knew, on a fixed mixture of text.

Data (export/mixture.py): by default the teacher's own questions and answers (export/teacher_answers.py),
the user's chats (chitchat-dataset's distillation split or their JSONL) and general prose (export/prose.py's
train documents), in the recipe's shares, formatted with the model's chat template (prose as plain text)
and packed into fixed-length blocks with a loss mask: on the teacher's chats the loss is where its answer
is, not on the prompt. Loss there: token-level KL(teacher || student) on temperature-softened next-token
distributions (x T^2, Hinton et al.) plus `seq_kd` x cross-entropy on the tokens the teacher sampled
(sequence-level KD, Kim & Rush 2016); elsewhere the KL alone. With teacher_topk = k > 0 the KL is over the
teacher's k likeliest tokens plus one bucket for the rest of the vocabulary, cached per block: a block seen
again skips the teacher's forward pass. Optionally a cosine loss between matched hidden states.

A recipe fixes its steps (and so its tokens); `max_minutes` is only a safety cap, and a run it cuts
short says so in its metrics and the report. The same recipe gives the same weights (`weights_sha256`)
on the same thread count: seeded data order and initialisation, torch's deterministic algorithms.
AdamW, linear warm-up then cosine decay, gradient clipping, optional gradient checkpointing, AMP: bf16 on
a CUDA GPU that has it, else fp16 with loss scaling, and bf16 on a CPU with native bf16 dot products
(AVX512-BF16/AMX, Arm BF16: ~3x the fp32 step on a 2-core EPYC). A checkpoint is written every
`checkpoint_every` steps outside the stage folder, so an interrupted run resumes where it stopped and
ends where the uninterrupted one would (the schedule is a function of the seed and the step).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge.errors import RecipeError
from edge.precisions import BF16, FP16
from export import mixture as mix
from export import vocab

CKPT = "checkpoint.pt"
TOPK_CACHE = "teacher_topk.npz"  # beside the checkpoint: resumed runs read the cached blocks back
DEFAULT_MIXTURE = {"teacher": 0.4, "chat": 0.2, "prose": 0.4}
NOT_RESULT = ("max_minutes", "threads", "checkpoint_every", "grad_checkpointing")  # change speed, not the result


def _resume_key(opts: "DistillOptions") -> dict:
    return {k: v for k, v in asdict(opts).items() if k not in NOT_RESULT}


@dataclass(frozen=True)
class DistillOptions:
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup: int = 20
    temperature: float = 2.0
    hidden_loss: float = 0.0  # weight of the cosine loss on matched hidden states (0: logits only)
    grad_clip: float = 1.0
    grad_checkpointing: bool = False
    amp: str = "auto"  # auto | bf16 | fp16 | off; auto: bf16 where the GPU or CPU has it natively, fp16 on older GPUs
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None
    checkpoint_every: int = 50
    max_minutes: float | None = None  # stop early (and say so) when the time budget is spent
    samples: int | None = None  # chats / answers / prose documents read per source (None: all)
    data: str | None = None  # the user's chats (JSONL) for the "chat" share; None: chitchat-dataset
    # shares of the training rows: teacher-written chats, the user's chats, general prose (export/mixture.py)
    mixture: dict = field(default_factory=lambda: dict(DEFAULT_MIXTURE))
    teacher_answers: int = 2000  # chats the teacher answers for the "teacher" share (export/teacher_answers.py)
    teacher_prompts: str = "teacher"  # what the teacher answers: "teacher" (questions it writes) or "data" (chats)
    answer_tokens: int = 160  # longest teacher answer kept (one cut there is dropped: often a loop)
    teacher_topk: int = 0  # > 0: KD on the teacher's top-k tokens + a rest bucket, cached per block (repeats skip the teacher)
    seq_kd: float = 0.5  # weight of the cross-entropy on the teacher's sampled answer tokens (sequence-level KD)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.teacher_prompts not in ("data", "teacher"):
            raise RecipeError(f"distill teacher_prompts must be \"data\" or \"teacher\", got {self.teacher_prompts!r}")
        if self.teacher_answers < 0:
            raise RecipeError(f"distill teacher_answers must be >= 0 (0: no teacher-written chats), got {self.teacher_answers}")
        mix.check_mixture(self.mixture)
        if self.mixture.get("teacher") and not self.teacher_answers:
            raise RecipeError("distill mixture has a teacher share but teacher_answers = 0: set teacher_answers = N "
                              "(chats the teacher writes) or drop teacher from the mixture")
        for k in ("lr", "temperature", "seq_kd", "weight_decay", "hidden_loss", "grad_clip"):
            if not math.isfinite(getattr(self, k)):  # a TOML recipe can say nan or inf: AdamW failed on it much later
                raise RecipeError(f"distill {k} must be a finite number, got {getattr(self, k)}")
        if self.seq_kd < 0:
            raise RecipeError(f"distill seq_kd must be >= 0, got {self.seq_kd}")
        for k in ("steps", "batch_size", "seq_len", "checkpoint_every"):
            if getattr(self, k) < 1:
                raise RecipeError(f"distill {k} must be >= 1, got {getattr(self, k)}")
        if self.lr <= 0 or self.temperature <= 0:
            raise RecipeError("distill lr and temperature must be > 0")
        if self.teacher_topk < 0:
            raise RecipeError(f"distill teacher_topk must be >= 0 (0: the whole vocabulary, no cache), got {self.teacher_topk}")
        if self.teacher_topk and self.hidden_loss > 0:
            raise RecipeError("distill teacher_topk caches the teacher's logits only, but hidden_loss needs its hidden "
                              "states every step: set teacher_topk = 0 or hidden_loss = 0")
        if self.amp not in ("auto", BF16, FP16, "off") or self.device not in ("auto", "cpu", "cuda"):
            raise RecipeError("distill amp is one of auto|bf16|fp16|off and device one of auto|cpu|cuda")


def lr_at(step: int, opts: DistillOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def kd_loss(student_logits, teacher_logits, temperature: float, rows: int = 128):
    """KL(teacher || student) per position at temperature t, x t^2; in fp32, `rows` positions at a time.

    Why chunks: [batch x seq, vocab] fp32 temporaries are ~200 MB each at 4 x 256 x 49k; made whole, the
    loss took 1.1-2.2 s of a 3.5 s CPU step (fresh pages every time), in 128-row chunks 0.1-0.35 s."""
    import torch
    import torch.nn.functional as F

    t = temperature
    s2, t2 = student_logits.flatten(0, -2), teacher_logits.flatten(0, -2)
    total = s2.new_zeros((), dtype=torch.float32)
    for i in range(0, s2.shape[0], rows):
        s = F.log_softmax(s2[i:i + rows].float() / t, dim=-1)
        with torch.no_grad():
            p = F.log_softmax(t2[i:i + rows].float() / t, dim=-1)
        total = total + F.kl_div(s, p, log_target=True, reduction="sum")
    return total / s2.shape[0] * t * t


def teacher_topk(teacher_logits, temperature: float, k: int, rows: int = 128):
    """The teacher's k likeliest tokens per position and their log-probabilities at temperature t
    (softmax over the whole vocabulary), [positions, k] each; what the cache keeps."""
    import torch

    t2 = teacher_logits.flatten(0, -2)
    vals, idx = [], []
    with torch.no_grad():
        for i in range(0, t2.shape[0], rows):
            v, j = torch.log_softmax(t2[i:i + rows].float() / temperature, dim=-1).topk(k, dim=-1)
            vals.append(v), idx.append(j.to(torch.int32))
    return torch.cat(vals), torch.cat(idx)


def topk_kd_loss(student_logits, top_logp, top_idx, temperature: float, rows: int = 128):
    """KL(teacher || student) over k + 1 outcomes: the teacher's top-k tokens and one bucket for the rest of
    the vocabulary (mass 1 - sum of the top k for each), x t^2. It is the full KL when the top k hold all
    of the teacher's mass, never more than it, and it still pushes the student's mass off other tokens."""
    import torch
    import torch.nn.functional as F

    t = temperature
    s2 = student_logits.flatten(0, -2)
    total = s2.new_zeros((), dtype=torch.float32)
    for i in range(0, s2.shape[0], rows):
        s = F.log_softmax(s2[i:i + rows].float() / t, dim=-1).gather(-1, top_idx[i:i + rows].long())
        p_log = top_logp[i:i + rows].float()
        p = p_log.exp()
        p_rest = (1 - p.sum(-1)).clamp_min(1e-12)
        s_rest = torch.log((1 - s.exp().sum(-1)).clamp_min(1e-12))
        total = total + (p * (p_log - s)).sum() + (p_rest * (p_rest.log() - s_rest)).sum()
    return total / s2.shape[0] * t * t


def masked_loss(s_logits, teacher, mask, hard, targets, temperature: float, seq_kd: float):
    """The distillation loss of one step, on [positions, vocab] student logits: the KL to the teacher where
    `mask` is set (`teacher`: its logits, or the cached (top log-probs, top ids) pair), plus seq_kd x the
    cross-entropy of the tokens the teacher sampled where `hard` is set. Positions outside the mask (a
    teacher-written chat's prompt) do not count; a batch with none in it is a zero step."""
    import torch.nn.functional as F

    if not bool(mask.any()):
        return s_logits.sum() * 0
    if isinstance(teacher, tuple):
        loss = topk_kd_loss(s_logits[mask], teacher[0][mask], teacher[1][mask], temperature)
    else:
        loss = kd_loss(s_logits[mask], teacher[mask], temperature)
    if seq_kd and bool(hard.any()):
        loss = loss + seq_kd * F.cross_entropy(s_logits[hard].float(), targets[hard])
    return loss


class TopkCache:
    """Top-k teacher log-probs of every block seen so far (numpy, [blocks, seq_len, k]), saved with the
    checkpoint so a resumed run reads the same numbers it would have computed."""

    def __init__(self, n_blocks: int, seq_len: int, k: int):
        self.logp = np.zeros((n_blocks, seq_len, k), dtype=np.float32)
        self.idx = np.zeros((n_blocks, seq_len, k), dtype=np.int32)
        self.have = np.zeros(n_blocks, dtype=bool)

    def missing(self, blocks: np.ndarray) -> np.ndarray:
        """The blocks (each once, in order) whose top-k the cache does not hold yet."""
        todo = [int(b) for b in blocks if not self.have[b]]
        return np.array(list(dict.fromkeys(todo)), dtype=np.int64)

    def put(self, blocks: np.ndarray, logp, idx) -> None:
        shape = (len(blocks),) + self.logp.shape[1:]
        self.logp[blocks] = logp.reshape(shape).cpu().numpy()
        self.idx[blocks] = idx.reshape(shape).cpu().numpy()
        self.have[blocks] = True

    def get(self, blocks: np.ndarray, device: str):
        import torch

        k = self.logp.shape[-1]
        return (torch.from_numpy(self.logp[blocks].reshape(-1, k)).to(device),
                torch.from_numpy(self.idx[blocks].reshape(-1, k)).to(device))

    def mass(self) -> float | None:
        """Mean share of the teacher's probability (at the distillation temperature) its top k hold."""
        if not self.have.any():
            return None
        return float(np.exp(self.logp[self.have].astype(np.float64)).sum(-1).mean())

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, logp=self.logp, idx=self.idx, have=self.have)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        with np.load(path) as z:
            if z["logp"].shape == self.logp.shape:
                self.logp, self.idx, self.have = z["logp"], z["idx"], z["have"].copy()


def cpu_has_bf16() -> bool:
    """Native bf16 dot products (else torch emulates bf16 on the CPU, slower than fp32)."""
    from edge.device.probe import cpu_flags

    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})  # noqa: precision (CPU flags)


def _layer_map(student_dir: Path, teacher_layers: int, student_layers: int) -> list[int]:
    meta = json.loads((student_dir / "edgechat_source.json").read_text()) if (student_dir / "edgechat_source.json").is_file() else {}
    kept = (meta.get("pruned_layers") or list(range(teacher_layers)))[:student_layers]
    return kept


def _amp(opts: DistillOptions, device: str):
    import torch

    if opts.amp == "off":
        return None, None
    if device == "cpu":
        if opts.amp == FP16:
            raise RecipeError("distill amp=fp16 is for CUDA GPUs: on a CPU use amp=bf16 (or auto, or off)")
        if cpu_has_bf16():
            return torch.bfloat16, None
        if opts.amp == BF16:
            raise RecipeError("distill amp=bf16 but this CPU has no native bf16 (no avx512_bf16/amx_bf16/bf16 "
                              "flag in /proc/cpuinfo; emulated bf16 is slower than fp32): use amp=auto or off")
        return None, None
    if opts.amp in ("auto", BF16) and torch.cuda.is_bf16_supported():
        return torch.bfloat16, None
    if opts.amp == BF16:
        raise RecipeError("distill amp=bf16 but this GPU has no bfloat16 (e.g. a T4): use amp=fp16")
    return torch.float16, torch.amp.GradScaler("cuda")


def weights_sha256(model) -> str:
    """SHA-256 (16 hex) over every tensor of a model's state dict, in key order: two runs, same model?"""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def run(teacher_dir: Path, student_dir: Path, dst: Path, opts: DistillOptions, ckpt_dir: Path | None = None,
        answers: Path | None = None) -> dict:
    """Distill the student in student_dir toward the teacher in teacher_dir; write the result to dst.
    `answers`: a JSONL of chats ending in the teacher's answers (teacher-answers stage): the "teacher" share."""
    import torch

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _run(teacher_dir, student_dir, dst, opts, ckpt_dir, answers)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _run(teacher_dir: Path, student_dir: Path, dst: Path, opts: DistillOptions, ckpt_dir: Path | None,
         answers: Path | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from export.load import META, chat_tokenizer, copy_side_files

    device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("distill device=cuda but torch sees no CUDA GPU: use device=cpu (or auto)")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval().to(device)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    t_ids = vocab.teacher_ids(student_dir)  # a vocabulary-pruned student: its tokens, in the teacher's ids
    if t_ids is None and teacher.config.vocab_size != student.config.vocab_size:
        raise RecipeError("teacher and student have different vocabularies and the student has no vocab_map.json "
                          "(written by the prune stage's vocab_size): distillation needs the teacher's tokens")
    if t_ids is not None and (len(t_ids) != student.config.vocab_size or t_ids.max() >= teacher.config.vocab_size):
        raise RecipeError(f"{student_dir / vocab.VOCAB_MAP} does not fit this teacher and student "
                          f"({len(t_ids)} ids for a {student.config.vocab_size}-token student): prune again")
    vmap = torch.from_numpy(t_ids).to(device) if t_ids is not None else None
    use_hidden = opts.hidden_loss > 0
    if use_hidden and teacher.config.hidden_size != student.config.hidden_size:
        raise RecipeError("hidden_loss needs the same hidden size in teacher and student (pruning changed it): "
                          "set hidden_loss = 0 or prune with hidden_ratio = 1")
    layer_map = _layer_map(student_dir, teacher.config.num_hidden_layers, student.config.num_hidden_layers)
    if opts.grad_checkpointing:
        student.gradient_checkpointing_enable()
        student.config.use_cache = False
    student.train()

    tok = chat_tokenizer(student_dir)
    eos = json.loads((student_dir / META).read_text())["eos_token_ids"][0]
    sources = mix.load_sources(tok, opts.mixture, opts.seq_len, eos, answers, opts.data, opts.samples)
    blocks = np.concatenate([p.ids for p in sources])
    mask = np.concatenate([p.mask for p in sources])
    hard = np.concatenate([np.full(len(p.ids), p.name == "teacher") for p in sources])  # the teacher's own samples
    weights = {p.name: opts.mixture[p.name] for p in sources}
    order = mix.schedule({p.name: len(p.ids) for p in sources}, weights, opts.steps, opts.batch_size, opts.seed)

    decay = [p for n, p in student.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in student.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    amp_dtype, scaler = _amp(opts, device)
    cache = TopkCache(len(blocks), opts.seq_len, min(opts.teacher_topk, student.config.vocab_size)) if opts.teacher_topk else None
    start, losses, tokens_seen, seconds, teacher_steps, teacher_rows = 0, [], 0, 0.0, 0, 0
    ckpt = (ckpt_dir / CKPT) if ckpt_dir else None
    if ckpt and ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        if state["options"] == _resume_key(opts):
            student.load_state_dict(state["student"])
            optim.load_state_dict(state["optim"])
            if scaler and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            start, losses, tokens_seen, seconds = state["step"], state["losses"], state["tokens_seen"], state["seconds"]
            teacher_steps = state.get("teacher_steps", start)
            teacher_rows = state.get("teacher_rows", teacher_steps * opts.batch_size)
            if cache and (ckpt_dir / TOPK_CACHE).is_file():
                cache.load(ckpt_dir / TOPK_CACHE)

    def save(step: int) -> None:
        if not ckpt:
            return
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"options": _resume_key(opts), "student": student.state_dict(), "optim": optim.state_dict(),
                    "scaler": scaler.state_dict() if scaler else None, "step": step, "losses": losses,
                    "tokens_seen": tokens_seen, "seconds": seconds, "teacher_steps": teacher_steps,
                    "teacher_rows": teacher_rows}, tmp)
        if cache:
            cache.save(ckpt.parent / TOPK_CACHE)
        os.replace(tmp, ckpt)

    stopped = None
    bar = tqdm(range(start, opts.steps), desc="distill", unit="step", initial=start, total=opts.steps)
    for step in bar:
        t0 = time.perf_counter()
        idx = order[step]
        xb = torch.from_numpy(blocks[idx]).to(device)
        x = xb[:, :-1]
        m = torch.from_numpy(mask[idx]).to(device).flatten()
        h = (torch.from_numpy(hard[idx]).to(device)[:, None] & torch.from_numpy(mask[idx]).to(device)).flatten()
        for g in optim.param_groups:
            g["lr"] = lr_at(step, opts)
        # with the cache, the teacher reads only the rows it has not seen (a prose block seen again costs nothing)
        todo = cache.missing(idx) if cache else idx
        with torch.autocast(device_type=device, dtype=amp_dtype, enabled=amp_dtype is not None):
            if len(todo):
                t_in = x if cache is None else torch.from_numpy(blocks[todo][:, :-1]).to(device)
                with torch.no_grad():
                    t_out = teacher(vmap[t_in] if vmap is not None else t_in, output_hidden_states=use_hidden)
                    t_logits = t_out.logits if vmap is None else t_out.logits.index_select(-1, vmap)
                teacher_steps += 1
                teacher_rows += len(todo)
            s_out = student(x, output_hidden_states=use_hidden, use_cache=False)
        # the losses in fp32, outside autocast (under CPU autocast the same KL took 1.8 s instead of 0.1-0.35),
        # on the masked positions only (the teacher's answers, all of chat and prose text)
        s_logits = s_out.logits.flatten(0, -2)
        if cache and len(todo):
            cache.put(todo, *teacher_topk(t_logits, opts.temperature, cache.logp.shape[-1]))
        teacher_says = cache.get(idx, device) if cache else t_logits.flatten(0, -2)
        loss = masked_loss(s_logits, teacher_says, m, h, xb[:, 1:].flatten(), opts.temperature, opts.seq_kd)
        if use_hidden:
            cos = [1 - torch.nn.functional.cosine_similarity(s_out.hidden_states[i + 1].float(),
                                                             t_out.hidden_states[layer_map[i] + 1].float(), dim=-1).mean()
                   for i in range(student.config.num_hidden_layers)]
            loss = loss + opts.hidden_loss * torch.stack(cos).mean()
        optim.zero_grad(set_to_none=True)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), opts.grad_clip)
        if scaler:
            scaler.step(optim)
            scaler.update()
        else:
            optim.step()
        dt = time.perf_counter() - t0
        seconds += dt
        tokens_seen += x.numel()
        losses.append(round(float(loss.detach()), 5))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{x.numel() / dt:.0f}")
        if (step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps:
            save(step + 1)
        if opts.max_minutes and seconds > opts.max_minutes * 60 and step + 1 < opts.steps:
            stopped = (f"the time cap of {opts.max_minutes:g} min cut distillation short: {step + 1} of the recipe's "
                       f"{opts.steps} steps ({100 * (step + 1) / opts.steps:.0f}% of its tokens); this is not the model "
                       "the recipe describes: build again with a larger max_minutes and it resumes from the checkpoint")
            save(step + 1)
            break
    bar.close()
    student.eval()
    if opts.grad_checkpointing:
        student.gradient_checkpointing_disable()
        student.config.use_cache = True
    student.to("cpu").save_pretrained(dst)
    copy_side_files(student_dir, dst)
    meta = json.loads((student_dir / META).read_text())
    (dst / META).write_text(json.dumps(meta | {"distilled": True}, indent=2))
    k = max(1, len(losses) // 10)
    mass = cache.mass() if cache else None
    planned = opts.steps * opts.batch_size * opts.seq_len
    return {
        "steps": len(losses), "steps_planned": opts.steps, "tokens_seen": tokens_seen, "tokens_planned": planned,
        "seconds": round(seconds, 1), "batch_size": opts.batch_size, "tokens_per_s": round(tokens_seen / seconds, 1) if seconds else None,
        "device": device, "threads": torch.get_num_threads() if device == "cpu" else None,
        "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "off", "temperature": opts.temperature,
        "loss_first": float(np.mean(losses[:k])), "loss_last": float(np.mean(losses[-k:])),
        "losses": losses[:: max(1, len(losses) // 100)], "blocks": int(len(blocks)), "stopped_early": stopped,
        "cap_hit": stopped is not None, "resumed_from_step": start or None, "text": describe_mixture(weights),
        "mixture": mix.describe(sources, order[: len(losses)], weights), "seq_kd": opts.seq_kd,
        "teacher_steps": teacher_steps, "teacher_rows": teacher_rows, "teacher_topk": opts.teacher_topk or None,
        "teacher_topk_mass": round(mass, 4) if mass is not None else None,
        "weights_sha256": weights_sha256(student),
    }


def describe_mixture(weights: dict[str, float]) -> str:
    """"teacher-written chats 40%, chats 20%, prose 40%": the shares of the training rows, in words."""
    names = {"teacher": "teacher-written chats", "chat": "chats", "prose": "general prose"}
    total = sum(weights.values())
    return ", ".join(f"{names[k]} {100 * w / total:.0f}%" for k, w in weights.items())
