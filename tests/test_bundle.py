import json
import shutil

import pytest

from edge.bundle import SCHEMA_VERSION, Bundle, BundleWriter, Manifest
from edge.errors import (BundleFileMissingError, HashMismatchError, IncompleteBundleError, ManifestError,
                         SchemaVersionError)


def copy_bundle(tiny_bundle, tmp_path):
    dst = tmp_path / "copy.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    return dst


def test_manifest_round_trip(tiny_bundle):
    m = tiny_bundle.manifest
    again = Manifest.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m
    # nothing of schema 6 (a draft, a cut LM head) in it: written as 5, which the previous edgechat reads
    assert m.schema_version == 5 < SCHEMA_VERSION and "logit_ids" not in json.dumps(m.to_dict())
    assert {e.name for e in m.engines} == {"fp32", "int8-dynamic", "int8-qdq", "int4-weight"}
    assert m.model.num_layers == 2 and m.model.num_kv_heads == 2 and m.model.head_dim == 16
    assert m.tokenizer.eos_token_ids and m.tokenizer.chat_template
    assert [s.name for s in m.stages][:2] == ["load", "export"]
    for rel, f in m.files.items():
        assert len(f.sha256) == 64 and (tiny_bundle.root / rel).stat().st_size == f.size


def test_full_verify_passes(tiny_bundle):
    Bundle.open(tiny_bundle.root, verify="full")


def test_tampered_file_names_the_file(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    p = dst / "tokenizer.json"
    data = bytearray(p.read_bytes())
    data[10] ^= 0xFF  # same size, different content
    p.write_bytes(bytes(data))
    Bundle.open(dst, verify="size")  # size check alone cannot see it
    with pytest.raises(HashMismatchError, match="tokenizer.json"):
        Bundle.open(dst, verify="full")


def test_truncated_file_refused(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    onnx = dst / "engines" / "fp32" / "model.onnx"
    onnx.write_bytes(onnx.read_bytes()[:1000])
    with pytest.raises(HashMismatchError, match="engines/fp32/model.onnx.*truncated"):
        Bundle.open(dst)


def test_missing_file_refused(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    (dst / "tokenizer.json").unlink()
    with pytest.raises(BundleFileMissingError, match="tokenizer.json"):
        Bundle.open(dst)


def test_folder_without_manifest_is_incomplete(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    (dst / "manifest.json").unlink()
    with pytest.raises(IncompleteBundleError, match="rebuild"):
        Bundle.open(dst)


def test_unknown_schema_version(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    m = json.loads((dst / "manifest.json").read_text())
    m["schema_version"] = 99
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SchemaVersionError, match="99"):
        Bundle.open(dst)


def test_schema_1_bundle_still_reads(tiny_bundle, tmp_path):
    """A bundle from before per-engine IO (schema 1, plain engines only) loads and runs: every engine uses `io`."""
    from edge.decode.generate import Generator

    dst = copy_bundle(tiny_bundle, tmp_path)
    m = json.loads((dst / "manifest.json").read_text())
    m["schema_version"] = 1
    m["engines"] = [{k: v for k, v in e.items() if k != "io"} for e in m["engines"] if e["fingerprint"]["variant"] == "plain"]
    (dst / "manifest.json").write_text(json.dumps(m))
    b = Bundle.open(dst)
    assert b.manifest.schema_version == 1 and all(b.manifest.engine_io(e) == b.manifest.io for e in b.manifest.engines)
    gen = Generator.from_bundle(b, threads=1)
    assert not gen.decoder.io.fused and gen.decoder.engine.name == "fp32"


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.pop("model"), "model"),
    (lambda m: m["model"].update(num_heads=5), "multiple of num_kv_heads"),
    (lambda m: m["model"].update(bogus=1), "unknown keys"),
    (lambda m: m["tokenizer"].update(eos_token_ids=[]), "eos_token_ids"),
])
def test_bad_manifest_fields(tiny_bundle, tmp_path, mutate, match):
    dst = copy_bundle(tiny_bundle, tmp_path)
    m = json.loads((dst / "manifest.json").read_text())
    mutate(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=match):
        Bundle.open(dst)


def test_not_json(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    (dst / "manifest.json").write_text("{half")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Bundle.open(dst)


def test_interrupted_write_leaves_nothing_that_loads(tiny_bundle, tmp_path):
    dst = tmp_path / "new.bundle"
    with pytest.raises(RuntimeError):
        with BundleWriter(dst) as w:
            (w.root / "tokenizer.json").write_text("{}")
            raise RuntimeError("power cut")
    assert not dst.exists()
    assert not list(tmp_path.glob(".new.bundle.partial-*"))


def test_killed_write_is_refused(tiny_bundle, tmp_path):
    """A process killed mid-write (no cleanup) leaves only a hidden partial folder."""
    dst = tmp_path / "k.bundle"
    w = BundleWriter(dst)
    w.root.mkdir()
    shutil.copy(tiny_bundle.root / "tokenizer.json", w.root)
    with pytest.raises(IncompleteBundleError, match="interrupted"):
        Bundle.open(dst)
    with pytest.raises(IncompleteBundleError):
        Bundle.open(w.root)


def test_rewrite_replaces_old_bundle_only_after_verify(tiny_bundle, tmp_path):
    dst = copy_bundle(tiny_bundle, tmp_path)
    m = tiny_bundle.manifest
    with BundleWriter(dst) as w:
        for rel in m.files:
            (w.root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tiny_bundle.root / rel, w.root / rel)
        b = w.commit(m)
    assert b.root == dst.absolute()
    Bundle.open(dst, verify="full")


def test_a_tokenizer_that_adds_bos_is_schema_8_and_raw_prompts_start_with_it_once(tiny_bundle, tmp_path):
    """Gemma 3's GGUF says tokenizer.ggml.add_bos_token: its raw prompts (/v1/completions, run --raw) went in
    without BOS and it degenerated (" France. France. France."). The load stage reads add_bos_token, the
    manifest carries it (schema 8, written only when true so a reader of 7 still reads the rest), and a raw
    prompt starts with BOS exactly once."""
    import dataclasses

    from edge.bundle import schema_needed
    from edge.decode.tokenizer import ChatTokenizer
    from export.load import tokenizer_spec

    m = tiny_bundle.manifest
    assert not m.tokenizer.add_bos and "add_bos" not in m.to_dict()["tokenizer"]
    spec = dataclasses.replace(m.tokenizer, add_bos=True)
    m8 = dataclasses.replace(m, tokenizer=spec, schema_version=schema_needed(m.draft, m.engines, spec.add_bos))
    again = Manifest.from_dict(json.loads(json.dumps(m8.to_dict())))
    assert again.tokenizer.add_bos and again.schema_version == 8

    path = tiny_bundle.root / m.tokenizer.file
    plain, with_bos = ChatTokenizer(path, m.tokenizer), ChatTokenizer(path, spec)
    bos = spec.bos_token_id
    assert bos is not None and spec.bos_token
    ids = plain.encode_text("The capital of France is")
    assert ids == plain.encode("The capital of France is") and ids[:1] != [bos]
    assert with_bos.encode_text("The capital of France is") == [bos] + ids
    assert with_bos.encode_text(spec.bos_token + "The capital of France is") == [bos] + ids  # typed: still once
    assert with_bos.encode_text("") == []  # an empty prompt stays one (refused by its callers), not BOS alone

    load = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work") / "load"
    hf = tmp_path / "load"
    shutil.copytree(load, hf)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": True}))
    assert tokenizer_spec(hf).add_bos
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": False}))
    assert not tokenizer_spec(hf).add_bos


@pytest.mark.parametrize("bad", [{"add_bos": "no"}, {"add_bos": 1}, {"add_bos": None},
                                 {"add_bos": True, "bos_token_id": None}])
def test_a_damaged_add_bos_is_one_clear_manifest_error(tiny_bundle, bad):
    """A string "no" is truthy: read as is, a damaged manifest would put BOS before every raw prompt."""
    d = json.loads(json.dumps(tiny_bundle.manifest.to_dict()))
    d["tokenizer"].update(bad)
    d["schema_version"] = 8
    with pytest.raises(ManifestError, match="add_bos"):
        Manifest.from_dict(d)
