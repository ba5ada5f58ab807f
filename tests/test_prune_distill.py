"""Prune and distill on tiny models: shapes, importance vs random, GQA groups, loss, resume, errors, the build."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny_model
from edge.errors import RecipeError


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> Path:
    """A tiny model as the load stage leaves it (HF folder + edgechat_source.json)."""
    from export import load
    from export.model_source import resolve

    d = tmp_path_factory.mktemp("prune")
    src = make_tiny_model(d / "src", layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=1)
    (d / "loaded").mkdir()
    load.run(resolve(str(src)), d / "loaded")
    return d / "loaded"


def _model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _seqs(loaded, n=8):
    from export.prune import calibration_sequences

    return calibration_sequences(loaded, None, n, 128)


def _kl_to(teacher, student, seqs) -> float:
    import torch

    tot = 0.0
    with torch.no_grad():
        for s in seqs:
            x = torch.tensor([s])
            lt = torch.log_softmax(teacher(x).logits.double(), -1)
            ls = torch.log_softmax(student(x).logits.double(), -1)
            tot += float((lt.exp() * (lt - ls)).sum(-1).mean())
    return tot / len(seqs)


def test_pruned_model_is_a_plain_checkpoint_of_the_expected_shape(loaded, tmp_path):
    from export import prune

    opts = prune.PruneOptions(target_ratio=0.6, drop_layers=1, kv_groups=1, hidden_ratio=0.75, multiple=16, samples=8)
    m = prune.run(loaded, tmp_path, opts)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"],
            cfg["head_dim"]) == (3, 2, 1, 48, 16)
    assert set(cfg) >= set(json.loads((loaded / "config.json").read_text())) - {"head_dim"}  # same keys, smaller numbers
    small = _model(tmp_path)  # plain transformers, no EdgeChat code
    sd = small.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 16, 48)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (16, 48)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (48, cfg["intermediate_size"])
    n = sum(p.numel() for p in small.parameters())
    assert n == m["params_after"] and n <= 0.6 * m["params_before"]
    assert small.config.tie_word_embeddings and small.lm_head.weight.data_ptr() == small.model.embed_tokens.weight.data_ptr()
    import torch

    assert torch.isfinite(small(torch.tensor([[1, 5, 9, 3]])).logits).all()
    meta = json.loads((tmp_path / "edgechat_source.json").read_text())
    assert meta["num_parameters"] == n and meta["pruned_from"]["num_parameters"] == m["params_before"]
    assert (tmp_path / "tokenizer.json").is_file()


def test_mlp_width_is_solved_to_land_on_the_target(loaded):
    from export import prune

    teacher = _model(loaded)
    imp = prune.measure(teacher, _seqs(loaded))
    full = prune.count_params(teacher.config)
    for ratio in (0.9, 0.75):
        shape = prune.solve_shape(teacher.config, imp, prune.PruneOptions(target_ratio=ratio, multiple=8), ratio)
        n = prune.count_params(teacher.config, shape)
        wider = prune.count_params(teacher.config, prune.Shape(shape.layers, shape.kv_groups, shape.hidden,
                                                               shape.intermediate + 8))
        assert n <= ratio * full < wider  # the widest MLP (in steps of 8) within the budget


def test_activation_importance_beats_random_pruning_of_the_same_size(loaded):
    from export import prune

    teacher = _model(loaded)
    seqs = _seqs(loaded, 16)
    opts = prune.PruneOptions(target_ratio=0.7, kv_groups=1, multiple=8)
    imp = prune.measure(teacher, seqs)
    shape = prune.solve_shape(teacher.config, imp, opts, 0.7)
    ours = _kl_to(teacher, prune.prune_state(teacher, imp, shape), seqs)
    rand = [_kl_to(teacher, prune.prune_state(teacher, prune.measure(teacher, seqs, "random", seed), shape), seqs)
            for seed in range(3)]
    assert ours < min(rand), (ours, rand)


def test_gqa_groups_stay_whole(loaded):
    """A KV head is kept with exactly the query heads that read it."""
    from export import prune

    teacher = _model(loaded)
    imp = prune.measure(teacher, _seqs(loaded))
    shape = prune.solve_shape(teacher.config, imp, prune.PruneOptions(target_ratio=1.0, kv_groups=1), 1.0)
    small = prune.prune_state(teacher, imp, shape)
    D, rep = 16, 2
    for i in range(teacher.config.num_hidden_layers):
        g = int(np.argmax(imp.heads[i].reshape(2, rep).sum(1)))  # the group kept in layer i
        big, sm = teacher.model.layers[i].self_attn, small.model.layers[i].self_attn
        assert np.allclose(sm.k_proj.weight.detach(), big.k_proj.weight.detach()[g * D:(g + 1) * D])
        assert np.allclose(sm.v_proj.weight.detach(), big.v_proj.weight.detach()[g * D:(g + 1) * D])
        assert np.allclose(sm.q_proj.weight.detach(), big.q_proj.weight.detach()[g * rep * D:(g + 1) * rep * D])
        assert np.allclose(sm.o_proj.weight.detach(), big.o_proj.weight.detach()[:, g * rep * D:(g + 1) * rep * D])


def test_depth_pruning_drops_the_least_important_blocks(loaded):
    from export import prune

    teacher = _model(loaded)
    imp = prune.measure(teacher, _seqs(loaded))
    shape = prune.solve_shape(teacher.config, imp, prune.PruneOptions(target_ratio=1.0, drop_layers=2), 1.0)
    assert set(range(4)) - set(shape.layers) == set(np.argsort(imp.blocks)[:2].tolist())


@pytest.mark.parametrize("kw, match", [
    (dict(target_ratio=0), r"target_ratio must be in \(0, 1\]"),
    (dict(target_ratio=1.5), r"target_ratio must be in \(0, 1\]"),
    (dict(hidden_ratio=0), "hidden_ratio"),
    (dict(method="magic"), "method 'magic' unknown"),
    (dict(target_ratio=None), "prune needs a target"),
])
def test_invalid_prune_options(kw, match):
    from export.prune import PruneOptions

    with pytest.raises(RecipeError, match=match):
        PruneOptions(**kw)


def test_impossible_shapes_are_refused_with_what_to_do(loaded):
    from export import prune

    teacher = _model(loaded)
    imp = prune.measure(teacher, _seqs(loaded, 2))
    with pytest.raises(RecipeError, match="kv_groups=3 but the model has 2 KV heads"):
        prune.solve_shape(teacher.config, imp, prune.PruneOptions(kv_groups=3), 0.6)
    with pytest.raises(RecipeError, match="drop_layers=4 but the model has 4 layers"):
        prune.solve_shape(teacher.config, imp, prune.PruneOptions(drop_layers=4), 0.6)
    with pytest.raises(RecipeError, match="narrowing the MLP alone.*drop_layers"):
        prune.solve_shape(teacher.config, imp, prune.PruneOptions(target_ratio=0.1), 0.1)


@pytest.fixture(scope="module")
def pruned(loaded, tmp_path_factory) -> Path:
    from export import prune

    d = tmp_path_factory.mktemp("pruned")
    prune.run(loaded, d, prune.PruneOptions(target_ratio=0.6, kv_groups=1, multiple=16, samples=8))
    return d


def _dopts(**kw):
    from export.distill import DistillOptions

    return DistillOptions(**({"steps": 12, "batch_size": 2, "seq_len": 32, "lr": 1e-3, "warmup": 2, "samples": 60,
                              "checkpoint_every": 4, "mixture": {"chat": 1.0}} | kw))


def test_distill_loss_falls(loaded, pruned, tmp_path):
    from export import distill

    m = distill.run(loaded, pruned, tmp_path / "out", _dopts(steps=30))
    assert m["steps"] == 30 and m["tokens_seen"] == 30 * 2 * 32
    assert m["loss_last"] < 0.7 * m["loss_first"], (m["loss_first"], m["loss_last"])
    before = _kl_to(_model(loaded), _model(pruned), _seqs(loaded))
    after = _kl_to(_model(loaded), _model(tmp_path / "out"), _seqs(loaded))
    assert after < before  # closer to the teacher on calibration chats it was not trained on


def test_kd_loss_in_chunks_equals_the_whole(loaded):
    import torch

    from export.distill import kd_loss

    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 7, 50, generator=g, requires_grad=True)
    t = torch.randn(3, 7, 50, generator=g)
    ref_s = s.detach().clone().requires_grad_(True)
    whole = torch.nn.functional.kl_div(torch.log_softmax(ref_s / 2, -1).flatten(0, 1), torch.log_softmax(t / 2, -1).flatten(0, 1),
                                       log_target=True, reduction="batchmean") * 4
    chunked = kd_loss(s, t, 2.0, rows=4)  # 21 positions: 5 full chunks and a short one
    torch.testing.assert_close(chunked, whole)
    whole.backward(), chunked.backward()
    torch.testing.assert_close(s.grad, ref_s.grad)


def test_topk_kd_loss_is_the_full_kl_at_full_k_and_below_it_otherwise():
    import torch

    from export.distill import kd_loss, teacher_topk, topk_kd_loss

    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 7, 50, generator=g, requires_grad=True)
    t = torch.randn(3, 7, 50, generator=g) * 3
    full = kd_loss(s, t, 2.0)
    lp, ix = teacher_topk(t, 2.0, 50, rows=4)
    assert lp.shape == ix.shape == (21, 50)
    every = topk_kd_loss(s, lp, ix, 2.0, rows=4)  # all 50 tokens kept: the rest bucket is empty
    torch.testing.assert_close(every, full)
    (g_full,) = torch.autograd.grad(full, s)
    (g_every,) = torch.autograd.grad(every, s)
    torch.testing.assert_close(g_every, g_full)
    few = topk_kd_loss(s, *teacher_topk(t, 2.0, 5), 2.0)
    assert 0 < float(few) < float(full)  # merging tokens into one bucket can only lower a KL
    assert abs(float(topk_kd_loss(t, *teacher_topk(t, 2.0, 5), 2.0))) < 1e-5  # the teacher against itself


def test_distill_caches_the_teachers_topk_and_resumes_with_it(loaded, pruned, tmp_path):
    """Few chats, so blocks come round again: after the first epoch the teacher no longer runs, the loss
    still falls, and a run cut short and resumed (cache read back from disk) ends where the straight one does."""
    import torch

    from export import distill

    o = _dopts(steps=16, samples=1, teacher_topk=8)
    m = distill.run(loaded, pruned, tmp_path / "straight", o)
    epoch = -(-m["blocks"] // o.batch_size)
    assert m["blocks"] < o.steps * o.batch_size / 2, m["blocks"]  # the test needs repeats
    # the teacher reads every block exactly once, and only in the first epoch's steps
    assert m["teacher_rows"] == m["blocks"] and m["teacher_steps"] <= epoch
    assert m["teacher_topk"] == 8 and 0 < m["teacher_topk_mass"] < 1
    assert m["loss_last"] < 0.7 * m["loss_first"], (m["loss_first"], m["loss_last"])
    from export.report import _stage_lines

    line = _stage_lines({"stages": {"distill": m}})[0]
    assert f"top 8 tokens (holding {100 * m['teacher_topk_mass']:.1f}%" in line and f"read {m['blocks']} of the {16 * o.batch_size} rows" in line
    ck = tmp_path / "ckpt"
    cut = distill.run(loaded, pruned, tmp_path / "cut", dataclasses.replace(o, max_minutes=1e-9), ckpt_dir=ck)
    assert cut["steps"] == 1 and (ck / distill.TOPK_CACHE).is_file()
    resumed = distill.run(loaded, pruned, tmp_path / "resumed", o, ckpt_dir=ck)
    assert resumed["resumed_from_step"] == 1 and resumed["teacher_rows"] == m["blocks"]
    a, b = _model(tmp_path / "straight").state_dict(), _model(tmp_path / "resumed").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    with pytest.raises(RecipeError, match="hidden_loss needs its hidden states"):
        _dopts(teacher_topk=8, hidden_loss=1.0)
    with pytest.raises(RecipeError, match="teacher_topk must be >= 0"):
        _dopts(teacher_topk=-1)
    for key in ("lr", "temperature", "seq_kd", "weight_decay", "hidden_loss", "grad_clip"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(RecipeError, match=f"distill {key} must be a finite number"):
                _dopts(**{key: bad})


def test_distill_amp_on_cpu(loaded, pruned, tmp_path, monkeypatch):
    """bf16 autocast on a CPU with native bf16, none without (emulated bf16 is slower than fp32), and clear
    errors for what cannot run."""
    import torch

    from export import distill

    monkeypatch.setattr(distill, "cpu_has_bf16", lambda: True)
    assert distill._amp(_dopts(), "cpu") == (torch.bfloat16, None)
    assert distill._amp(_dopts(amp="off"), "cpu") == (None, None)
    with pytest.raises(RecipeError, match="amp=fp16 is for CUDA"):
        distill._amp(_dopts(amp="fp16"), "cpu")
    monkeypatch.setattr(distill, "cpu_has_bf16", lambda: False)
    assert distill._amp(_dopts(), "cpu") == (None, None)
    with pytest.raises(RecipeError, match="no native bf16"):
        distill._amp(_dopts(amp="bf16"), "cpu")
    monkeypatch.undo()
    m = distill.run(loaded, pruned, tmp_path / "o", _dopts(steps=2))
    assert m["amp"] == ("bfloat16" if distill.cpu_has_bf16() else "off")


def test_distill_resume_ends_where_the_uninterrupted_run_does(loaded, pruned, tmp_path):
    import torch

    from export import distill

    distill.run(loaded, pruned, tmp_path / "straight", _dopts())
    ck = tmp_path / "ckpt"
    first = distill.run(loaded, pruned, tmp_path / "cut", _dopts(max_minutes=1e-9), ckpt_dir=ck)
    assert first["stopped_early"] and first["steps"] == 1 and (ck / distill.CKPT).is_file()
    resumed = distill.run(loaded, pruned, tmp_path / "resumed", _dopts(), ckpt_dir=ck)
    assert resumed["resumed_from_step"] == 1 and resumed["steps"] == 12
    a, b = _model(tmp_path / "straight").state_dict(), _model(tmp_path / "resumed").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_distill_checks(loaded, pruned, tmp_path):
    from export import distill
    from export.distill import DistillOptions

    with pytest.raises(RecipeError, match="steps must be >= 1"):
        DistillOptions(steps=0)
    with pytest.raises(RecipeError, match="hidden_loss needs the same hidden size"):
        from export import prune

        hp = tmp_path / "hp"
        prune.run(loaded, hp, prune.PruneOptions(target_ratio=1.0, hidden_ratio=0.5, multiple=16, samples=2))
        distill.run(loaded, hp, tmp_path / "x", _dopts(hidden_loss=1.0))
    from export import mixture

    with pytest.raises(RecipeError, match="fewer than one block"):
        mixture.pack("chat", [([1, 2, 3], [True] * 3)], 32)


def test_teacher_answers_are_the_teachers_own_and_feed_the_distillation(loaded, pruned, tmp_path):
    """Sequence-level KD text: chitchat chats cut at a user turn, answered by the teacher with the shipped
    runtime (batched); only answers that ended at EOS are kept; each equals the teacher's single-user
    answer with the recorded seed; the distill stage then trains on exactly those chats."""
    from edge.io_contract import FUSED_IO
    from edge.decode.generate import Generator
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.sampling import SamplingConfig
    from export import distill, fused_graph, mixture, teacher_answers
    from export.architectures import dims_from_hf_config
    from export.load import chat_tokenizer

    opts = teacher_answers.AnswerOptions(count=40, max_tokens=24, temperature=1.0, batch=8, prompts="data")
    m = teacher_answers.run(loaded, tmp_path / "a", opts, threads=1)
    assert m["asked"] == 40 and m["kept"] == m["ended_at_eos"] > 0 and m["cut_at_max_tokens"] > 0
    assert m["kept"] + m["cut_at_max_tokens"] + m["empty"] == m["asked"]
    assert not (tmp_path / "a" / "teacher-graph").exists()  # the fp32 graph was only needed to answer
    rows = [json.loads(line) for line in (tmp_path / "a" / teacher_answers.ANSWERS).read_text().splitlines()]
    assert len(rows) == m["kept"]
    fused_graph.write(loaded, tmp_path / "g")
    cfg = json.loads((loaded / "config.json").read_text())
    gen = Generator(chat_tokenizer(loaded), OrtDecoder(tmp_path / "g" / "model.onnx", dims_from_hf_config(cfg), FUSED_IO,
                                                    threads=1))
    for r in rows:
        *context, answer = r["messages"]
        assert context[-1]["role"] == "user" and answer["role"] == "assistant" and answer["content"]
        ids = gen.tokenizer.encode_chat(context)
        alone, last = gen.complete(ids, SamplingConfig(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=r["seed"]))
        assert (alone.strip(), last.finish_reason) == (answer["content"], "stop")
    out = distill.run(loaded, pruned, tmp_path / "d", _dopts(steps=2, samples=None, seq_len=16, mixture={"teacher": 1}),
                      answers=tmp_path / "a" / teacher_answers.ANSWERS)
    tok = chat_tokenizer(pruned)
    want = len(mixture.pack("teacher", [mixture.chat_sample(tok, r["messages"], True) for r in rows], 16).ids)
    assert out["text"] == "teacher-written chats 100%" and out["blocks"] == want
    with pytest.raises(RecipeError, match="teacher_answers must be >= 0"):
        _dopts(teacher_answers=-1)


def test_recipe_sections_and_flags(tmp_path):
    import argparse

    from export.recipe import BuildOptions

    r = tmp_path / "r.toml"
    r.write_text('[prune]\ntarget_ratio = 0.5\nkv_groups = 2\n[distill]\nsteps = 7\n')
    o = BuildOptions.from_toml(r, output="x.bundle")
    assert o.prune.target_ratio == 0.5 and o.prune.kv_groups == 2 and o.distill.steps == 7
    r.write_text('[prune]\ntarget = 0.5\n')
    with pytest.raises(RecipeError, match=r"\[prune\] has unknown options \['target'\]"):
        BuildOptions.from_toml(r, output="x.bundle")
    r.write_text('[distill]\nsteps = 7\n')
    with pytest.raises(RecipeError, match="distill needs a prune stage"):
        BuildOptions.from_toml(r, output="x.bundle")
    ns = dict(output="o.bundle", model="default", recipe=None, precision=None, max_context=None, calibration=None,
              eval_samples=None, skip_eval=False, fresh=False, online=False, fit=None, fit_context=None,
              distill_steps=None, distill_minutes=None, no_distill=False)
    o = BuildOptions.from_cli(argparse.Namespace(**(ns | {"prune": 0.6, "distill_minutes": 20.0})))
    assert o.prune.target_ratio == 0.6 and o.distill.max_minutes == 20.0
    o = BuildOptions.from_cli(argparse.Namespace(**(ns | {"prune": 0.6, "no_distill": True})))
    assert o.prune is not None and o.distill is None
    o = BuildOptions.from_cli(argparse.Namespace(**(ns | {"prune": None, "fit": "orin-nano-8gb", "fit_context": 1024})))
    assert o.prune.fit == "orin-nano-8gb" and o.prune.target_ratio is None and o.prune.fit_context == 1024
    o = BuildOptions.from_cli(argparse.Namespace(**(ns | {"prune": 0.6, "vocab_size": 24576})))
    assert o.prune.vocab_size == 24576 and o.prune.target_ratio == 0.6
    with pytest.raises(RecipeError, match="--vocab-size prunes the vocabulary: give it with --prune"):
        BuildOptions.from_cli(argparse.Namespace(**(ns | {"prune": None, "vocab_size": 24576})))


def test_fit_a_device_budget(loaded):
    from export.prune import fit_ratio

    assert fit_ratio(loaded, "orin-nano-8gb", 1024) == 1.0  # a 0.2M-parameter model fits already
    with pytest.raises(RecipeError, match="KV cache alone is too large"):
        fit_ratio(loaded, "orin-nano-8gb", 10_000_000)


def test_build_with_prune_and_distill_reports_the_lineage(loaded, tmp_path):
    """teacher -> pruned-only -> distilled fp32 -> int8 side by side; the bundle runs with the edge runtime."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from export.prune import PruneOptions
    from export.recipe import BuildOptions, build

    src = loaded.parent / "src"
    b = build(BuildOptions(output=tmp_path / "p.bundle", model=str(src), precisions=("fp32", "int8-dynamic"),
                           max_context=256, eval_samples=3, calibration_samples=4,
                           prune=PruneOptions(target_ratio=0.6, kv_groups=1, multiple=16, samples=4),
                           distill=_dopts(steps=6)), log=lambda s: None)
    m = Bundle.open(b.root).manifest
    names = [s.name for s in m.stages]
    assert names[:4] == ["load", "prune", "distill", "export"] and "evaluate" in names
    from export.stages import CODE_KEY, code_fingerprint
    # each stage record says which source ran it (what stage reuse compares after an upgrade)
    assert next(s for s in m.stages if s.name == "distill").tool_versions[CODE_KEY] == code_fingerprint("export.distill")
    assert all(CODE_KEY in s.tool_versions for s in m.stages)
    ev = next(s for s in m.stages if s.name == "evaluate").metrics
    assert list(ev["engines"])[:3] == ["teacher", "pruned-only", "fp32"] and ev["reference"] == "teacher"
    assert ev["engines"]["teacher"]["kl_to_fp32"] == 0 and "perplexity_vs_teacher_pct" in ev["engines"]["fp32"]
    assert [e.name for e in m.engines] == ["fp32", "int8-dynamic"]  # the lineage is reported, not shipped
    assert m.model.num_parameters <= 0.6 * next(s for s in m.stages if s.name == "prune").metrics["params_before"]
    report = (b.root / "report/report.md").read_text()
    assert "| teacher |" in report and "| pruned-only |" in report and "Distill on chats 100%: 6 steps" in report
    assert (b.root / "report/distill_loss.png").is_file()
    gen = Generator.from_bundle(Bundle.open(b.root), engine="int8-dynamic", threads=1)
    text, _ = gen.complete(gen.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), SamplingConfig(max_new_tokens=4))
    assert isinstance(text, str)
    shutil.rmtree(b.root.with_name(b.root.name + ".work"), ignore_errors=True)


def test_teacher_written_questions_are_its_own_samples(loaded, tmp_path):
    """teacher_prompts = "teacher": the user turns are sampled from the teacher at the chat template's user
    prefix (each equals a single-user sample with its recorded seed), then answered as before."""
    from edge.io_contract import FUSED_IO
    from edge.decode.generate import Generator
    from edge.backends.onnxruntime import OrtDecoder
    from edge.decode.sampling import SamplingConfig
    from export import fused_graph, teacher_answers
    from export.architectures import dims_from_hf_config
    from export.load import chat_tokenizer

    opts = teacher_answers.AnswerOptions(count=40, max_tokens=150, question_tokens=150, temperature=1.0, batch=8,
                                         prompts="teacher")
    m = teacher_answers.run(loaded, tmp_path / "a", opts, threads=1)
    assert m["prompts"] == "teacher" and m["questions_written"] == 60 and 0 < m["questions_kept"] <= 60
    assert m["asked"] == min(40, m["questions_kept"]) and m["kept"] > 0
    rows = [json.loads(line) for line in (tmp_path / "a" / teacher_answers.ANSWERS).read_text().splitlines()]
    fused_graph.write(loaded, tmp_path / "g")
    cfg = json.loads((loaded / "config.json").read_text())
    tok = chat_tokenizer(loaded)
    gen = Generator(tok, OrtDecoder(tmp_path / "g" / "model.onnx", dims_from_hf_config(cfg), FUSED_IO, threads=1))
    prefix = teacher_answers.user_prefix(tok)
    assert tok.decode(prefix, skip_special_tokens=False).endswith("user\n")
    written = set()
    for i in range(m["questions_written"]):
        q, last = gen.complete(prefix, SamplingConfig(max_new_tokens=150, temperature=1.0, top_p=0.95,
                                                      seed=opts.seed + teacher_answers.QUESTION_SEED + i))
        if last.finish_reason == "stop" and q.strip():
            written.add(q.strip())
    for r in rows:
        (user, answer) = r["messages"]
        assert user["role"] == "user" and user["content"] in written and answer["role"] == "assistant"
    with pytest.raises(RecipeError, match="teacher_prompts must be"):
        teacher_answers.AnswerOptions(count=1, prompts="web")
    with pytest.raises(RecipeError, match="teacher_prompts must be"):
        _dopts(teacher_prompts="web")


# --- vocabulary pruning ---------------------------------------------------------------------------------

def test_vocab_pruning_keeps_the_chat_tokens_and_the_models_answers_on_them(loaded, tmp_path):
    """Only the vocabulary cut: logits on the kept tokens are the teacher's exactly, chat text the kept
    tokens covered tokenizes as before, any other text falls back to kept pieces and decodes the same."""
    import torch

    from export import prune, vocab
    from export.load import chat_tokenizer

    m = prune.run(loaded, tmp_path, prune.PruneOptions(target_ratio=1.0, vocab_size=300, samples=4))
    cfg = json.loads((tmp_path / "config.json").read_text())
    t_ids = vocab.teacher_ids(tmp_path)
    assert cfg["vocab_size"] == 300 == len(t_ids) and m["vocab"] == "400 -> 300" and 0 < m["vocab_coverage"] < 1
    assert list(t_ids) == sorted(t_ids) and list(t_ids[:3]) == [0, 1, 2]  # specials kept, order kept
    assert m["params_after"] == m["params_before"] - 100 * 64  # 100 rows of the tied embedding
    teacher, small = _model(loaded), _model(tmp_path)
    assert vocab.teacher_ids(loaded) is None
    t_tok, s_tok = chat_tokenizer(loaded), chat_tokenizer(tmp_path)
    assert s_tok.tok.get_vocab_size() == 300
    counts = vocab.token_counts(loaded, None)
    top = [i for i, _ in counts.most_common(20)]
    assert set(top) <= set(t_ids.tolist())  # the most used chat tokens are all kept
    same = diff = 0
    for chat in _chats(12):
        text = t_tok.render(chat, add_generation_prompt=False)
        t_seq, s_seq = t_tok.encode(text), s_tok.encode(text)
        assert s_tok.decode(s_seq, skip_special_tokens=False) == text
        if set(t_seq) <= set(t_ids.tolist()):
            assert t_ids[s_seq].tolist() == t_seq
            same += 1
        else:
            assert len(s_seq) > len(t_seq)
            diff += 1
        with torch.no_grad():
            want = teacher(torch.tensor([t_ids[s_seq].tolist()])).logits[0][:, torch.from_numpy(t_ids)]
            got = small(torch.tensor([s_seq])).logits[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert diff > 0  # the cut did drop tokens these chats use
    meta = json.loads((tmp_path / "edgechat_source.json").read_text())
    assert meta["eos_token_ids"] == json.loads((loaded / "edgechat_source.json").read_text())["eos_token_ids"]
    assert s_tok.encode("<|im_end|>") == [2]


def _chats(n):
    from export.data import load_chats

    return load_chats(None, "evaluation", n)


def test_trimmed_tokenizer_renumbers_special_tokens_past_the_cut():
    """Special tokens added after the BPE vocabulary (as Llama 3 and Qwen do) move down with the cut, and
    every file that names them by id follows: tokenizer.json, its post-processor, the map to the teacher."""
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from conftest import CORPUS
    from export import vocab

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=350, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|start|>", "<|end|>"])
    start, end = tok.token_to_id("<|start|>"), tok.token_to_id("<|end|>")
    tok.post_processor = processors.TemplateProcessing(single="<|start|> $A", special_tokens=[("<|start|>", start)])
    j = json.loads(tok.to_str())
    kept = vocab.choose(j, Counter(tok.encode("Tokyo octopuses").ids), 280)
    assert len(kept) == 280 and start in kept and end in kept
    small = Tokenizer.from_str(json.dumps(vocab.trim_tokenizer(j, kept)))
    assert small.get_vocab_size() == 280 and small.token_to_id("<|end|>") == 279 and small.token_to_id("<|start|>") == 278
    enc = small.encode("Tokyo octopuses")
    assert enc.ids[0] == 278 and small.decode(enc.ids) == "Tokyo octopuses"
    assert [kept[i] for i in enc.ids] == tok.encode("Tokyo octopuses").ids  # the words counted keep their tokens
    rare = small.encode("crème brûlée").ids  # not counted: its words may lose tokens, never their text
    assert max(rare) < 280 and small.decode(rare) == "crème brûlée"
    with pytest.raises(RecipeError, match="between 258 .* and 352"):
        vocab.choose(j, Counter(), 100)
    with pytest.raises(RecipeError, match="supports BPE tokenizers"):
        vocab.choose({"model": {"type": "Unigram"}}, Counter(), 100)


def test_build_with_a_pruned_vocabulary_compares_with_the_teacher_on_the_same_text(loaded, tmp_path):
    """Vocabulary cut only, no distillation: against the teacher (on the same text, in the student's
    tokens) KL is ~0 and agreement 100%; perplexity is per teacher token; the bundle ships the cut tokenizer."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from export.prune import PruneOptions
    from export.recipe import BuildOptions, build

    b = build(BuildOptions(output=tmp_path / "v.bundle", model=str(loaded.parent / "src"), precisions=("fp32",),
                           max_context=256, eval_samples=4, calibration_samples=4,
                           prune=PruneOptions(target_ratio=1.0, vocab_size=300, samples=4)), log=lambda s: None)
    m = Bundle.open(b.root).manifest
    assert m.model.vocab_size == 300
    ev = next(s for s in m.stages if s.name == "evaluate").metrics["engines"]
    assert ev["fp32"]["kl_to_fp32"] < 1e-4 and ev["fp32"]["top1_agreement"] == 1.0
    assert ev["fp32"]["eval_tokens"] == ev["teacher"]["eval_tokens"]  # perplexity over the same text
    assert ev["fp32"]["perplexity"] != ev["teacher"]["perplexity"]
    gen = Generator.from_bundle(Bundle.open(b.root), engine="fp32", threads=1)
    assert gen.tokenizer.tok.get_vocab_size() == 300
    text, _ = gen.complete(gen.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), SamplingConfig(max_new_tokens=4))
    assert isinstance(text, str)
    shutil.rmtree(b.root.with_name(b.root.name + ".work"), ignore_errors=True)


def test_distill_a_vocabulary_pruned_student(loaded, tmp_path):
    """The teacher reads the student's tokens in its own ids; the loss falls; a bad map is refused."""
    from export import distill, prune, vocab

    stu = tmp_path / "stu"
    prune.run(loaded, stu, prune.PruneOptions(target_ratio=0.6, vocab_size=320, kv_groups=1, multiple=16, samples=8))
    m = distill.run(loaded, stu, tmp_path / "out", _dopts(steps=20))
    assert m["loss_last"] < 0.8 * m["loss_first"], (m["loss_first"], m["loss_last"])
    assert (tmp_path / "out" / vocab.VOCAB_MAP).is_file()  # travels with the model to the next stages
    (stu / vocab.VOCAB_MAP).write_text(json.dumps({"teacher_ids": list(range(10))}))
    with pytest.raises(RecipeError, match="does not fit this teacher and student"):
        distill.run(loaded, stu, tmp_path / "out2", _dopts(steps=1))
    (stu / vocab.VOCAB_MAP).unlink()
    with pytest.raises(RecipeError, match="no vocab_map.json"):
        distill.run(loaded, stu, tmp_path / "out3", _dopts(steps=1))


# --- the distillation mixture (issue 28) ------------------------------------------------------------------

def test_mixture_masks_the_prompt_and_schedules_the_shares(loaded):
    """Teacher-written chats: loss on the answer only (mask aligned with the shifted targets); chat text:
    every token. The schedule gives each source its share of the rows, walks each source in epochs, and
    is the same for the same seed."""
    from export import mixture
    from export.load import chat_tokenizer

    tok = chat_tokenizer(loaded)
    chat = [{"role": "user", "content": "What is the capital of Japan?"}, {"role": "assistant", "content": "Tokyo is."}]
    ids, m = mixture.chat_sample(tok, chat, answer_only=True)
    masked = tok.decode([i for i, b in zip(ids, m) if b], skip_special_tokens=False)
    assert masked.startswith("Tokyo is.") and "capital" not in masked and not m[0]
    assert mixture.chat_sample(tok, chat, answer_only=False) == (ids, [True] * len(ids))
    p = mixture.pack("teacher", [([10, 11, 12, 13, 14, 15, 16, 17], [False, False, True, True, False, True, True, True])], 3)
    assert p.ids.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert p.mask.tolist() == [[False, True, True], [True, True, True]]  # mask[j] is for target ids[j + 1]
    sizes, w = {"teacher": 7, "chat": 50, "prose": 3}, {"teacher": 0.4, "chat": 0.2, "prose": 0.4}
    o = mixture.schedule(sizes, w, 25, 4, seed=0)
    assert o.shape == (25, 4) and np.array_equal(o, mixture.schedule(sizes, w, 25, 4, seed=0))
    assert not np.array_equal(o, mixture.schedule(sizes, w, 25, 4, seed=1))
    flat = o.ravel()
    assert ((flat < 7).sum(), ((flat >= 7) & (flat < 57)).sum(), (flat >= 57).sum()) == (40, 20, 40)
    assert sorted(np.bincount(flat[flat >= 57] - 57).tolist()) == [13, 13, 14]  # whole epochs, then part of one
    assert sorted(flat[flat < 7][:7].tolist()) == list(range(7))  # a block repeats only after its source's epoch
    assert mixture.shares({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}
    with pytest.raises(RecipeError, match=r"unknown sources \['web'\]"):
        _dopts(mixture={"web": 1.0})
    with pytest.raises(RecipeError, match="teacher share but teacher_answers = 0"):
        _dopts(mixture={"teacher": 1.0}, teacher_answers=0)
    with pytest.raises(RecipeError, match="shares must be >= 0"):
        _dopts(mixture={"chat": 0})


def test_same_recipe_twice_gives_the_same_weights_and_the_cap_is_loud(loaded, pruned, tmp_path):
    """A recipe fixes its steps: two runs give the same weights hash (a different seed does not); a run the
    time cap cuts short says so in its metrics and, loudly, in the report."""
    from export import distill
    from export.report import _stage_lines

    o = _dopts(steps=6, samples=20, mixture={"chat": 0.5, "prose": 0.5}, teacher_topk=8)
    a = distill.run(loaded, pruned, tmp_path / "a", o)
    b = distill.run(loaded, pruned, tmp_path / "b", o)
    c = distill.run(loaded, pruned, tmp_path / "c", dataclasses.replace(o, seed=1))
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]
    assert a["losses"] == b["losses"] and not a["cap_hit"] and a["tokens_seen"] == a["tokens_planned"] == 6 * 2 * 32
    assert set(a["mixture"]) == {"chat", "prose"} and a["mixture"]["chat"]["rows"] == a["mixture"]["prose"]["rows"] == 6
    assert a["text"] == "chats 50%, general prose 50%"
    cut = distill.run(loaded, pruned, tmp_path / "cut", dataclasses.replace(o, max_minutes=1e-9))
    assert cut["cap_hit"] and cut["steps"] == 1 and cut["steps_planned"] == 6
    assert "cut distillation short: 1 of the recipe's 6 steps (17% of its tokens)" in cut["stopped_early"]
    lines = _stage_lines({"stages": {"distill": cut}})
    assert lines[-1].startswith("**WARNING: the time cap") and "Distillation source prose: share 0.5" in "\n".join(lines)


def test_prune_measures_and_counts_general_prose_when_asked(loaded, tmp_path):
    """prose_samples: importance measured on prose "train" documents beside the chats; vocab_prose: the
    vocabulary keeps the tokens that prose uses most (never the held-out "eval" documents)."""
    from collections import Counter

    from export import prune, vocab
    from export.load import chat_tokenizer
    from export.mixture import prose_train
    from export.prose import prose_texts

    chats = prune.calibration_sequences(loaded, None, 4, 64)
    both = prune.calibration_sequences(loaded, None, 4, 64, prose=3)
    tok = chat_tokenizer(loaded)
    assert both[:len(chats)] == chats and both[len(chats):] == [tok.encode(t)[:64] for t in prose_train(3)]
    assert not set(prose_train()) & set(prose_texts("eval"))
    m = prune.run(loaded, tmp_path, prune.PruneOptions(target_ratio=1.0, vocab_size=300, samples=4, prose_samples=2,
                                                       vocab_prose=True))
    assert m["vocab_counted"] == "chat + prose" and "of the chat + prose tokens kept" in prune.describe(m)
    prose_counts = Counter(t for text in prose_train() for t in tok.encode(text))
    kept = set(vocab.teacher_ids(tmp_path).tolist())
    assert {i for i, _ in prose_counts.most_common(30)} <= kept


def test_teacher_questions_and_contexts_are_deduplicated():
    from export.teacher_answers import dedup_key, unique

    assert dedup_key("What is the capital of France?") == dedup_key("what is  the Capital of france") != dedup_key("Paris?")
    a, b = [{"role": "user", "content": "Hi, how are you?"}], [{"role": "user", "content": "hi how are you"}]
    c = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "how are you"}]
    assert unique([a, b, c, a]) == [a, c]


def test_report_recovery_lines_name_their_set():
    """Recovery on the held-out chats (perplexity) and on held-out prose (bits per byte), each saying which."""
    from export.report import _stage_lines

    eng = {"teacher": {"prose": {"bits_per_byte": 1.0}}, "pruned-only": {"prose": {"bits_per_byte": 2.0}},
           "fp32": {"prose": {"bits_per_byte": 1.25}}}
    lines = _stage_lines({"engines": eng, "recovered": 0.9})
    assert lines == ["Distillation recovered 90% of the perplexity increase pruning caused on the held-out chats "
                     "(teacher -> pruned-only -> fp32 rows).",
                     "On held-out general prose it recovered 75% of the rise in bits per byte pruning caused "
                     "(teacher 1.000 -> pruned-only 2.000 -> fp32 1.250: 1.250x the teacher)."]
    assert len(_stage_lines({"engines": {k: {} for k in eng}, "recovered": 0.9})) == 1  # no prose scored: no line


def test_the_loss_is_taken_where_the_mask_is():
    """Student logits outside the mask (a teacher-written chat's prompt) do not change the loss or get a
    gradient; inside it they do; `hard` positions add the cross-entropy of the teacher's sampled tokens."""
    import torch

    from export.distill import masked_loss, teacher_topk

    g = torch.Generator().manual_seed(0)
    s = torch.randn(10, 30, generator=g, requires_grad=True)
    t = torch.randn(10, 30, generator=g) * 2
    y = torch.randint(0, 30, (10,), generator=g)
    mask = torch.tensor([False] * 4 + [True] * 6)
    none = torch.zeros(10, dtype=torch.bool)
    for teacher in (t, teacher_topk(t, 1.0, 8)):
        base = masked_loss(s, teacher, mask, none, y, 1.0, 0.5)
        (grad,) = torch.autograd.grad(base, s)
        assert grad[:4].abs().max() == 0 and grad[4:].abs().max() > 0
        prompt_changed = s.detach().clone()
        prompt_changed[:4, 0] += 5  # one logit (a whole row shifted is the same softmax)
        torch.testing.assert_close(masked_loss(prompt_changed, teacher, mask, none, y, 1.0, 0.5), base.detach())
        answer_changed = s.detach().clone()
        answer_changed[6, 0] += 5
        assert not torch.isclose(masked_loss(answer_changed, teacher, mask, none, y, 1.0, 0.5), base.detach())
        with_ce = masked_loss(s, teacher, mask, mask, y, 1.0, 0.5)
        ce = torch.nn.functional.cross_entropy(s[mask], y[mask])
        torch.testing.assert_close(with_ce, base + 0.5 * ce)
    assert float(masked_loss(s, t, none, none, y, 1.0, 0.5)) == 0


@pytest.mark.parametrize("recipe", sorted(Path(__file__).parent.parent.glob("recipes/*.toml")), ids=lambda p: p.name)
def test_shipped_recipes_load(recipe):
    """Every recipe parses (no unknown option); the pruned one fixes its steps on the three-source mixture."""
    from export.recipe import BuildOptions

    o = BuildOptions.from_toml(recipe, output="x.bundle")
    if o.distill is not None:
        assert set(o.distill.mixture) == {"teacher", "chat", "prose"} and o.distill.teacher_answers > 0
        assert o.prune.vocab_prose and o.prune.prose_samples > 0 and o.distill.threads
