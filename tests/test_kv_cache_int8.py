"""The 8-bit KV cache (`--kv-cache int8`, export/kv_int8.py) on a tiny bundle: recorded in the manifest, int8
buffers at run time, logits close to the float cache's, the scheduler's batching, prompt cache and drafts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge.backends.onnxruntime import OrtDecoder
from edge.bundle import Bundle
from edge.decode.cache import SharedBatchCache
from edge.decode.generate import Generator
from edge.decode.sampling import SamplingConfig
from edge.errors import BundleError, ManifestError, RecipeError
from edge.io_contract import FUSED_IO, DecoderIO

from conftest import assert_batched_steps_equal_alone, run_cli

PROMPT = [{"role": "user", "content": "Tell me a fun fact about octopuses and the ocean, please."}]


def _build(root, model_dir, **kw):
    from export.recipe import BuildOptions, build

    return build(BuildOptions(output=root / "b.bundle", model=str(model_dir), precisions=("int8-dynamic",),
                              max_context=256, calibration_samples=8, **kw), log=lambda s: None)


@pytest.fixture(scope="module")
def kv8_bundle(tmp_path_factory, tiny_model_dir):
    return _build(tmp_path_factory.mktemp("kv8"), tiny_model_dir, kv_cache="int8", eval_samples=2)


@pytest.fixture(scope="module")
def float_bundle(tmp_path_factory, tiny_model_dir):
    """The same build without the flag (what every bundle was before it)."""
    return _build(tmp_path_factory.mktemp("kvfloat"), tiny_model_dir, skip_eval=True)


@pytest.fixture(scope="module")
def kv8_gen(kv8_bundle):
    return Generator.from_bundle(Bundle.open(kv8_bundle.root), engine="int8-dynamic", threads=1)


@pytest.fixture(scope="module")
def float_twin(kv8_bundle, tmp_path_factory):
    """The same engine (same weights and nodes) with a float32 cache: what the bundle held without the flag."""
    from export.kv_int8 import float_twin

    src = kv8_bundle.path("engines/int8-dynamic/model.onnx").parent
    dst = tmp_path_factory.mktemp("twin")
    float_twin(src, dst)
    dec = OrtDecoder(dst / "model.onnx", kv8_bundle.manifest.model, FUSED_IO, threads=1)
    dec.path = dst / "model.onnx"
    return dec


def test_the_manifest_records_the_int8_cache_and_the_runtime_binds_int8(kv8_bundle, kv8_gen, float_twin):
    m = json.loads((kv8_bundle.root / "manifest.json").read_text())
    io = m["engines"][0]["io"]
    assert io["kv_cache"] == "int8" and io["kv_scale_key"] == "kv_scale.{i}.key" and m["schema_version"] == 7
    stage = next(s for s in m["stages"] if s["name"] == "kv-int8-int8-dynamic")
    assert stage["metrics"]["layers"] == 2 and stage["metrics"]["calibration_texts"] == 8
    assert m["engines"][0]["quality"]["kl_to_fp32"] >= 0  # the evaluate stage ran the int8-KV engine
    dec = kv8_gen.decoder
    assert dec.io.kv_int8
    cache, ref = dec.new_cache(capacity=64), float_twin.new_cache(capacity=64)
    assert cache.arrays[0].dtype == np.int8 and ref.arrays[0].dtype == np.float32
    per_token = sum(a.nbytes for a in cache.arrays) / 64
    assert per_token * 4 == sum(a.nbytes for a in ref.arrays) / 64  # a quarter of fp32's, half of fp16's
    r = run_cli("edge.cli", "info", str(kv8_bundle.root))
    assert r.returncode == 0 and "onnx/int8-dynamic/fused int8-KV" in r.stdout, r.stdout + r.stderr


def test_int8_logits_stay_close_to_the_float_cache(kv8_gen, float_twin):
    """Prefill, then 24 decode steps that read the int8 cache: every logit within 1% of the float cache's logit
    spread, next-token KL under 1e-4 nats. Why these bounds: int8 rounding at per-channel scales moves a value by
    at most half a step (1/254 of the channel's range); on this random 2-layer model that measured 0.27% of the
    spread and a KL of 1e-6 (its distributions are near uniform, so KL says little here: SmolLM2-135M's, on
    1k-4k-token held-out prose, is in docs/speed.md); 1% leaves room for thread-count rounding. Scales 10x too
    small (saturation) or a cache read as the wrong type land far outside."""
    dec = kv8_gen.decoder
    ids = kv8_gen.tokenizer.encode_chat(PROMPT)
    feed = [int(t) for t in np.random.default_rng(0).integers(5, 300, 24)]
    outs = []
    for d in (float_twin, dec):
        c = d.new_cache(capacity=len(ids) + len(feed))
        first = d.prefill(ids, c)
        outs.append(np.concatenate([first, *[d.forward(np.array([[t]]), c) for t in feed]]))
    ref, got = outs

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(got)
    kl = (np.exp(p) * (p - q)).sum(-1)
    assert kl.mean() < 1e-4, kl
    assert np.abs(ref - got).max() < 0.01 * (ref.max() - ref.min())
    assert (ref.argmax(-1) == got.argmax(-1)).mean() >= 0.9
    assert not np.array_equal(ref, got)  # it really is another cache


def test_a_bundle_without_the_flag_keeps_its_float_cache(float_bundle, float_twin, kv8_gen):
    """Without --kv-cache the manifest says nothing new (an older edgechat still reads it), the cache is float32,
    and the engine is the int8-KV engine's float twin: the same logits."""
    m = json.loads((float_bundle.root / "manifest.json").read_text())
    assert all("kv_cache" not in e.get("io", {}) for e in m["engines"]) and m["schema_version"] == 5
    assert not any(s["name"].startswith("kv-int8") for s in m["stages"])
    dec = Generator.from_bundle(Bundle.open(float_bundle.root), engine="int8-dynamic", threads=1).decoder
    assert not dec.io.kv_int8 and dec.new_cache(capacity=8).arrays[0].dtype == np.float32
    ids = kv8_gen.tokenizer.encode_chat(PROMPT)
    np.testing.assert_array_equal(dec.prefill(ids, dec.new_cache(capacity=64)),
                                  float_twin.prefill(ids, float_twin.new_cache(capacity=64)))


def test_the_runtime_refuses_a_graph_that_disagrees_with_its_manifest(kv8_bundle, float_twin):
    int8_graph = kv8_bundle.path("engines/int8-dynamic/model.onnx")
    dims = kv8_bundle.manifest.model
    with pytest.raises(BundleError, match="int8 KV cache that its manifest does not name"):
        OrtDecoder(int8_graph, dims, FUSED_IO, threads=1)
    from export.kv_int8 import int8_io

    with pytest.raises(BundleError, match="manifest says its KV cache is int8"):
        OrtDecoder(float_twin.path, dims, int8_io(), threads=1)
    with pytest.raises(ManifestError, match="KV cache 'int4'"):
        DecoderIO.from_dict(int8_io().to_dict() | {"kv_cache": "int4"})
    with pytest.raises(ManifestError, match="scale names"):
        DecoderIO.from_dict(FUSED_IO.to_dict() | {"kv_cache": "int8"})


def test_a_bad_kv_cache_value_is_one_clear_error(tiny_model_dir, tmp_path):
    from export.recipe import BuildOptions

    with pytest.raises(RecipeError, match=r"--kv-cache must be one of float, int8, got 'int4'"):
        BuildOptions(output=tmp_path / "b", kv_cache="int4")
    with pytest.raises(RecipeError, match="fused CPU graph"):
        BuildOptions(output=tmp_path / "b", precisions=("fp32",), kv_cache="int8")
    recipe = tmp_path / "r.toml"
    recipe.write_text('[build]\nprecisions = ["int8-dynamic"]\nkv_cache = "int8"\n')
    assert BuildOptions.from_toml(recipe, output=tmp_path / "b").kv_cache == "int8"  # the recipe key
    recipe.write_text('[build]\nkv_cache = "q8_0"\n')
    with pytest.raises(RecipeError, match="got 'q8_0'"):
        BuildOptions.from_toml(recipe, output=tmp_path / "b")
    for argv in (("build", str(tiny_model_dir), "-o", str(tmp_path / "b"), "--kv-cache", "fp8"),
                 ("plan", "--target", "t4", "--kv-cache", "fp8")):
        r = run_cli("export.cli", *argv)
        assert r.returncode == 2 and r.stderr.strip() == "error: --kv-cache must be one of float, int8, got 'fp8'", \
            r.stderr


def test_the_planner_counts_one_byte_per_element_for_the_fused_engines():
    from edge.device.profiles import load_profile
    from export.model_source import describe
    from export.planner import GB, PlanOptions, kv_bytes_per_token, plan

    dims = describe("default")[1]
    nano = load_profile("orin-nano-8gb")
    full = plan(dims, nano, "int8-dynamic", PlanOptions(context=2048))
    kv8 = plan(dims, nano, "int8-dynamic", PlanOptions(context=2048, kv_cache="int8"))
    assert kv8.kv_cache_gb * 2 == pytest.approx(full.kv_cache_gb)  # fp16 on the GPU -> int8
    assert kv8.kv_cache_gb * GB == pytest.approx(kv_bytes_per_token(dims, 1) * 2048)
    assert plan(dims, nano, "fp16", PlanOptions(kv_cache="int8")).kv_cache_gb == \
        plan(dims, nano, "fp16", PlanOptions()).kv_cache_gb  # TensorRT's plain graph keeps its float cache
    assert kv8.total_gb < full.total_gb and kv8.decode_tok_s > full.decode_tok_s
    with pytest.raises(RecipeError, match="--kv-cache must be one of"):
        PlanOptions(kv_cache="q8_0")
    # the plan command's memory column: 2048 tokens x 30 layers x 2 x 3 KV heads x 64 x 1 byte = 23.6 MB
    rows = {}
    for flag in ((), ("--kv-cache", "int8")):
        r = run_cli("export.cli", "plan", "--target", "orin-nano-8gb", "--precision", "int8-dynamic", *flag)
        assert r.returncode == 0, r.stderr
        rows[flag] = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("int8-dynamic"))
    assert "0.024 GB" in rows[("--kv-cache", "int8")] and "0.047 GB" in rows[()], rows


def test_batched_steps_equal_each_row_alone(kv8_gen):
    dec = kv8_gen.decoder
    prompts = [kv8_gen.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in ("Hi!", "How are you today?")]
    assert_batched_steps_equal_alone(dec, prompts, [11, 42], capacity=64, atol=1e-5)


def test_prompt_cache_gives_the_uncached_numbers_bit_for_bit(kv8_gen):
    """A prompt whose start comes from the prompt cache (int8 K/V copied into its slot) gets the logits and the
    int8 K/V of an uncached prefill, bit for bit."""
    dec = kv8_gen.decoder
    bc = SharedBatchCache(dec, slots=5, capacity=16, prompt_cache_bytes=1 << 20)
    first = list(range(10, 110))
    bc.prefill_rows([first])
    bc.remember(0, first)
    bc.remove([0])
    assert bc.prompts.entries and bc.prompts.entries[0][1][0].dtype == np.int8
    prompts = [first + [63, 64], first[:70] + [60], [5, 6, 7], list(range(200, 230))]  # the new two: one batched call
    got = bc.prefill_rows(prompts)
    assert bc.reused_rows == [64, 64, 0, 0]
    for i, p in enumerate(prompts):
        c = dec.new_cache(capacity=128)
        np.testing.assert_array_equal(got[i], dec.prefill(p, c)[0])
        for a, b in zip(bc.buffers.arrays, c.arrays):
            np.testing.assert_array_equal(a[i, :, :len(p)], b[0, :, :len(p)])


def test_drafts_are_checked_and_give_the_plain_answer(kv8_gen):
    """Speculative decoding on the int8 cache: the verify call reads the same int8 K/V a step would (the op
    quantizes the new tokens before it attends), and a rejected draft's rollback leaves what a fresh prefill
    leaves, so greedy answers are identical with and without drafting."""
    ids = kv8_gen.tokenizer.encode_chat(PROMPT)
    for cfg in (SamplingConfig(max_new_tokens=40, ignore_eos=True), SamplingConfig(max_new_tokens=30)):
        kv8_gen.speculative = False
        want = list(kv8_gen.stream(ids, cfg))
        kv8_gen.speculative = True
        got = list(kv8_gen.stream(ids, cfg))
        assert got[-1].token_ids == want[-1].token_ids and got[-1].finish_reason == want[-1].finish_reason
    assert kv8_gen.speculator.stats.drafted > 0


def test_served_answers_equal_single_user_answers(kv8_gen):
    from edge.decode.scheduler import Scheduler

    prompts = ["Hello!", "What is the capital of Japan?", "I like to read books.", "How are you doing today?"]
    ids = [kv8_gen.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    cfgs = [kv8_gen.sampling(max_new_tokens=20 + 5 * i, ignore_eos=True) for i in range(len(ids))]
    alone = [kv8_gen.complete(i, c)[1].token_ids for i, c in zip(ids, cfgs)]
    s = Scheduler(kv8_gen, max_batch=3, max_queue=8).start()
    try:
        got = [r.answer(timeout=60)[1].token_ids for r in [s.submit(i, c) for i, c in zip(ids, cfgs)]]
    finally:
        s.stop()
    assert got == alone
