"""`edge-export build --draft`: a draft cut from the model, distilled on its answers, shipped inside its bundle
and used by edge-chat by default; its acceptance measured at build with the runtime that ships."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from conftest import make_tiny_model, run_cli
from edge.errors import RecipeError

STAGES = ["draft-prune", "draft-teacher-answers", "draft-distill", "draft-export", "draft-head",
          "draft-quantize-int8-dynamic", "draft-acceptance"]


def _draft_opts(**kw):
    from export.distill import DistillOptions
    from export.draft import DraftOptions

    distill = DistillOptions(steps=6, batch_size=2, seq_len=32, lr=1e-3, warmup=2, samples=60, checkpoint_every=4,
                             mixture={"teacher": 0.5, "chat": 0.5}, teacher_answers=40, answer_tokens=24,
                             teacher_prompts="data")  # a random-init model cannot write its own questions
    return DraftOptions(**({"layers": 1, "samples": 4, "distill": distill, "acceptance_chats": 3,
                            "acceptance_tokens": 16, "head_tokens": 300} | kw))  # of the tiny model's 400


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A 4-block tiny model's int8 bundle with a 1-block draft; the build's log lines."""
    from export.recipe import BuildOptions, build

    d = tmp_path_factory.mktemp("draft-build")
    src = make_tiny_model(d / "src", layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=1)
    lines: list[str] = []
    opts = BuildOptions(output=d / "t.bundle", model=str(src), precisions=("fp32", "int8-dynamic"), max_context=256,
                        skip_eval=True, calibration_samples=4, gptq_samples=4, draft=_draft_opts())
    b = build(opts, log=lines.append)
    return b, opts, lines


def test_the_bundle_ships_a_verified_draft_with_its_measured_acceptance(built):
    from edge.bundle import MANIFEST, Bundle
    from edge.decode.speculative import same_vocabulary
    from edge.decode.tokenizer import ChatTokenizer

    b, opts, lines = built
    m = Bundle.open(b.root, verify="full").manifest
    assert [s.name for s in m.stages][-len(STAGES):] == STAGES
    dr = m.draft
    assert dr["path"] == "draft" and dr["engine"] == "int8-dynamic" and dr["target_engine"] == "int8-dynamic"
    assert dr["num_layers"] == 1 and dr["num_parameters"] < m.model.num_parameters
    # the draft's files are the outer bundle's too: listed, sized and hashed
    assert f"draft/{MANIFEST}" in m.files and "draft/engines/int8-dynamic/model.onnx" in m.files
    inner = Bundle.open(b.root / "draft", verify="full")
    assert inner.manifest.bundle_id == dr["bundle_id"] and dr["bytes"] == inner.manifest.engine_bytes("int8-dynamic")
    assert [e.fingerprint.variant for e in inner.manifest.engines] == ["fused"]
    io = inner.manifest.engines[0].io
    assert io["logit_ids"] == "engines/int8-dynamic/logit_ids.npy" and f"draft/{io['logit_ids']}" in m.files
    assert dr["head_tokens"] == 300 and inner.manifest.schema_version == m.schema_version == 6
    same_vocabulary(ChatTokenizer(b.root / m.tokenizer.file, m.tokenizer),
                    ChatTokenizer(inner.path(inner.manifest.tokenizer.file), inner.manifest.tokenizer))
    acc = dr["acceptance"]
    assert acc["k"] == 4 and acc["chats"] == 3 and 0 <= acc["acceptance"] <= 1 and acc["drafted"] > 0
    assert acc["accepted"] == round(acc["acceptance"] * acc["drafted"])
    assert any(line.startswith("[draft] acceptance") for line in lines)


def test_the_recorded_acceptance_is_what_the_runtime_gets(built):
    """Recount the acceptance with the shipped engines through the scheduler's loop (greedy, k = 4 at every
    step): the build's number is not invented."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from edge.decode.speculative import ModelDrafter, RowSpeculator, SpecStats
    from export.data import load_chats

    b, _, _ = built
    bundle = Bundle.open(b.root)
    target = Generator.from_bundle(bundle, engine="int8-dynamic", threads=1)
    draft = Generator.from_bundle(bundle.draft_bundle(), engine="int8-dynamic", threads=1, spin=False)
    stats = SpecStats()
    for chat in load_chats(None, "evaluation", 3):
        spec = RowSpeculator.fixed(ModelDrafter(draft.decoder, target.decoder.dims.vocab_size), 4)
        spec.stats = stats
        list(target.stream(target.tokenizer.encode_chat(chat[:1]), SamplingConfig(max_new_tokens=16), speculator=spec))
    acc = bundle.manifest.draft["acceptance"]
    assert (stats.drafted, stats.accepted) == (acc["drafted"], acc["accepted"])


def test_edge_chat_drafts_with_the_bundles_draft_unless_told_not_to(built):
    b, _, _ = built
    on = run_cli("edge.cli", "-v", "run", str(b.root), "Hi", "--engine", "int8-dynamic", "--threads", "1",
                 "--max-new-tokens", "8")
    assert on.returncode == 0 and "drafting with the bundle's draft" in on.stderr, on.stderr
    off = run_cli("edge.cli", "-v", "run", str(b.root), "Hi", "--engine", "int8-dynamic", "--threads", "1",
                  "--max-new-tokens", "8", "--no-draft")
    assert off.returncode == 0 and "drafting" not in off.stderr, off.stderr
    fp32 = run_cli("edge.cli", "-v", "run", str(b.root), "Hi", "--engine", "fp32", "--threads", "1", "--max-new-tokens", "4")
    assert fp32.returncode == 0 and "draft model is not used: engine fp32 cannot verify" in fp32.stderr, fp32.stderr
    both = run_cli("edge.cli", "run", str(b.root), "Hi", "--no-draft", "--draft", str(b.root / "draft"))
    assert both.returncode != 0 and "--draft and --no-draft contradict" in both.stderr
    info = run_cli("edge.cli", "info", str(b.root))
    assert info.returncode == 0 and "draft    draft/ int8-dynamic: 1 layers" in info.stdout, info.stdout


def test_the_bundles_draft_really_drafts_and_golden_rechecks_never_draft(built):
    """Through edge-chat's own loader: the answer's steps were drafted and checked (not just a log line); the
    golden re-check (answers compared with the recorded ones) loads no draft."""
    from edge.cli import _gen, make_parser
    from edge.decode.sampling import SamplingConfig

    b, _, _ = built
    gen = _gen(make_parser().parse_args(["run", str(b.root), "Hi", "--engine", "int8-dynamic", "--threads", "1"]))
    assert gen.drafter is not None and "the bundle's own" in gen.draft_source
    list(gen.stream(gen.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]),
                    SamplingConfig(max_new_tokens=24, ignore_eos=True)))
    assert gen.speculator.stats.drafted > 0 and gen.speculator.stats.accepted > 0
    golden = _gen(make_parser().parse_args(["golden", str(b.root), "--engine", "int8-dynamic", "--threads", "1"]))
    assert golden.drafter is None and not golden.speculative


def test_a_draft_that_does_not_load_is_a_warning_not_a_failed_start(built, tmp_path):
    b, _, _ = built
    copy = tmp_path / "c.bundle"
    shutil.copytree(b.root, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["draft"]["engine"] = "int4-weight"  # the draft has no such engine
    (copy / "manifest.json").write_text(json.dumps(m))
    out = run_cli("edge.cli", "run", str(copy), "Hi", "--engine", "int8-dynamic", "--threads", "1",
                  "--max-new-tokens", "4", "--no-verify")
    assert out.returncode == 0 and "the bundle's draft model is not used: bundle has no engine named 'int4-weight'" \
        in out.stderr, out.stderr


def test_the_server_says_it_drafts_with_the_bundles_draft(built):
    from conftest import ServerProcess

    b, _, _ = built
    server = ServerProcess(b.root, "--engine", "int8-dynamic", "--no-ui")
    code, out = server.stop()
    assert code == 0 and "draft       src int8-dynamic drafts" in out and "the bundle's own" in out, out


def test_a_changed_draft_file_fails_the_bundles_verification(built, tmp_path):
    from edge.bundle import Bundle
    from edge.errors import HashMismatchError

    b, _, _ = built
    copy = tmp_path / "copy.bundle"
    shutil.copytree(b.root, copy)
    f = copy / "draft/engines/int8-dynamic/model.onnx"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match="'draft/engines/int8-dynamic/model.onnx'"):
        Bundle.open(copy, verify="full")
    (copy / "draft/manifest.json").unlink()
    with pytest.raises(Exception, match="draft/manifest.json"):
        Bundle.open(copy, verify="size")


def test_a_rebuild_reuses_the_drafts_stages_and_a_new_shape_rebuilds_them(built):
    """Same options: every draft stage reused. Two layers instead of one: the draft is pruned, distilled and
    measured again (the distillation does not resume another student's checkpoint), the model's stages kept."""
    import dataclasses

    from export.recipe import build

    b, opts, _ = built
    lines: list[str] = []
    again = build(opts, log=lines.append)
    for name in STAGES:
        assert any(line.startswith(f"[{name}] done earlier") for line in lines), (name, lines)
    assert again.manifest.draft["acceptance"] == b.manifest.draft["acceptance"]
    assert not (opts.work / ".draft-distill-checkpoint").exists()  # a finished distillation leaves none
    lines = []
    two = build(dataclasses.replace(opts, draft=_draft_opts(layers=2)), log=lines.append)
    assert two.manifest.draft["num_layers"] == 2
    assert any(line.startswith("[quantize-int8-dynamic] done earlier") for line in lines)
    assert not any(line.startswith(f"[{n}] done earlier") for n in ("draft-prune", "draft-distill", "draft-acceptance")
                   for line in lines), lines
    build(opts, log=lambda s: None)  # back to one layer for the other tests


@pytest.mark.parametrize("draft, match", [
    ({"path": "draft", "engine": "int8-dynamic", "acceptance": "high"}, "'draft' acceptance must be a dict"),
    ({"path": "draft", "engine": "int8-dynamic", "num_parameters": "46M"}, "'draft' num_parameters must be a int"),
    ({"path": "../x", "engine": "int8-dynamic"}, "must be a folder inside the bundle"),
    ({"path": "/abs", "engine": "int8-dynamic"}, "must be a folder inside the bundle"),
    ({"path": "draft"}, "needs 'engine'"),
    ("draft", "'draft' must be an object"),
])
def test_a_damaged_draft_entry_is_refused(built, tmp_path, draft, match):
    from edge.bundle import Bundle
    from edge.errors import ManifestError

    b, _, _ = built
    raw = json.loads((b.root / "manifest.json").read_text())
    copy = tmp_path / "c.bundle"
    copy.mkdir()
    (copy / "manifest.json").write_text(json.dumps(raw | {"draft": draft}))
    with pytest.raises(ManifestError, match=match):
        Bundle.open(copy, verify="none")


def test_draft_options_and_recipe_section(tmp_path):
    from export.draft import DraftOptions
    from export.recipe import BuildOptions

    r = tmp_path / "r.toml"
    r.write_text('[build]\nprecisions = ["int8-dynamic"]\n[draft]\nlayers = 3\nk = 2\n[draft.distill]\nsteps = 9\n')
    o = BuildOptions.from_toml(r, output="x.bundle")
    assert o.draft.layers == 3 and o.draft.k == 2 and o.draft.distill.steps == 9
    assert o.draft.distill.teacher_prompts == "teacher"  # the other draft defaults kept
    assert o.draft.prune_options(30).drop_layers == 27
    assert DraftOptions().prune_options(30).drop_layers == 25  # a sixth kept by default
    with pytest.raises(RecipeError, match="target has 3 blocks"):
        DraftOptions(layers=3).prune_options(3)
    for bad, match in ((dict(layers=0), "layers must be a whole number >= 1"),
                       (dict(precision="fp32"), "draft precision must be one of int8-dynamic, int4-weight"),
                       (dict(k=17), "k must be <= 16"), (dict(acceptance_chats=0), "acceptance_chats")):
        with pytest.raises(RecipeError, match=match):
            DraftOptions(**bad)
    for text, match in (('draft = true\n', "draft must be a \\[draft\\] table"),
                        ('[draft]\nlayers = true\n', "layers must be a whole number"),
                        ('[draft]\nhead_tokens = -1\n', "head_tokens must be a whole number >= 0")):
        r.write_text(text)
        with pytest.raises(RecipeError, match=match):
            BuildOptions.from_toml(r, output="x.bundle")
    r.write_text('[draft]\nlayer = 3\n')
    with pytest.raises(RecipeError, match=r"\[draft\] has unknown options \['layer'\]"):
        BuildOptions.from_toml(r, output="x.bundle")
    r.write_text('[draft.distill]\nstep = 3\n')
    with pytest.raises(RecipeError, match=r"\[draft.distill\] has unknown options \['step'\]"):
        BuildOptions.from_toml(r, output="x.bundle")
    with pytest.raises(RecipeError, match="fused CPU engine.*add --precision int8-dynamic"):
        BuildOptions(output=Path("x.bundle"), precisions=("fp32",), draft=DraftOptions())
    with pytest.raises(RecipeError, match="--no-fused"):
        BuildOptions(output=Path("x.bundle"), fused=False, draft=DraftOptions())
    ns = dict(output="o.bundle", model="default", recipe=None, precision=None, max_context=None, calibration=None,
              eval_samples=None, skip_eval=False, fresh=False, online=False)
    assert BuildOptions.from_cli(argparse.Namespace(**ns)).draft is None
    assert BuildOptions.from_cli(argparse.Namespace(**(ns | {"draft": True}))).draft == DraftOptions()
    assert BuildOptions.from_cli(argparse.Namespace(**(ns | {"draft_layers": 2}))).draft.layers == 2


def test_edge_export_build_draft_flag_errors():
    out = run_cli("export.cli", "build", "--draft-layers", "0", "-o", "/tmp/never.bundle")
    assert out.returncode != 0 and "--draft-layers" in out.stderr
    out = run_cli("export.cli", "build", "--draft", "--precision", "fp32", "-o", "/tmp/never.bundle")
    assert out.returncode != 0 and "add --precision int8-dynamic" in out.stderr, out.stderr


def test_a_cut_head_scores_its_tokens_as_the_whole_head_does(tmp_path):
    """The cut graph's logits on its ids equal the whole graph's; every other id is -inf, so argmax, sampling
    and the drafter only ever pick kept ids; the runtime checks the ids file it is given."""
    import numpy as np

    from edge.errors import BundleError
    from edge.io_contract import FUSED_IO
    from edge.backends.onnxruntime import OrtDecoder, _logit_ids
    from export import draft, fused_graph, load
    from export.load import model_dims
    from export.model_source import resolve

    src = make_tiny_model(tmp_path / "src", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=3)
    load.run(resolve(str(src)), tmp_path / "hf")
    fused_graph.write(tmp_path / "hf", tmp_path / "full")
    (tmp_path / "cut").mkdir()
    with pytest.raises(RecipeError, match="draft head_tokens=120 must lie between 259"):
        draft.cut_head(tmp_path / "full", tmp_path / "cut", tmp_path / "hf", 120)
    m = draft.cut_head(tmp_path / "full", tmp_path / "cut", tmp_path / "hf", 300)
    ids = np.load(tmp_path / "cut" / draft.HEAD_IDS)
    assert m["head_tokens"] == len(ids) == 300 and 0 < m["chat_token_coverage"] <= 1
    dims = model_dims(tmp_path / "hf")
    full = OrtDecoder(tmp_path / "full/model.onnx", dims, FUSED_IO, threads=1)
    cut = OrtDecoder(tmp_path / "cut/model.onnx", dims, FUSED_IO, threads=1, logit_ids=ids.astype(np.int64))
    prompt = [1, 5, 9, 200, 37, 399, 12]
    a = full.forward(np.array([prompt]), full.new_cache(capacity=16), last_only=False)
    b = cut.forward(np.array([prompt]), cut.new_cache(capacity=16), last_only=False)
    assert a.shape == b.shape == (1, len(prompt), dims.vocab_size)
    np.testing.assert_allclose(b[..., ids], a[..., ids], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(b, ids, axis=-1)).all()
    assert set(b.argmax(-1).ravel().tolist()) <= set(ids.tolist())
    with pytest.raises(Exception, match="LM head 300 columns != 299 ids"):
        OrtDecoder(tmp_path / "cut/model.onnx", dims, FUSED_IO, threads=1, logit_ids=ids[:-1].astype(np.int64))

    class Fake:  # a bundle whose ids file is damaged in each way the runtime must refuse
        def path(self, rel):
            return tmp_path / rel

    for bad in (np.array([1, 1, 2]), np.array([0, dims.vocab_size]), np.array([[1, 2]]), np.array([0.5, 1.0]),
                np.array([], np.int64)):
        np.save(tmp_path / "bad.npy", bad)
        with pytest.raises(BundleError, match="distinct vocabulary ids"):
            _logit_ids(Fake(), "bad.npy", dims.vocab_size)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(BundleError, match="cannot read the LM head's ids junk.npy"):
        _logit_ids(Fake(), "junk.npy", dims.vocab_size)


def test_a_draft_that_cannot_be_built_fails_before_the_model_is_built(tmp_path):
    """Too many layers, or a head smaller than the tokens always kept: refused right after the load stage."""
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path / "src", layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=5)
    for kw, match in ((dict(layers=2), "draft layers = 2, but the target has 2 blocks"),
                      (dict(head_tokens=100), "draft head_tokens=100 must lie between 259")):
        opts = BuildOptions(output=tmp_path / "x.bundle", model=str(src), skip_eval=True, draft=_draft_opts(**kw))
        with pytest.raises(RecipeError, match=match):
            build(opts, log=lambda s: None)
        assert not (opts.work / "export").exists()
