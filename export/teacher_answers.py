"""Teacher answers: the text for sequence-level distillation (Kim & Rush, 2016).

The assistant turns of chitchat are people chatting. KL on them teaches the student what the teacher
guesses about human small talk, not how the teacher answers; a student distilled on them alone kept the
fluency and lost the answers (fluent loops on the golden prompts). So each distillation chat is cut at
a user turn and the teacher answers it (sampled, seeded), and the distill stage trains on those chats:
the student reads the teacher's own answers, with the teacher's full distributions as the targets.

With `prompts = "teacher"` the teacher writes the user turns too: it is sampled from the chat template's
user prefix (system prompt, then `<|im_start|>user`), so the questions come from its own instruction
data (how-tos, facts, code, advice) rather than from people's small talk; it then answers them. This is
the teacher's own chat distribution, the data a student would need to keep what the golden prompts ask.

The answers come from the runtime that ships (edge.decode.scheduler.Scheduler over the fused fp32 graph of the
teacher), batched, so a thousand answers take minutes on a CPU, not the better part of an hour that
transformers' `generate` needs there.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from edge.errors import RecipeError

ANSWERS = "answers.jsonl"
MAX_CONTEXT_TOKENS = 512  # a chat cut longer than this is skipped (prefill cost, and the distill blocks are 256)


@dataclass(frozen=True)
class AnswerOptions:
    count: int  # chats the teacher answers
    max_tokens: int = 160
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    batch: int = 16
    data: str | None = None  # the user's JSONL instead of chitchat-dataset's distillation split
    prompts: str = "data"  # data: distillation chats cut at a user turn; teacher: the teacher writes the question
    question_tokens: int = 96
    question_temperature: float = 1.0  # diverse questions; the answers use `temperature`
    question_top_p: float = 0.95

    def __post_init__(self) -> None:
        if self.count < 1 or self.max_tokens < 1 or self.batch < 1 or self.question_tokens < 1:
            raise RecipeError("teacher_answers, its max_tokens, question_tokens and batch must be >= 1")
        if self.prompts not in PROMPT_SOURCES:
            raise RecipeError(f"teacher_prompts must be one of {', '.join(PROMPT_SOURCES)}, got {self.prompts!r}")


PROMPT_SOURCES = ("data", "teacher")
QUESTION_SEED = 1_000_000  # question i is sampled with seed + QUESTION_SEED + i (answers: seed + i)


def prompts(chats: list[list[dict]], count: int, seed: int) -> list[list[dict]]:
    """Each chat cut after a user turn picked at random (seeded): the context the teacher answers."""
    rng = random.Random(seed)
    out = []
    for chat in chats:
        users = [i for i, m in enumerate(chat) if m["role"] == "user"]
        if users:
            out.append(chat[: rng.choice(users) + 1])
        if len(out) >= count:
            break
    return out


def user_prefix(tok) -> list[int]:
    """The token ids a user turn starts with, as the chat template renders it (system prompt included)."""
    marker = "\x00QUESTION\x00"
    text = tok.render([{"role": "user", "content": marker}], add_generation_prompt=False)
    if marker not in text:
        raise RecipeError("the chat template does not render the user's text verbatim: use teacher_prompts = \"data\"")
    return tok.encode(text[: text.index(marker)])


def _teacher_questions(sched, tok, opts: AnswerOptions) -> tuple[list[list[dict]], dict]:
    """Sample user turns from the teacher (1.5x what is asked: questions cut at question_tokens are dropped)."""
    from edge.decode.sampling import SamplingConfig

    prefix = user_prefix(tok)
    n = (3 * opts.count + 1) // 2
    reqs = [sched.submit(prefix, SamplingConfig(max_new_tokens=opts.question_tokens, temperature=opts.question_temperature,
                                                top_p=opts.question_top_p, seed=opts.seed + QUESTION_SEED + i))
            for i in range(n)]
    chats, seen, ended = [], set(), 0
    for req in tqdm(reqs, desc="teacher questions", unit="question"):
        text, last = req.answer()
        if last.finish_reason == "error":
            raise RecipeError(f"the teacher failed while writing questions: {last.stats.get('error')}")
        q = text.strip()
        ended += bool(last.finish_reason == "stop" and q)
        if last.finish_reason == "stop" and q and dedup_key(q) not in seen:
            seen.add(dedup_key(q))
            chats.append([{"role": "user", "content": q}])
    if not chats:
        raise RecipeError(f"the teacher ended none of {n} questions within question_tokens={opts.question_tokens}: "
                          "raise it")
    return chats, {"questions_written": n, "questions_ended": ended, "questions_kept": len(chats),
                   "questions_duplicate": ended - len(chats)}


def dedup_key(text: str) -> str:
    """Two questions are the same when they differ only in case, spacing and punctuation."""
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def unique(chats: list[list[dict]]) -> list[list[dict]]:
    """The chats in order, each kept the first time its turns (by dedup_key) are seen."""
    out, seen = [], set()
    for chat in chats:
        key = "\n".join(dedup_key(m["content"]) for m in chat)
        if key not in seen:
            seen.add(key)
            out.append(chat)
    return out


def run(teacher_dir: Path, dst: Path, opts: AnswerOptions, threads: int | None = None) -> dict:
    """Write dst/answers.jsonl: chats whose last turn is the teacher's answer (only answers that ended
    at EOS: one cut off by max_tokens is often a loop, the very thing distillation should not teach)."""
    from edge.decode.scheduler import Scheduler
    from edge.io_contract import FUSED_IO
    from edge.decode.generate import Generator
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.sampling import SamplingConfig
    from export import fused_graph
    from export.architectures import dims_from_hf_config
    from export.data import load_chats
    from export.load import chat_tokenizer

    cfg = json.loads((teacher_dir / "config.json").read_text())
    why = fused_graph.supported(cfg)
    if why:
        raise RecipeError(f"teacher_answers needs the fused graph of the teacher, which this model has not ({why}): "
                          "set teacher_answers = 0 to distill on the chat text alone")
    graph = dst / "teacher-graph"
    fused_graph.write(teacher_dir, graph)
    tok = chat_tokenizer(teacher_dir)
    gen = Generator(tok, OrtDecoder(graph / "model.onnx", dims_from_hf_config(cfg), FUSED_IO, threads=threads,
                                 name="teacher (fused fp32)"))
    sched = Scheduler(gen, max_batch=opts.batch, max_queue=max(2 * opts.count, 1)).start()
    questions: dict = {}
    kept, tokens, ends = [], 0, {"stop": 0, "length": 0, "empty": 0}
    try:
        if opts.prompts == "teacher":
            chats, questions = _teacher_questions(sched, tok, opts)
        else:
            chats = prompts(load_chats(opts.data, "distillation"), 10 * opts.count, opts.seed)
            chats = unique(chats)  # the same context twice (chitchat's "hi, how are you?") is asked once
        encoded = ((c, tok.encode_chat(c)) for c in chats)
        asked = [(c, ids) for c, ids in encoded if len(ids) <= MAX_CONTEXT_TOKENS][: opts.count]
        if not asked:
            raise RecipeError("no distillation chat fits the teacher-answer context: give shorter chats")
        reqs = [sched.submit(ids, SamplingConfig(max_new_tokens=opts.max_tokens, temperature=opts.temperature,
                                                 top_p=opts.top_p, seed=opts.seed + i))
                for i, (_, ids) in enumerate(asked)]
        bar = tqdm(zip(asked, reqs), total=len(reqs), desc="teacher answers", unit="answer")
        for i, ((chat, _), req) in enumerate(bar):
            text, last = req.answer()
            if last.finish_reason == "error":
                raise RecipeError(f"the teacher failed while answering: {last.stats.get('error')}")
            tokens += (last.stats or {}).get("completion_tokens", 0)
            text = text.strip()
            end = "empty" if not text else "stop" if last.finish_reason == "stop" else "length"
            ends[end] += 1
            if end == "stop":
                kept.append({"messages": chat + [{"role": "assistant", "content": text}], "seed": opts.seed + i})
            bar.set_postfix(kept=len(kept), tokens=tokens)
    finally:
        sched.stop()
        shutil.rmtree(graph, ignore_errors=True)  # the teacher's fp32 graph was only needed to answer
    if not kept:
        raise RecipeError(f"the teacher answered none of {len(asked)} chats before max_tokens={opts.max_tokens}: "
                          "raise max_tokens")
    (dst / ANSWERS).write_text("".join(json.dumps(k) + "\n" for k in kept), encoding="utf-8")
    return questions | {
        "prompts": opts.prompts, "asked": len(asked), "kept": len(kept), "ended_at_eos": ends["stop"],
        "cut_at_max_tokens": ends["length"], "empty": ends["empty"], "answer_tokens": tokens,
        "sampling": {"temperature": opts.temperature, "top_p": opts.top_p, "seed": opts.seed}}
