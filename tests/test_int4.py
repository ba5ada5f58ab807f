"""INT4 mixed precision: the measured sensitivity finds the weight that 4 bits hurt, and the budget holds."""

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from conftest import make_tiny_model, run_matmulnbits
from edge.errors import RecipeError
from export.int4 import block_quant, dequantize
from export.sensitivity import allocate

SENSITIVE = "/model/layers.1/mlp/down_proj/MatMul"  # the fused graph's name for the weight made sensitive below


def _outlier_model(dst: Path) -> Path:
    """A tiny model whose layer-1 down_proj has one large weight in every block of 32 inputs: 4-bit blocks then
    spend their 16 levels on the outlier and round the other 31 weights coarsely (llama.cpp's reason for
    keeping some ffn_down at more bits)."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(dst, seed=3)
    sd = load_file(str(dst / "model.safetensors"))
    # a random-init model's MLPs barely touch the residual stream and its logits are nearly flat: make this
    # down_proj carry the stream (x100) and the logits sharp (the tied table x10), so its error shows in the KL
    w = sd["model.layers.1.mlp.down_proj.weight"] * 100  # [hidden, intermediate]: blocks run along intermediate
    w[:, ::32] = 12 * w.std()
    sd["model.layers.1.mlp.down_proj.weight"] = w
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 10
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def mixed_bundle(tmp_path_factory):
    from export.recipe import BuildOptions, build

    src = _outlier_model(tmp_path_factory.mktemp("outlier") / "tiny-outlier")
    out = tmp_path_factory.mktemp("mixed") / "mixed.bundle"
    # round to nearest: the outlier is built to defeat min-max blocks (GPTQ spreads its blocks' error instead)
    return build(BuildOptions(output=out, model=str(src), precisions=("int4-weight",), max_context=256, skip_eval=True,
                              calibration_samples=4, int4_extra_ratio=0.1, int4_rounding="minmax"), log=lambda s: None)


def test_sensitivity_ranks_the_outlier_weight_first_and_keeps_it_at_8_bits(mixed_bundle):
    m = next(s for s in mixed_bundle.manifest.stages if s.name == "quantize-int4-weight").metrics
    ranking = list(m["int4_sensitivity"])
    assert ranking[0] == SENSITIVE, m["int4_sensitivity"]
    assert m["int4_sensitivity"][SENSITIVE] > 1.2 * m["int4_sensitivity"][ranking[1]]
    assert SENSITIVE in m["int4_8bit_matmuls"], {k: v for k, v in m.items() if k != "int4_sensitivity"}
    g = onnx.load(str(mixed_bundle.path(mixed_bundle.manifest.engine("int4-weight").file)), load_external_data=False)
    attrs = {n.name: {a.name: a.i for a in n.attribute} for n in g.graph.node if n.op_type == "MatMulNBits"}
    bits = {k: a["bits"] for k, a in attrs.items()}
    assert bits[SENSITIVE + "_Q8"] == 8
    # a promoted MatMul's 8-bit block is the largest of 128/64/32 its input width divides (down_proj: 128 here)
    assert attrs[SENSITIVE + "_Q8"]["block_size"] == 128 == attrs[SENSITIVE + "_Q8"]["K"]
    assert sum(b == 4 for b in bits.values()) >= 4  # most stay at 4 bits (8 weight MatMuls besides the head)


def test_the_byte_budget_is_honoured(mixed_bundle):
    m = next(s for s in mixed_bundle.manifest.stages if s.name == "quantize-int4-weight").metrics
    size = mixed_bundle.manifest.engine_bytes("int4-weight")
    assert size <= m["int4_budget_bytes"]
    assert m["int4_planned_bytes"] <= m["int4_budget_bytes"] < m["int4_all4_bytes"] * 1.11
    assert m["int4_8bit_matmuls"], "the budget should leave room for at least one 8-bit MatMul"


def test_a_budget_below_the_all_4_bit_engine_is_refused(mixed_bundle, tmp_path):
    from export.quantize import QuantizeOptions, run

    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    with pytest.raises(RecipeError, match="less than the all-4-bit engine"):
        run(work / "export" / "fused", work / "load", tmp_path, QuantizeOptions(mode="int4-weight", int4_budget_mb=0.01))


def test_promoted_block_pads_nothing():
    from export.quantize import QuantizeOptions, promoted_block

    auto = QuantizeOptions(mode="int4-weight")
    assert [promoted_block(k, auto) for k in (576, 1536, 4096, 14336, 80, 960)] == [64, 128, 128, 128, 32, 64]
    assert promoted_block(1536, QuantizeOptions(mode="int4-weight", int4_promoted_block=32)) == 32


def test_the_8_bit_head_block_divides_the_hidden_width():
    """The tied embedding gathers whole rows from the head's table: its blocks never pad a row."""
    from export.quantize import QuantizeOptions, lm_head_block

    auto = QuantizeOptions(mode="int4-weight")
    assert [lm_head_block(k, auto) for k in (576, 896, 4096, 96, 80)] == [64, 64, 64, 32, 16]


def test_allocate_takes_most_kl_per_byte_within_the_budget():
    sens, cost = {"a": 1.0, "b": 0.9, "c": 0.1}, {"a": 100, "b": 10, "c": 10}
    assert allocate(sens, cost, 25) == ["b", "c"]   # a is worth less per byte and does not fit anyway
    assert sorted(allocate(sens, cost, 120)) == ["a", "b", "c"] and allocate(sens, cost, 0) == []


def test_allocate_stops_once_the_rest_is_close_enough():
    """int8-qdq's and fp8-qdq's float budget (`enough`: qdq_float_kl): no bytes spent past the KL the rest's
    measurements sum to; a model already that close keeps nothing float."""
    sens, cost = {"a": 0.5, "b": 0.3, "c": 0.01}, {"a": 10, "b": 10, "c": 10}
    assert allocate(sens, cost, 100) == ["a", "b", "c"]
    assert allocate(sens, cost, 100, enough=0.05) == ["a", "b"]  # 0.01 left
    assert allocate(sens, cost, 100, enough=0.4) == ["a"]  # 0.31 left
    assert allocate(sens, cost, 100, enough=0.81) == []
    assert allocate(sens, cost, 10, enough=0.05) == ["a"]  # the byte budget still bounds it
    assert allocate({"a": 0.1, "b": 0.0}, {"a": 1, "b": 1}, 10) == ["a", "b"]  # enough 0: the int4 budgets' rule as it was


@pytest.mark.parametrize("k,n,block", [(64, 8, 32), (96, 5, 64), (40, 3, 32)])
def test_kquant_levels_pack_the_way_matmulnbits_reads_them(k, n, block):
    rng = np.random.default_rng(k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = block_quant(w, 4, block, "kquant")
    a = rng.standard_normal((2, k)).astype(np.float32)
    y = run_matmulnbits(a, q, s, z, k, block)
    np.testing.assert_allclose(y, a @ dequantize(q, s, z, k), rtol=1e-4, atol=1e-4)
    assert np.linalg.norm(dequantize(q, s, z, k) - w) < 0.15 * np.linalg.norm(w)


@pytest.fixture(scope="module")
def untied_int4(tmp_path_factory):
    """A tiny model with an untied LM head (as Llama 3's), int4-weight in 4-bit blocks of 64."""
    from export.recipe import BuildOptions, build

    src = make_tiny_model(tmp_path_factory.mktemp("untied") / "tiny-untied", tie=False, hidden=256, intermediate=512, seed=5)
    out = tmp_path_factory.mktemp("layout") / "untied.bundle"
    return build(BuildOptions(output=out, model=str(src), precisions=("int4-weight",), max_context=256, skip_eval=True,
                              calibration_samples=4, int4_block_size=64), log=lambda s: None)


def test_int4_layouts_store_what_the_planner_plans(untied_int4, tmp_path):
    """The quantizer writes the layout asked for (body blocks, head bits) and the planner's bytes for each
    layout match the engines it writes: the differences between layouts exactly (what the planner uses to
    pick one that fits), the totals within the graph's own records (rotary tables, norms)."""
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from export.load import model_dims
    from export.planner import Int4Layout, weight_bytes
    from export.quantize import QuantizeOptions, run

    m = next(s for s in untied_int4.manifest.stages if s.name == "quantize-int4-weight").metrics
    assert m["int4_block_size"] == 64 and m["lm_head_bits"] == 8
    assert m["int4_rounding"] == "gptq" and m["gptq_tokens"] > 0 and m["gptq_passes"] == 1  # the default, recorded
    g = onnx.load(str(untied_int4.path(untied_int4.manifest.engine("int4-weight").file)), load_external_data=False)
    attrs = {n.name: {a.name: a.i for a in n.attribute} for n in g.graph.node if n.op_type == "MatMulNBits"}
    head = [k for k in attrs if "lm_head" in k]
    assert len(head) == 1 and attrs[head[0]]["bits"] == 8 and attrs[head[0]]["block_size"] == 64
    assert {(a["bits"], a["block_size"]) for k, a in attrs.items() if k not in head} == {(4, 64)}

    work = untied_int4.root.with_name(untied_int4.root.name + ".work")
    dims = model_dims(work / "load")
    assert not dims.tie_word_embeddings
    sizes, planned = {}, {}
    for lay in (Int4Layout(32, 8), Int4Layout(64, 8), Int4Layout(128, 8), Int4Layout(128, 4)):
        dst = tmp_path / f"b{lay.block}h{lay.head_bits}"
        dst.mkdir()
        run(work / "export" / "fused", work / "load", dst, QuantizeOptions(
            mode="int4-weight", int4_block_size=lay.block, int4_lm_head_bits=lay.head_bits, samples=4))
        planned[lay] = weight_bytes(dims, "int4-weight", lay)
        # the weights themselves: every initializer but the rotary tables (the graph's node records are not weights)
        q = onnx.load(str(dst / "model.onnx"))
        sizes[lay] = sum(onnx.numpy_helper.to_array(i).nbytes for i in q.graph.initializer
                         if i.name not in ("cos_cache", "sin_cache"))
        assert planned[lay] <= sizes[lay] <= planned[lay] * 1.03, (lay, sizes[lay], planned[lay])
    base = Int4Layout(32, 8)
    for lay in sizes:
        if lay != base:
            assert sizes[base] - sizes[lay] == pytest.approx(planned[base] - planned[lay], rel=0.03), lay
    assert sizes[Int4Layout(128, 4)] < sizes[Int4Layout(128, 8)] < sizes[Int4Layout(64, 8)] < sizes[base]
    gen = Generator.from_bundle(untied_int4, engine="int4-weight")  # blocks of 64 load and decode
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert len(gen.tokens(ids, SamplingConfig(max_new_tokens=4, ignore_eos=True))) == 4


def _correlated_inputs(rng, rows: int, k: int) -> np.ndarray:
    """Inputs like a transformer's: mostly in a low-dimensional subspace (the channels move together), a few
    channels much larger than the rest. Independent channels would leave GPTQ nothing to exploit."""
    mix = np.random.default_rng(k).standard_normal((k // 4, k))  # the same subspace for every draw
    x = rng.standard_normal((rows, k // 4)) @ mix + 0.1 * rng.standard_normal((rows, k))
    x[:, np.random.default_rng(k + 1).choice(k, 4, replace=False)] *= 8
    return x.astype(np.float32)


@pytest.mark.parametrize("k,n,block", [(128, 48, 32), (96, 40, 64), (80, 16, 32)])
def test_gptq_rounds_so_the_output_moves_less_than_round_to_nearest(k, n, block):
    """GPTQ minimises the MatMul's output error on its calibration inputs; on other inputs from the same
    distribution it must beat round-to-nearest too (else it only fitted the calibration rows). Its levels
    run in MatMulNBits exactly as dequantized (K not a multiple of the block included: padded rows)."""
    from export.gptq import gptq_block_quant

    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x_cal, x_new = _correlated_inputs(rng, 2048, k), _correlated_inputs(rng, 512, k)
    h = x_cal.astype(np.float64).T @ x_cal / len(x_cal)
    q, s, z = gptq_block_quant(w, h, 4, block)
    assert q.shape == (n, -(-k // block), block) and q.max() <= 15 and s.dtype == np.float32
    rtn = dequantize(*block_quant(w, 4, block, "minmax"), k=k)
    gq = dequantize(q, s, z, k)
    for x in (x_cal, x_new):
        err_rtn, err_gptq = np.linalg.norm(x @ (rtn - w)), np.linalg.norm(x @ (gq - w))
        assert err_gptq < 0.5 * err_rtn, (err_gptq, err_rtn)  # measured 0.14-0.19
    a = x_new[:3]
    y = run_matmulnbits(a, q, s, z, k, block)
    np.testing.assert_allclose(y, a @ gq, rtol=1e-4, atol=1e-3)


def test_gptq_statistics_are_the_same_in_one_pass_or_many(mixed_bundle, tmp_path):
    """Hessians collected in memory-bounded passes equal the one-pass matrices, and each is X^T X of what the
    MatMul really reads: symmetric, positive on the diagonal, and for the first q/k/v the RMS-normed embedding."""
    from export.hessians import Hessians
    from export.load import model_dims
    from export.quantize import QuantizeOptions, sensitivity_feeds

    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    feeds = sensitivity_feeds(work / "load", QuantizeOptions(mode="int4-weight", sensitivity_samples=4,
                                                              sensitivity_tokens=32), model_dims(work / "load"))
    one = Hessians(work / "export" / "model.onnx", tmp_path, feeds)
    many = Hessians(work / "export" / "model.onnx", tmp_path, feeds, max_bytes=1)  # one input per pass
    try:
        names = list(one.input_of)
        assert len(names) > 8
        got_one = {n: one(n).copy() for n in names}
        got_many = {n: many(n).copy() for n in names}
        assert one.passes == 1 and many.passes == len(one.order)
        for n in names:
            np.testing.assert_allclose(got_many[n], got_one[n], rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(got_one[n], got_one[n].T, rtol=1e-6, atol=1e-9)
            assert (np.diag(got_one[n]) > 0).all(), n
        q = next(n for n in names if "layers.0/self_attn/q_proj" in n)
        k = next(n for n in names if "layers.0/self_attn/k_proj" in n)
        np.testing.assert_array_equal(got_one[q], got_one[k])  # the same input, the same statistics
        # RMSNorm output has mean square = the norm weight's square (ones at init): the trace is ~hidden
        assert np.trace(got_one[q]) == pytest.approx(got_one[q].shape[0], rel=0.05)
    finally:
        one.close()
        many.close()
    assert not (tmp_path / "hessian.onnx").exists()



def test_gptq_statistics_block_by_block_equal_the_graphs(mixed_bundle, tmp_path):
    """LayerHessians (the Hugging Face model one decoder block at a time, one forward pass in all: what large
    models use) gives the matrices the plain graph's pass gives, for every weight MatMul the quantizer asks
    about in graph order; asked out of order it starts again (a second pass) and still agrees."""
    from export.hessians import Hessians, LayerHessians, statistics_bytes
    from export.load import model_dims
    from export.quantize import QuantizeOptions, sensitivity_feeds

    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    plain = work / "export" / "model.onnx"
    feeds = sensitivity_feeds(work / "load", QuantizeOptions(mode="int4-weight", sensitivity_samples=4,
                                                              sensitivity_tokens=32), model_dims(work / "load"))
    import torch

    threads = torch.get_num_threads()
    with Hessians(plain, tmp_path, feeds) as ref, LayerHessians(work / "load", plain, feeds, threads=1) as blocks:
        names = list(ref.input_of)
        assert names == list(blocks.input_of) and any("lm_head" in n for n in names)
        assert statistics_bytes(plain) == sum(k * k * 8 for k in ref.width.values())
        for n in names:
            np.testing.assert_allclose(blocks(n), ref(n), rtol=2e-4, atol=1e-6, err_msg=n)
        assert blocks.passes == 1 and blocks.rows == ref.rows
        assert blocks.model is None  # past the LM head the fp32 model is let go
        np.testing.assert_allclose(blocks(names[0]), ref(names[0]), rtol=2e-4, atol=1e-6)
        assert blocks.passes == 2 and blocks.model is not None  # loaded again for the second pass
    assert torch.get_num_threads() == threads  # its own thread count, put back


def test_gptq_statistics_choose_block_by_block_past_one_pass(mixed_bundle, tmp_path, monkeypatch):
    """The quantize stage collects statistics block by block when the graph's pass would not hold them all at
    once, asked by the fused graph's names as by the plain one's, equal to the one-pass path's; a model whose
    blocks cannot run alone falls back to passes of the graph."""
    import export.hessians
    import transformers.models.llama.modeling_llama as llama
    from export.load import model_dims
    from export.onnx_weights import GraphWeights, untie_lm_head, weight_matmuls
    from export.quantize import QuantizeOptions, _gptq_statistics

    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    fused = work / "export" / "fused"
    gw = GraphWeights(fused / "model.onnx")
    untie_lm_head(gw)
    names = [n.name for n in weight_matmuls(gw.model)]
    assert any("qkv" in n.lower() or "gate_up" in n.lower() for n in names), names  # names only the fused graph has
    opts = QuantizeOptions(mode="int4-weight", gptq_samples=4, gptq_tokens=32)
    graph, by_graph = _gptq_statistics(fused, work / "load", tmp_path, opts, model_dims(work / "load"), shared=False)
    assert type(graph).__name__ == "Hessians"
    monkeypatch.setattr(export.hessians, "ONE_PASS_BYTES", 1)
    blocks, by_block = _gptq_statistics(fused, work / "load", tmp_path, opts, model_dims(work / "load"), shared=False)
    try:
        assert type(blocks).__name__ == "LayerHessians"
        for n in names:
            np.testing.assert_allclose(by_block(n), by_graph(n), rtol=2e-4, atol=1e-6, err_msg=n)
    finally:
        graph.close()
        blocks.close()

    def cannot_run_alone(self, *a, **k):
        raise TypeError("LlamaDecoderLayer.forward() missing 1 required positional argument: 'cache'")

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", cannot_run_alone)
    hess, _ = _gptq_statistics(fused, work / "load", tmp_path, opts, model_dims(work / "load"), shared=False)
    assert type(hess).__name__ == "Hessians"  # passes of the whole graph: slower, never wrong
    hess.close()

def test_gptq_is_the_default_and_needs_asymmetric_blocks(tmp_path):
    from export.quantize import QuantizeOptions
    from export.recipe import BuildOptions

    with pytest.raises(RecipeError, match="int4_rounding must be one of gptq, minmax, kquant"):
        BuildOptions(output=tmp_path / "x.bundle", int4_rounding="awq")
    for bad in (0, -3, 2.5, "many"):
        with pytest.raises(RecipeError, match="gptq_samples must be a whole number"):
            BuildOptions(output=tmp_path / "x.bundle", gptq_samples=bad)

    assert QuantizeOptions(mode="int4-weight").int4_rounding == "gptq"
    with pytest.raises(RecipeError, match="int4_rounding = 'minmax' for symmetric"):
        QuantizeOptions(mode="int4-weight", int4_symmetric=True)
    with pytest.raises(RecipeError, match="gptq_samples"):
        QuantizeOptions(mode="int4-weight", gptq_samples=0)
    assert QuantizeOptions(mode="int8-dynamic").int8_rounding == "gptq" and BuildOptions(output=tmp_path / "x.bundle").int8_rounding == "gptq"
    for bad in ("awq", None, 8):
        with pytest.raises(RecipeError, match="int8_rounding must be 'gptq' or 'minmax'"):
            BuildOptions(output=tmp_path / "x.bundle", int8_rounding=bad)
        with pytest.raises(RecipeError, match="int8_rounding must be 'gptq' or 'minmax'"):
            QuantizeOptions(mode="int8-dynamic", int8_rounding=bad)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(RecipeError, match="gptq_chat_share must be in"):
            QuantizeOptions(mode="int4-weight", gptq_chat_share=bad)
    for bad in (0, 48, -64, "64"):
        with pytest.raises(RecipeError, match="int4_lm_head_block must be one of"):
            QuantizeOptions(mode="int4-weight", int4_lm_head_block=bad)


def test_the_sensitivity_is_not_measured_on_the_texts_gptq_fitted(mixed_bundle):
    from export.load import model_dims
    from export.quantize import QuantizeOptions, sensitivity_feeds

    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    dims = model_dims(work / "load")
    gptq = sensitivity_feeds(work / "load", QuantizeOptions(mode="int4-weight", sensitivity_samples=8, sensitivity_tokens=32), dims)
    sens = sensitivity_feeds(work / "load", QuantizeOptions(mode="int4-weight", sensitivity_samples=4, sensitivity_tokens=32),
                             dims, skip=4)
    seen = {tuple(f["input_ids"][0]) for f in gptq}
    assert len(sens) == 4 and not seen & {tuple(f["input_ids"][0]) for f in sens}
    # a prose-heavy GPTQ set (2 chats, 6 prose): the sensitivity skips the larger count of each kind
    opts = QuantizeOptions(mode="int4-weight", sensitivity_samples=8, sensitivity_tokens=32, gptq_chat_share=0.25)
    gptq = sensitivity_feeds(work / "load", opts, dims, chats=2)
    sens = sensitivity_feeds(work / "load", QuantizeOptions(mode="int4-weight", sensitivity_samples=4, sensitivity_tokens=32),
                             dims, skip=6)
    assert len(gptq) == 8 and len(sens) == 4 and not {tuple(f["input_ids"][0]) for f in gptq} & {tuple(f["input_ids"][0]) for f in sens}
    assert QuantizeOptions(mode="int8-dynamic", int4_symmetric=True).int4_symmetric  # the gptq check is int4's only


SENSITIVE_V = "/model/layers.1/self_attn/v_proj/MatMul"  # the plain graph's name: a part of the fused qkv_proj


def _outlier_v_model(dst: Path) -> Path:
    """As `_outlier_model`, but the outliers are in layer 1's v_proj: one projection of the fused graph's
    packed q/k/v MatMul, the kind llama.cpp's k-quants give more bits (attn_v)."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(dst, seed=3)
    sd = load_file(str(dst / "model.safetensors"))
    w = sd["model.layers.1.self_attn.v_proj.weight"] * 100  # [kv*head_dim, hidden]: blocks run along hidden
    w[:, ::32] = 12 * w.std()
    sd["model.layers.1.self_attn.v_proj.weight"] = w
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 10
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_budget_promotes_one_projection_of_a_packed_matmul(tmp_path):
    """The fused graph packs q, k and v into one MatMul (and gate, up into another); the int4 budget measures and
    promotes each projection alone, so a sensitive v costs v's bytes, not q/k/v's (5-6x on SmolLM2's and Llama-3-8B's
    shapes).
    The packed MatMul is then split by columns into a 4-bit and an 8-bit MatMulNBits joined by a Concat, and the
    engine decodes."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator
    from edge.decode.sampling import SamplingConfig
    from export.recipe import BuildOptions, build

    src = _outlier_v_model(tmp_path / "tiny-outlier-v")
    b = build(BuildOptions(output=tmp_path / "v.bundle", model=str(src), precisions=("int4-weight",), max_context=256,
                           skip_eval=True, calibration_samples=4, int4_extra_ratio=0.03, int4_rounding="minmax"),
              log=lambda s: None)
    m = next(s for s in b.manifest.stages if s.name == "quantize-int4-weight").metrics
    assert list(m["int4_sensitivity"])[0] == SENSITIVE_V, m["int4_sensitivity"]
    assert "/model/layers.1/attn/qkv_proj/MatMul" not in m["int4_sensitivity"]  # measured per projection
    assert SENSITIVE_V in m["int4_8bit_matmuls"]
    assert m["int4_packed_parts"][SENSITIVE_V] == ["/model/layers.1/attn/qkv_proj/MatMul", 96, 128]  # q 64, k 32, v 32
    g = onnx.load(str(b.path(b.manifest.engine("int4-weight").file)), load_external_data=False)
    nbits = {n.name: {a.name: a.i for a in n.attribute} for n in g.graph.node if n.op_type == "MatMulNBits"}
    qkv = "/model/layers.1/attn/qkv_proj/MatMul"
    if "/model/layers.1/self_attn/k_proj/MatMul" in m["int4_8bit_matmuls"]:
        four, eight = qkv + "/cols0-64_Q4", qkv + "/cols64-128_Q8"
    else:
        four, eight = qkv + "/cols0-96_Q4", qkv + "/cols96-128_Q8"
    assert nbits[four]["bits"] == 4 and nbits[eight]["bits"] == 8, sorted(nbits)
    assert nbits[four]["N"] + nbits[eight]["N"] == 128 and nbits[four]["K"] == nbits[eight]["K"] == 64
    concat = next(n for n in g.graph.node if n.name == qkv + "/Concat")
    assert concat.output[0] == "/model/layers.1/attn/qkv_proj/out"
    assert graph_bytes_of(b) <= m["int4_budget_bytes"]
    gen = Generator.from_bundle(Bundle.open(b.root), engine="int4-weight")
    ids = gen.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert len(gen.tokens(ids, SamplingConfig(max_new_tokens=4, ignore_eos=True))) == 4
    from edge.backends.determinism import float_activations

    assert not float_activations(b.manifest, "int4-weight")  # the build's record: INT8 activations (level 4)


def graph_bytes_of(bundle) -> int:
    from export.onnx_weights import graph_bytes

    return graph_bytes(bundle.path(bundle.manifest.engine("int4-weight").file))


def test_split_columns_computes_what_the_packed_matmul_did(tmp_path):
    """A MatMul split into column runs and joined by a Concat gives the same output; GPTQ rounds a column run
    of a weight exactly as those columns of the whole (its output columns are independent), so a split 4-bit
    part holds the levels the unsplit engine would."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.gptq import gptq_block_quant
    from export.nbits import split_columns
    from export.onnx_weights import GraphWeights

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 40])],
                              [numpy_helper.from_array(w, "W")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "a.onnx"))
    gw = GraphWeights(tmp_path / "a.onnx")
    assert split_columns(gw, "mm", [(0, 24), (24, 32), (32, 40)]) == ["mm/cols0-24", "mm/cols24-32", "mm/cols32-40"]
    gw.drop_unused()
    (tmp_path / "b").mkdir()
    gw.save(tmp_path / "b" / "model.onnx")
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    y = ort.InferenceSession(str(tmp_path / "b" / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not tile"):
        split_columns(GraphWeights(tmp_path / "a.onnx"), "mm", [(0, 24), (30, 40)])

    xs = _correlated_inputs(rng, 512, 64)
    h = xs.astype(np.float64).T @ xs / len(xs)
    whole = gptq_block_quant(w, h, 4, 32)
    part = gptq_block_quant(np.ascontiguousarray(w[:, 24:32]), h, 4, 32)
    for a, b in zip(whole, part):
        np.testing.assert_array_equal(a[24:32], b)


def test_int4_activations_choose_the_kernels_accuracy_level(mixed_bundle, tmp_path):
    """--int4-activations fp32 writes int4-weight's MatMulNBits at accuracy level 1 (float activations: less KL,
    docs/quality.md), int8 (the default) at level 4; the recipe refuses anything else, and GPTQ's damping is a
    build option too."""
    from export.quantize import QuantizeOptions, run
    from export.recipe import BuildOptions, _quantize_options

    assert _quantize_options(BuildOptions(output=tmp_path / "x"), "int4-weight").accuracy_level == 4
    q = _quantize_options(BuildOptions(output=tmp_path / "x", int4_activations="fp32", int4_gptq_damp=0.05), "int4-weight")
    assert (q.accuracy_level, q.int4_gptq_damp) == (1, 0.05)
    draft = _quantize_options(BuildOptions(output=tmp_path / "x", int4_activations="fp32"), "int4-weight", nearest=True)
    assert draft.accuracy_level == 4  # a draft keeps the fast kernel
    with pytest.raises(RecipeError, match="int4_activations must be one of int8, fp32"):
        BuildOptions(output=tmp_path / "x", int4_activations="bf16")
    for bad in (0, float("nan"), "lots", True):  # a recipe's wrong type too (TOML's true is not 1.0): a RecipeError
        with pytest.raises(RecipeError, match="int4_gptq_damp must be in"):
            BuildOptions(output=tmp_path / "x", int4_gptq_damp=bad)
        with pytest.raises(RecipeError, match="int8_gptq_damp must be in"):
            QuantizeOptions(mode="int8-dynamic", int8_gptq_damp=bad)
    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    run(work / "export" / "fused", work / "load", tmp_path, QuantizeOptions(mode="int4-weight", accuracy_level=1,
                                                                          int4_rounding="minmax"))
    g = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    levels = {(a["bits"], a["accuracy_level"]) for a in ({a.name: a.i for a in n.attribute} for n in g.graph.node
                                                           if n.op_type == "MatMulNBits")}
    assert levels == {(4, 1), (8, 1)}  # the 8-bit head too: with INT8 activations there it lost most of the gain


def test_float_activations_are_not_promised_batch_invariant(tmp_path):
    """The batch-invariance promise for int4-weight was measured at INT8 activations; an engine quantized with
    float ones (the quantize stage's options record its accuracy level) runs other kernels and is not promised."""
    from types import SimpleNamespace

    from edge.backends.determinism import batch_invariance, float_activations
    from edge.bundle import StageRecord

    def manifest(level):
        return SimpleNamespace(stages=[StageRecord("quantize-int4-weight", {"accuracy_level": level}, 0.0)])

    assert float_activations(manifest(1), "int4-weight") and not float_activations(manifest(4), "int4-weight")
    assert not float_activations(SimpleNamespace(stages=[]), "int4-weight")  # bundles from before the record
    vnni = {"avx2", "avx512_vnni"}
    assert batch_invariance("int4-weight", "CPUExecutionProvider", vnni).guaranteed
    assert not batch_invariance("int4-weight", "CPUExecutionProvider", vnni, float_acts=True).guaranteed


def test_gptq_rounds_a_split_projection_with_its_packed_matmuls_statistics(tmp_path, monkeypatch):
    """GPTQ finds the statistics of a MatMul split out of a packed one under the packed MatMul's input, and the
    4-bit columns it writes are those the unsplit engine has (output columns round independently)."""
    from export import sensitivity
    from export.quantize import QuantizeOptions, run
    from export.recipe import BuildOptions, build

    src = _outlier_v_model(tmp_path / "m")
    b = build(BuildOptions(output=tmp_path / "v.bundle", model=str(src), precisions=("fp32",), max_context=256,
                           skip_eval=True, calibration_samples=4), log=lambda s: None)
    work = b.root.with_name(b.root.name + ".work")
    opts = dict(mode="int4-weight", samples=4, gptq_samples=4, gptq_tokens=64)
    (tmp_path / "whole").mkdir()
    run(work / "export" / "fused", work / "load", tmp_path / "whole", QuantizeOptions(**opts))
    monkeypatch.setattr(sensitivity, "allocate", lambda sens, cost, budget, enough=0.0: [SENSITIVE_V])
    (tmp_path / "split").mkdir()
    m = run(work / "export" / "fused", work / "load", tmp_path / "split", QuantizeOptions(**opts, int4_extra_ratio=0.5))
    assert m["int4_8bit_matmuls"] == [SENSITIVE_V] and m["gptq_tokens"] > 0
    whole = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "whole" / "model.onnx")).graph.initializer}
    split = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "split" / "model.onnx")).graph.initializer}
    w = "model.layers.1.attn.qkv_proj.weight"
    assert split[w + "/cols96-128_Q8"].shape[0] == 32  # v: 32 output columns at 8 bits
    np.testing.assert_array_equal(split[w + "/cols0-96_Q4"], whole[w + "_Q4"][:96])  # q and k: the same levels
    np.testing.assert_array_equal(split[w + "/cols0-96_scales"], whole[w + "_scales"][:96])


def test_int8_dynamic_rounds_with_its_gptq_damping(mixed_bundle, tmp_path, monkeypatch):
    """int8_gptq_damp reaches every 8-bit GPTQ call of int8-dynamic (0.03 by default: GPTQ's own 0.003 flipped
    SmolLM2's layer-0 down_proj levels on 1e-6 changes of the statistics, docs/models.md)."""
    from export import gptq
    from export.quantize import QuantizeOptions, run

    seen: list[tuple[int, float | None]] = []
    real = gptq.gptq_block_quant
    monkeypatch.setattr(gptq, "gptq_block_quant",
                        lambda w, h, bits, *a, **k: seen.append((bits, k.get("damp"))) or real(w, h, bits, *a, **k))
    work = mixed_bundle.root.with_name(mixed_bundle.root.name + ".work")
    run(work / "export" / "fused", work / "load", tmp_path, QuantizeOptions(mode="int8-dynamic", gptq_samples=4,
                                                                          gptq_tokens=64, int8_gptq_damp=0.05))
    assert seen and {d for _, d in seen} == {0.05}
    assert QuantizeOptions(mode="int8-dynamic").int8_gptq_damp == 0.03
    with pytest.raises(RecipeError, match="int8_gptq_damp must be in"):
        QuantizeOptions(mode="int8-dynamic", int8_gptq_damp=2)
