"""The edge runtime on a tiny exported model: parity, KV cache, template, sampling, streaming, overflow, and which
engine a machine (or forced execution providers) gets."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from edge.bundle import Bundle
from edge.decode.chat import Chat
from edge.errors import BundleError, ContextOverflowError, EdgeChatError
from edge.decode.generate import Generator
from edge.decode.sampling import SamplingConfig

CHATS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How are you?"},
     {"role": "user", "content": "Naïve café 🙂 — fine."}],
]


def test_export_parity_recorded(tiny_bundle):
    par = tiny_bundle.manifest.engine("fp32").quality["parity"]
    assert par["max_abs_logit_diff"] <= 1e-3
    assert par["greedy_tokens_identical"] and par["greedy_tokens"] == 64


def test_fused_graph_recorded_per_engine(tiny_bundle):
    """The manifest says which graph each engine is and the contract it binds; the fused graph's parity is recorded."""
    from edge.io_contract import FUSED_IO

    m = tiny_bundle.manifest
    variants = {e.name: e.fingerprint.variant for e in m.engines}
    assert variants == {"fp32": "plain", "int8-qdq": "plain", "int8-dynamic": "fused", "int4-weight": "fused"}
    for e in m.engines:
        assert m.engine_io(e) == (FUSED_IO.to_dict() if e.fingerprint.variant == "fused" else m.io)
    fused = m.engine("fp32").quality["parity"]["fused"]
    assert fused["written"] and fused["greedy_tokens_identical"] and fused["max_abs_logit_diff"] <= 1e-3
    assert "tensorrt_check" not in m.engine("int8-dynamic").quality  # TensorRT builds from plain graphs only


@pytest.mark.parametrize("engine", ["fp32", "int8-dynamic", "int8-qdq", "int4-weight"])
def test_kv_cache_decode_equals_full_recompute(tiny_bundle, engine):
    gen = Generator.from_bundle(tiny_bundle, engine=engine, threads=1)
    d = gen.decoder
    ids = gen.tokenizer.encode_chat(CHATS[2])
    full = d.forward(np.array([ids]), d.new_cache(), last_only=False)[0]
    cache = d.new_cache()
    d.forward(np.array([ids[:5]]), cache)
    for k in range(5, len(ids)):
        step = d.forward(np.array([[ids[k]]]), cache)[0]
        np.testing.assert_allclose(step, full[k], atol=2e-4 if engine == "fp32" else 5e-2)
    assert cache.length == len(ids)


def test_fused_cache_grows_in_place_and_keeps_what_it_holds(fused_generator):
    """A fused cache sized too small is grown (doubling, capped at the context) without changing any logit:
    each step equals the same step on a cache that was large enough from the start (both one-token steps,
    so the same kernels; a whole-prompt pass may take other MatMulNBits kernels, on AVX2 ~3e-3 apart)."""
    d = fused_generator.decoder
    ids = fused_generator.tokenizer.encode_chat(CHATS[2])
    roomy, cache = d.new_cache(capacity=len(ids)), d.new_cache(capacity=4)
    assert cache.capacity == 4 and cache.values[0].shape()[2] == 4
    d.forward(np.array([ids[:3]]), roomy), d.forward(np.array([ids[:3]]), cache)
    for k in range(3, len(ids)):
        want = d.forward(np.array([[ids[k]]]), roomy)[0]
        np.testing.assert_allclose(d.forward(np.array([[ids[k]]]), cache)[0], want, atol=1e-5)
    assert 4 < cache.capacity <= d.dims.max_context and cache.capacity >= len(ids)
    with pytest.raises(ContextOverflowError, match="context of 256"):
        d.forward(np.zeros((1, 300), np.int64), d.new_cache(capacity=8))


def test_scoring_many_lengths_keeps_no_large_logits_buffer(fused_generator, monkeypatch):
    """A decoder keeps a logits buffer per decode shape (reused every token), but not one per prompt length it
    scored: a 1.5B model's [512, 152k] logits are 311 MB a shape, and the evaluate stage grew by GBs that way.
    The calls' answers are the same either way (here the limit is made tiny so the tiny model's shapes pass it)."""
    import edge.backends.onnxruntime as ortb

    d = fused_generator.decoder
    ids = np.arange(3, 3 + 120) % d.dims.vocab_size
    want = {n: d.forward(ids[None, :n], d.new_cache(capacity=n), last_only=False) for n in (17, 40, 77, 120)}
    d.forward(ids[None, :1], d.new_cache(capacity=8))  # a decode-sized call
    monkeypatch.setattr(ortb, "KEEP_LOGITS_BYTES", 2 * d.dims.vocab_size * 4)
    d._mine.logits.clear()
    for n, logits in want.items():
        np.testing.assert_array_equal(d.forward(ids[None, :n], d.new_cache(capacity=n), last_only=False), logits)
    step = d.forward(ids[None, :1], d.new_cache(capacity=8))
    np.testing.assert_array_equal(step, d.forward(ids[None, :1], d.new_cache(capacity=8)))
    assert list(d._mine.logits) == [(1, 1, d.dims.vocab_size)]  # only the decode shape is kept
    monkeypatch.setattr(d, "_logits_width", None)  # a graph whose vocabulary dimension is not fixed: ORT allocates
    np.testing.assert_array_equal(d.forward(ids[None, :40], d.new_cache(capacity=40), last_only=False), want[40])


def test_fused_greedy_equals_plain_greedy(tiny_bundle, tiny_generator):
    """The fused graph's greedy answer equals the plain graph's (same fp32 weights, exported twice)."""
    from edge.io_contract import FUSED_IO
    from edge.backends.onnxruntime import OrtDecoder

    work = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work")
    fused = OrtDecoder(work / "export" / "fused" / "model.onnx", tiny_bundle.manifest.model, FUSED_IO, threads=1)
    gen = Generator(tiny_generator.tokenizer, fused)
    cfg = SamplingConfig(max_new_tokens=40, ignore_eos=True)
    for chat in CHATS:
        ids = gen.tokenizer.encode_chat(chat)
        assert gen.complete(ids, cfg)[1].token_ids == tiny_generator.complete(ids, cfg)[1].token_ids


def test_logits_match_pytorch(tiny_bundle, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gen = Generator.from_bundle(tiny_bundle, engine="fp32", threads=1)
    ids = gen.tokenizer.encode_chat(CHATS[0])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = gen.decoder.forward(np.array([ids]), gen.decoder.new_cache(), last_only=False)[0]
    assert np.abs(got - ref).max() < 1e-4


def test_greedy_equals_transformers_generate(tiny_generator, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = tiny_generator.tokenizer.encode_chat(CHATS[1])
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    expect = out[0, len(ids):].tolist()
    got = list(tiny_generator.tokens(ids, SamplingConfig(max_new_tokens=24)))
    n = next((i for i, t in enumerate(expect) if t in tiny_generator.tokenizer.eos_ids), len(expect))
    assert got == expect[:n]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_equals_transformers(tiny_generator, tiny_model_dir, chat, gen_prompt):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen_prompt)
    ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tiny_generator.tokenizer.render(chat, gen_prompt) == text
    assert tiny_generator.tokenizer.encode_chat(chat, gen_prompt) == list(ids)


def test_real_default_template_equals_transformers():
    """SmolLM2's own template (from the GGUF), rendered by us and by transformers."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from edge.decode.tokenizer import _template_env
    from export.model_source import default_gguf

    g = default_gguf()
    ref = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    env, _ = _template_env()
    for chat in CHATS:
        ours = env.from_string(ref.chat_template).render(messages=chat, add_generation_prompt=True,
                                                         bos_token=ref.bos_token, eos_token=ref.eos_token)
        assert ours == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_seeded_sampling_is_reproducible(tiny_generator):
    ids = tiny_generator.tokenizer.encode_chat(CHATS[0])
    cfg = SamplingConfig(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=123)
    a = list(tiny_generator.tokens(ids, cfg))
    b = list(tiny_generator.tokens(ids, cfg))
    c = list(tiny_generator.tokens(ids, SamplingConfig(max_new_tokens=20, temperature=1.0, seed=7)))
    assert a == b and len(a) > 0
    assert a != c


def test_sampler_filters():
    from edge.decode.sampling import Sampler

    logits = np.array([0.0, 5.0, 4.9, -3.0])
    assert Sampler(SamplingConfig())(logits) == 1
    picks = {Sampler(SamplingConfig(temperature=1.0, top_k=2, seed=s))(logits) for s in range(50)}
    assert picks == {1, 2}
    picks = {Sampler(SamplingConfig(temperature=1.0, top_p=0.3, seed=s))(logits) for s in range(50)}
    assert picks == {1}
    # repetition penalty pushes an already-seen token down
    assert Sampler(SamplingConfig(repetition_penalty=2.0))(logits, np.array([1])) == 2


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.9}, {"top_k": 40}, {"top_k": 300, "top_p": 0.95}, {"top_p": 0.999}])
def test_sampler_draws_from_the_filtered_softmax(kw):
    """The sampler never sorts the vocabulary (it is called per sequence per step); its draws must still
    follow softmax(logits / T) restricted to top-k then top-p. Flat logits over a 5,000-token vocabulary
    put the top-p set beyond the first candidate window, so the widening path runs too."""
    from edge.decode.sampling import Sampler

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(5000).astype(np.float32) * 0.5
    logits[:8] += np.array([6, 5.5, 5, 4, 3, 3, 2, 1])  # a few likely tokens on top of a long flat tail
    cfg = SamplingConfig(temperature=0.8, seed=1, **kw)
    p = np.exp((logits - logits.max()) / 0.8)
    order = np.argsort(-p, kind="stable")
    allowed = order[: cfg.top_k] if cfg.top_k else order
    q = np.zeros_like(p)
    q[allowed] = p[allowed]
    q /= q.sum()
    if cfg.top_p < 1:
        cum = np.cumsum(q[order])
        keep = order[: int(np.searchsorted(cum, cfg.top_p)) + 1]
        q = np.where(np.isin(np.arange(q.size), keep), q, 0)
        q /= q.sum()
    s, n = Sampler(cfg), 10000  # ~5 s a case on CI's 2 cores
    counts = np.bincount([s(logits) for _ in range(n)], minlength=q.size) / n
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(q))  # nothing outside the filtered set
    assert np.abs(counts - q).max() < 0.015  # and the frequencies follow it (binomial sd here <= 0.005; seeded)
    assert np.abs(counts[q > 0].sum() - 1) < 1e-9


def test_fused_graph_without_logit_positions_still_runs(fused_generator, tmp_path):
    """Bundles written before the fused graph took logit_positions return logits at every position;
    the runtime picks the rows itself, so every caller sees the same shapes and values."""
    import dataclasses

    import onnx

    from edge.backends.onnxruntime import OrtDecoder

    d = fused_generator.decoder
    src = fused_generator.bundle.path(fused_generator.bundle.manifest.engine("int8-dynamic").file)
    m = onnx.load(str(src))
    g = m.graph
    gather = next(n for n in g.node if n.op_type == "GatherND")
    for n in g.node:  # the LM head reads the normed hidden states directly, as the older graph did
        n.input[:] = [gather.input[0] if x == gather.output[0] else x for x in n.input]
    drop = {gather.name, next(n.name for n in g.node if gather.input[1] in n.output)}
    keep = [n for n in g.node if n.name not in drop]
    del g.node[:]
    g.node.extend(keep)
    keep_in = [i for i in g.input if i.name != d.io.logit_positions]
    del g.input[:]
    g.input.extend(keep_in)
    onnx.save(m, str(tmp_path / "old.onnx"))
    old = OrtDecoder(tmp_path / "old.onnx", d.dims, dataclasses.replace(d.io, logit_positions=""), threads=1)
    ids = fused_generator.tokenizer.encode_chat(CHATS[2])
    for last_only in (True, False):
        want = d.forward(np.array([ids]), d.new_cache(capacity=len(ids)), last_only=last_only)
        got = old.forward(np.array([ids]), old.new_cache(capacity=len(ids)), last_only=last_only)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
    from edge.decode.cache import SharedBatchCache

    rows = [ids[:7], ids[:12]]
    a, b = SharedBatchCache(d, 2, capacity=32), SharedBatchCache(old, 2, capacity=32)
    np.testing.assert_allclose(b.prefill_rows(rows), a.prefill_rows(rows), atol=1e-5)
    np.testing.assert_allclose(b.step([5, 6]), a.step([5, 6]), atol=1e-5)


def test_streaming_reassembles_to_full_text(tiny_generator):
    ids = tiny_generator.tokenizer.encode_chat(CHATS[2])
    cfg = SamplingConfig(max_new_tokens=40, temperature=1.0, seed=1)
    events = list(tiny_generator.stream(ids, cfg))
    last = events[-1]
    assert last.finish_reason in ("stop", "length")
    text = "".join(e.text for e in events)
    assert text == tiny_generator.tokenizer.decode(last.token_ids)
    assert all("\ufffd" not in e.text for e in events[:-1]) or "\ufffd" in text


def test_incremental_decoder_never_splits_a_character(tiny_generator):
    tok = tiny_generator.tokenizer
    text = "Naïve café 🙂 日本語 crème brûlée"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    s = tok.streamer()
    pieces = [s.push(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_strings(tiny_generator):
    ids = tiny_generator.tokenizer.encode_chat(CHATS[0])
    full, _ = tiny_generator.complete(ids, SamplingConfig(max_new_tokens=40, temperature=1.0, seed=3))
    assert len(full) > 6
    stop = full[3:6]
    text, last = tiny_generator.complete(ids, SamplingConfig(max_new_tokens=40, temperature=1.0, seed=3, stop=(stop,)))
    assert text == full[: full.find(stop)]
    assert last.finish_reason == "stop"


def test_max_new_tokens_gives_length(tiny_generator):
    ids = tiny_generator.tokenizer.encode_chat(CHATS[0])
    text, last = tiny_generator.complete(ids, SamplingConfig(max_new_tokens=3, temperature=1.0, seed=5))
    assert last.stats["completion_tokens"] <= 3


def test_context_overflow_drops_oldest_turns_keeps_system(tiny_generator):
    chat = Chat(tiny_generator, system="Be brief.")
    for i in range(30):
        chat.messages += [{"role": "user", "content": f"Question number {i}: what is the capital of Japan?"},
                          {"role": "assistant", "content": "The capital of Japan is Tokyo. " * 2}]
    events = list(chat.ask("And one more?", SamplingConfig(max_new_tokens=8)))
    assert events[-1].finish_reason
    assert chat.last_dropped > 0
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat.messages[-2]["content"] == "And one more?"
    assert len(tiny_generator.tokenizer.encode_chat(chat.messages[:-1])) <= tiny_generator.max_context


def test_single_message_too_long_is_a_clear_error(tiny_generator):
    chat = Chat(tiny_generator)
    with pytest.raises(ContextOverflowError, match="shorten it"):
        list(chat.ask("Tokyo " * 400, SamplingConfig(max_new_tokens=8)))
    assert chat.messages == []  # the refused message is not kept
    with pytest.raises(ContextOverflowError):
        list(tiny_generator.tokens(list(range(3, 300)), SamplingConfig()))


def test_generation_stops_at_end_of_context(tiny_generator):
    ids = tiny_generator.tokenizer.encode("Tokyo " * 100)[: tiny_generator.max_context - 5]
    toks = list(tiny_generator.tokens(ids, SamplingConfig(max_new_tokens=50, temperature=1.0, seed=0)))
    assert len(ids) + len(toks) < tiny_generator.max_context


def test_bad_sampling_values():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"max_new_tokens": 0}, {"stop": ("",)}):
        with pytest.raises(EdgeChatError):
            SamplingConfig(**kw)


def test_corrupt_onnx_is_a_clear_error(tiny_bundle, tmp_path):
    dst = tmp_path / "c.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    p = dst / "engines" / "fp32" / "model.onnx"
    size = p.stat().st_size
    p.write_bytes(b"\x00garbage" * (size // 8) + b"\x00" * (size % 8))
    b = Bundle.open(dst, verify="size")  # same size: only a full verify or the loader sees it
    with pytest.raises(BundleError, match="ONNX Runtime cannot load engines/fp32/model.onnx"):
        Generator.from_bundle(b, engine="fp32")


def test_manifest_dims_checked_against_graph(tiny_bundle, tmp_path):
    from edge.errors import DimensionError

    dst = tmp_path / "d.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["model"]["num_layers"] = 3
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DimensionError, match="missing input 'past_key_values.2.key'"):
        Generator.from_bundle(Bundle.open(dst), engine="fp32")


def test_threads_default_to_physical_cores_not_smt_threads(tmp_path):
    """4 logical CPUs on 2 cores (SMT): the decoder's default intra-op threads are 2."""
    from edge.device.machine import physical_cores

    for cpu, core in enumerate([0, 1, 0, 1]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text("0\n")
    assert physical_cores(str(tmp_path)) == 2
    assert physical_cores(str(tmp_path / "none")) >= 1  # no topology: falls back to what the OS reports


def test_session_settings_reach_onnx_runtime_and_keep_the_logits(tiny_bundle, tiny_generator):
    """scripts/sweep_ort.py times ONNX Runtime settings through OrtDecoder: they must reach the session, and a
    setting that only changes threads or memory must not change what the model computes."""
    from edge.backends.onnxruntime import OrtDecoder

    d = tiny_generator.decoder
    e = tiny_bundle.manifest.engine(d.engine.name) if getattr(d, "engine", None) else None
    path = tiny_bundle.path(e.file) if e else None
    if path is None:
        pytest.skip("the tiny generator's decoder is not an ONNX Runtime engine of the bundle")
    with pytest.raises(BundleError, match="refuses the session settings .*affinit"):  # not "the file is damaged"
        OrtDecoder(path, d.dims, d.io, threads=2, session_config={"session.intra_op_thread_affinities": ""})
    o = OrtDecoder(path, d.dims, d.io, threads=1, arena=False, session_config={"session.intra_op.allow_spinning": "0"})
    so = o.session.get_session_options()
    assert not so.enable_cpu_mem_arena and so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    ids = tiny_generator.tokenizer.encode_chat(CHATS[0])
    want = d.forward(np.array([ids]), d.new_cache(capacity=len(ids)), last_only=False)
    got = o.forward(np.array([ids]), o.new_cache(capacity=len(ids)), last_only=False)
    np.testing.assert_allclose(got, want, atol=1e-5)


# ----------------------------------------------------------------------------- engine pickers and the manifest


PROVIDER_SETS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "ort-trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


@pytest.mark.parametrize("eps", PROVIDER_SETS)
@pytest.mark.parametrize("keep", [None, ("int8-qdq", "int4-weight"), ("int8-dynamic", "fp32")])  # noqa: precision
def test_forced_providers_pick_the_engine_the_chain_would(tiny_bundle, eps, keep):
    """`--providers` (load_decoder's forced ONNX Runtime providers) and the fallback chain read one table: the
    same providers get the same engine (the TensorRT EP runs standard-op graphs only: not a fused one)."""
    from edge.backends.choose import decide
    from edge.bundle import Bundle
    from edge.backends.choose import load_decoder
    from edge.device.machine import Machine

    real = Bundle.open(tiny_bundle.root)
    m = real.manifest
    if keep:
        m = dataclasses.replace(m, engines=[e for e in m.engines if e.fingerprint.precision in keep])
    bundle = type("B", (), {"manifest": m, "path": staticmethod(real.path)})()
    here = Machine(arch="x86_64", python="3.11", onnxruntime="1.32.0", ort_providers=PROVIDER_SETS[eps],
                   gpu_sm="8.9" if eps != "cpu" else None, gpu_name="L4" if eps != "cpu" else None,
                   tensorrt="10.8.0" if eps == "ort-trt" else None)
    dec, _ = load_decoder(bundle, threads=1, providers=PROVIDER_SETS[eps])  # this CPU build runs it on CPU
    assert dec.engine.name == decide(m, here).engine


def test_an_io_key_this_runtime_does_not_know_is_refused(tiny_bundle, tmp_path):
    """A manifest's `io` is the graph's contract: a key the runtime does not know (a newer exporter's input, a
    typo) must not be dropped silently; the schema version is what lets a newer bundle through."""
    import json

    from edge.bundle import READS_SCHEMA_VERSIONS, Bundle
    from edge.errors import ManifestError
    from edge.io_contract import DecoderIO

    with pytest.raises(ManifestError, match="kv_scale"):
        DecoderIO.from_dict({**DecoderIO().to_dict(), "kv_scale": "k_scale.{i}"})
    # this change added `prefill_chunk` to every bundle's io: a reader from before it (DecoderIO(**io), reads
    # schema 1-4) must refuse such a bundle by its version, as the schema's own rule says (edge/bundle.py)
    m = json.loads((tiny_bundle.root / "manifest.json").read_text())
    assert "prefill_chunk" in m["io"]
    assert m["schema_version"] not in (1, 2, 3, 4) and m["schema_version"] in READS_SCHEMA_VERSIONS
    dst = tmp_path / "b.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    m["schema_version"] = 4  # an older bundle: no prefill_chunk in its io
    m["io"].pop("prefill_chunk")
    for e in m["engines"]:
        e.get("io", {}).pop("prefill_chunk", None)
    (dst / "manifest.json").write_text(json.dumps(m))
    gen = Generator.from_bundle(Bundle.open(dst), engine="fp32", threads=1)
    assert gen.decoder.prefill_chunk == 512
