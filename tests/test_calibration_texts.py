"""GPTQ's calibration domains: real text of each kind, deterministic, split like the prose set, and the mix
("chat", "news") giving exactly the texts GPTQ always had."""

from pathlib import Path

import numpy as np
import pytest

from edge.errors import MissingDependencyError, RecipeError
from export import calibration_texts as ct
from export.quantize import QuantizeOptions, gptq_chats, gptq_feeds, sensitivity_feeds


def test_shares_split_the_texts_chat_first():
    assert ct.shares(("chat", "news"), 32, 0.5) == {"chat": 16, "news": 16}
    assert ct.shares(ct.DOMAINS, 32, 0.2) == {"chat": 6, "news": 7, "literature": 7, "code": 6, "docs": 6}
    assert ct.shares(("news", "code"), 5, 0.5) == {"news": 3, "code": 2}  # no chat: the share does not apply
    assert ct.shares(("chat",), 8, 0.5) == {"chat": 8}
    assert sum(ct.shares(ct.DOMAINS, 97, 0.3).values()) == 97


@pytest.mark.parametrize("domains", [(), ("chat", "chat"), ("chat", "poems")])
def test_bad_domains_name_the_choices(domains):
    with pytest.raises(RecipeError, match="gptq_domains must be distinct names from chat, news, literature, code, docs"):
        QuantizeOptions(mode="int4-weight", gptq_domains=domains)


@pytest.mark.parametrize("domain", ["code", "docs"])
def test_python_domains_are_real_split_and_deterministic(domain):
    train, held = ct.domain_texts(domain, "train"), ct.domain_texts(domain, "eval")
    assert len(train) >= 60 and held and not set(train) & set(held)
    assert train == ct.domain_texts(domain, "train")
    assert all(len(d) >= ct.DOC_CHARS // 4 for d in train)
    if domain == "code":
        assert sum("def " in d for d in train) > len(train) / 2
    else:
        assert sum(w in {"the", "of", "a", "is"} for w in " ".join(train).split()) > 1000  # English prose


def test_news_is_the_prose_sets_training_split():
    from export.prose import prose_texts

    assert ct.domain_texts("news", "train") == prose_texts("train")


def test_austen_is_read_from_the_r_packages_data_without_r(tmp_path, monkeypatch):
    """The R lazy-load database: one [length, zlib stream] record per novel, each an XDR character vector."""
    import struct
    import zlib

    def charsxp(s: str | None) -> bytes:
        if s is None:
            return struct.pack(">ii", 0x9, -1)
        b = s.encode()
        return struct.pack(">ii", 0x40009, len(b)) + b

    def record(lines) -> bytes:
        raw = b"X\n" + struct.pack(">iii", 3, 0x040100, 0x030500) + struct.pack(">ii", 16, len(lines))
        raw += b"".join(charsxp(x) for x in lines)
        z = zlib.compress(raw)
        return struct.pack(">I", len(raw)) + z

    folder = tmp_path / "janeaustenr" / "data"
    folder.mkdir(parents=True)
    (folder / "Rdata.rdb").write_bytes(record(["Chapter 1", "", "It is a truth", "universally acknowledged.", None, "Next"])
                                      + record(["", "Emma Woodhouse, handsome,", "clever."]))
    monkeypatch.setattr(ct, "AUSTEN_DIRS", (str(tmp_path),))
    novels = ct.austen_novels(ct.austen_rdb())
    assert novels == [["Chapter 1", "It is a truth universally acknowledged.", "Next"], ["Emma Woodhouse, handsome, clever."]]
    monkeypatch.setattr(ct, "AUSTEN_DIRS", (str(tmp_path / "none"),))
    with pytest.raises(MissingDependencyError, match="apt-get install r-cran-janeaustenr"):
        ct.austen_rdb()


@pytest.mark.skipif(not any((Path(d) / "janeaustenr").is_dir() for d in ct.AUSTEN_DIRS),
                    reason="Debian's r-cran-janeaustenr is not installed")
def test_installed_austen_is_six_novels_of_prose():
    novels = ct.austen_novels(ct.austen_rdb())
    assert len(novels) == 6 and sum(len(" ".join(n)) for n in novels) > 3_000_000
    train = ct.domain_texts("literature", "train")
    assert len(train) > 500 and not set(train) & set(ct.domain_texts("literature", "eval"))


@pytest.fixture(scope="module")
def load_dir(tiny_bundle) -> Path:
    """A build's load stage (the tokenizer and chat template the quantize stage reads)."""
    return tiny_bundle.root.with_name(tiny_bundle.root.name + ".work") / "load"


def test_chat_and_news_feeds_are_the_texts_gptq_always_had(load_dir):
    """The default mix must not move the statistics' key: the same token ids as the sensitivity-feed path gave."""
    from export.load import model_dims

    tiny_model_dir = load_dir
    dims = model_dims(tiny_model_dir)
    opts = QuantizeOptions(mode="int4-weight", gptq_samples=6, gptq_tokens=64)
    old = sensitivity_feeds(tiny_model_dir, QuantizeOptions(mode=opts.mode, sensitivity_samples=6, sensitivity_tokens=64),
                            dims, chats=gptq_chats(opts))
    new = gptq_feeds(tiny_model_dir, opts, dims)
    assert [f["input_ids"].tolist() for f in new] == [f["input_ids"].tolist() for f in old]
    assert set(new[0]) == set(old[0])


def test_five_domain_feeds_hold_each_domain(load_dir):
    from export.load import chat_tokenizer, model_dims

    tiny_model_dir = load_dir
    dims = model_dims(tiny_model_dir)
    domains = ("chat", "news", "code", "docs")
    feeds = gptq_feeds(tiny_model_dir, QuantizeOptions(mode="int4-weight", gptq_samples=8, gptq_tokens=32,
                                                       gptq_domains=domains), dims)
    assert len(feeds) == 8 and all(f["input_ids"].shape[1] <= 32 for f in feeds)
    tok = chat_tokenizer(tiny_model_dir)
    code = tok.encode(ct.domain_texts("code", "train")[0])[:32]
    assert any(np.array_equal(f["input_ids"][0], code) for f in feeds)
    assert gptq_chats(QuantizeOptions(mode="int4-weight", gptq_samples=8, gptq_domains=domains)) == 4  # half, by default


def test_gptq_domains_flag_and_recipe_key_reach_both_int4_engines(tmp_path):
    """--gptq-domains (recipe key gptq_domains) gives the quantize stage its domains, split evenly; the default
    leaves the stage's options as they were (no rebuild of existing work folders for it)."""
    from export.cli import make_parser
    from export.recipe import BuildOptions, _quantize_options

    def parse(*flags: str) -> BuildOptions:
        return BuildOptions.from_cli(make_parser().parse_args(["build", "-o", str(tmp_path / "x.bundle"), "--precision",
                                                               "int4-weight", "--precision", "int4-qdq", *flags]))

    opts = parse("--gptq-domains", "chat,news,literature")
    for p in ("int4-weight", "int4-qdq", "int8-dynamic"):
        q = _quantize_options(opts, p)
        assert q.gptq_domains == ("chat", "news", "literature") and q.gptq_chat_share == pytest.approx(1 / 3)
    q = _quantize_options(parse(), "int4-weight")
    assert q.gptq_domains == ("chat", "news") and q.gptq_chat_share == 0.5
    with pytest.raises(RecipeError, match="gptq_domains must be distinct names"):
        parse("--gptq-domains", "chat,fortunes")
    recipe = tmp_path / "r.toml"
    recipe.write_text('precisions = ["int4-weight"]\ngptq_domains = ["news", "code"]\n')
    r = BuildOptions.from_toml(recipe, output=tmp_path / "y.bundle")
    assert _quantize_options(r, "int4-weight").gptq_domains == ("news", "code")


def test_qdq_float_ratio_recipe_key_reaches_the_int8_qdq_stage(tmp_path):
    """A recipe sets int8-qdq's float budget (0 skips its per-activation sensitivity pass, minutes on a small
    model); a value outside [0, 1) is refused when the recipe loads, not minutes into the build."""
    from export.recipe import BuildOptions, _quantize_options

    recipe = tmp_path / "r.toml"
    recipe.write_text('precisions = ["int8-qdq"]\n[quantize]\nqdq_float_ratio = 0\n')
    r = BuildOptions.from_toml(recipe, output=tmp_path / "y.bundle")
    assert _quantize_options(r, "int8-qdq").qdq_float_ratio == 0
    assert _quantize_options(BuildOptions(output=tmp_path / "x.bundle"), "int8-qdq").qdq_float_ratio == 0.2
    # fp8-qdq has the same budget and 8-bit rounding (export/trt_formats.py): the recipe's and flags' values reach it
    assert _quantize_options(r, "fp8-qdq").qdq_float_ratio == 0
    assert _quantize_options(BuildOptions(output=tmp_path / "x.bundle", int8_rounding="minmax"), "fp8-qdq").int8_rounding == "minmax"
    for bad in (1, -0.1, "some", False):  # TOML's false is not 0
        with pytest.raises(RecipeError, match="qdq_float_ratio must be a number in"):
            BuildOptions(output=tmp_path / "x.bundle", qdq_float_ratio=bad)
    # where the budget stops: the recipe's qdq_float_kl reaches both formats, refused when it is no KL
    recipe.write_text('precisions = ["int8-qdq"]\n[quantize]\nqdq_float_kl = 0.01\n')
    r = BuildOptions.from_toml(recipe, output=tmp_path / "y.bundle")
    assert _quantize_options(r, "int8-qdq").qdq_float_kl == _quantize_options(r, "fp8-qdq").qdq_float_kl == 0.01
    assert _quantize_options(BuildOptions(output=tmp_path / "x.bundle"), "fp8-qdq").qdq_float_kl == 0.004
    for bad in (-0.1, float("nan"), float("inf"), "some", True):
        with pytest.raises(RecipeError, match="qdq_float_kl must be a number >= 0"):
            BuildOptions(output=tmp_path / "x.bundle", qdq_float_kl=bad)
        with pytest.raises(RecipeError, match="qdq_float_kl must be a number >= 0"):
            QuantizeOptions(mode="fp8-qdq", qdq_float_kl=bad)
    for bad in (False, "0.2", float("nan"), 1):  # the stage's own options refuse them too, in one line
        with pytest.raises(RecipeError, match="qdq_float_ratio must be a number in"):
            QuantizeOptions(mode="int8-qdq", qdq_float_ratio=bad)


def test_qdq_float_ratio_flag_reaches_both_qdq_engines_and_is_refused_without_them(tmp_path):
    """--qdq-float-ratio (recipe key qdq_float_ratio: fp8-qdq at 0.7 is the closer engine of docs/quality.md) sets
    both Q/DQ engines' float share; a build that makes neither refuses it in one line, as the int4 flags do."""
    from export.cli import make_parser
    from export.recipe import BuildOptions, _quantize_options

    def parse(*flags: str) -> BuildOptions:
        return BuildOptions.from_cli(make_parser().parse_args(["build", "-o", str(tmp_path / "x.bundle"), *flags]))

    opts = parse("--precision", "fp8-qdq", "--precision", "int8-qdq", "--qdq-float-ratio", "0.7")
    assert _quantize_options(opts, "fp8-qdq").qdq_float_ratio == _quantize_options(opts, "int8-qdq").qdq_float_ratio == 0.7
    assert _quantize_options(parse("--precision", "fp8-qdq"), "fp8-qdq").qdq_float_ratio == 0.2
    with pytest.raises(RecipeError, match="--qdq-float-ratio shapes the int8-qdq and fp8-qdq"):
        parse("--precision", "int4-weight", "--qdq-float-ratio", "0.5")
    with pytest.raises(RecipeError, match="qdq_float_ratio must be a number in"):
        parse("--precision", "fp8-qdq", "--qdq-float-ratio", "1")


def test_sensitivity_samples_recipe_key_reaches_every_budgeted_stage(tmp_path):
    """Fewer sensitivity texts make the budgets' measurement faster (hours at billions of parameters): the recipe
    key reaches int8-qdq, fp8-qdq and both int4 engines; the default stays out of their stage keys (no rebuilds)."""
    from export.recipe import BuildOptions, _quantize_options

    recipe = tmp_path / "r.toml"
    recipe.write_text('precisions = ["int8-qdq"]\n[quantize]\nsensitivity_samples = 2\n')
    r = BuildOptions.from_toml(recipe, output=tmp_path / "y.bundle")
    for p in ("int8-qdq", "fp8-qdq", "int4-weight", "int4-qdq"):
        assert _quantize_options(r, p).sensitivity_samples == 2, p
        assert _quantize_options(BuildOptions(output=tmp_path / "x.bundle"), p).sensitivity_samples == 4, p
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(RecipeError, match="sensitivity_samples must be a whole number >= 1"):
            BuildOptions(output=tmp_path / "x.bundle", sensitivity_samples=bad)
