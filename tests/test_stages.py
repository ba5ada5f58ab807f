"""Stage bookkeeping: reuse keyed on params and on the source the stage runs; interrupted stages never look done."""

import json

import pytest

from export.stages import CODE_KEY, code_fingerprint, run_stage


def _counting_stage(calls: list):
    def fn(d):
        calls.append(d)
        (d / "out.txt").write_text(f"run {len(calls)}")
        return {"n": len(calls)}
    return fn


def test_a_stage_is_reused_only_while_its_params_and_code_are_unchanged(tmp_path):
    calls, logs = [], []
    fn = _counting_stage(calls)
    out, rec = run_stage(tmp_path, "load", {"a": 1}, fn, log=logs.append, code="export.load")
    assert len(calls) == 1 and rec.tool_versions[CODE_KEY] == code_fingerprint("export.load")
    assert json.loads((out / "stage.json").read_text())["tool_versions"][CODE_KEY] == code_fingerprint("export.load")

    run_stage(tmp_path, "load", {"a": 1}, fn, log=logs.append, code="export.load")
    assert len(calls) == 1 and "reusing" in logs[-1]
    run_stage(tmp_path, "load", {"a": 2}, fn, log=logs.append, code="export.load")
    assert len(calls) == 2  # new params: runs again

    # the record says older code ran it (as after upgrading edgechat): runs again, and says why
    rec_path = out / "stage.json"
    rec_json = json.loads(rec_path.read_text())
    rec_json["tool_versions"][CODE_KEY] = "0123456789abcdef"
    rec_path.write_text(json.dumps(rec_json))
    mark = len(logs)
    run_stage(tmp_path, "load", {"a": 2}, fn, log=logs.append, code="export.load")
    assert len(calls) == 3 and "has changed since (0123456789abcdef ->" in logs[mark]
    assert (out / "out.txt").read_text() == "run 3"

    # a record from before fingerprints existed is stale too; --reuse-stale keeps it
    rec_json = json.loads(rec_path.read_text())
    del rec_json["tool_versions"][CODE_KEY]
    rec_path.write_text(json.dumps(rec_json))
    run_stage(tmp_path, "load", {"a": 2}, fn, log=logs.append, code="export.load", reuse_stale=True)
    assert len(calls) == 3 and "--reuse-stale" in logs[-1]
    mark = len(logs)
    run_stage(tmp_path, "load", {"a": 2}, fn, log=logs.append, code="export.load")
    assert len(calls) == 4 and "not recorded" in logs[mark]


def test_an_interrupted_stage_never_looks_finished(tmp_path):
    calls: list = []
    run_stage(tmp_path, "export", {"a": 1}, _counting_stage(calls), log=lambda m: None)

    def broken(d):
        (d / "model.onnx").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stage(tmp_path, "export", {"a": 2}, broken, log=lambda m: None)
    # the earlier finished output is untouched; the half-written one sits in the hidden partial folder
    assert (tmp_path / "export" / "out.txt").read_text() == "run 1"
    assert not (tmp_path / "export" / "model.onnx").exists()
    assert (tmp_path / ".export.partial" / "model.onnx").is_file()
    assert not (tmp_path / ".export.partial" / "stage.json").exists()


def test_the_fingerprint_follows_the_modules_a_stage_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "fpdemo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "stage.py").write_text("def run():\n    from fpdemo.helper import f\n    return f()\n")
    (pkg / "helper.py").write_text("from . import deep\n\ndef f():\n    return 1\n")
    (pkg / "deep.py").write_text("X = 1\n")
    (pkg / "unrelated.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def fp() -> str:
        code_fingerprint.cache_clear()
        return code_fingerprint("fpdemo.stage", packages=("fpdemo",))

    first = fp()
    (pkg / "unrelated.py").write_text("Y = 2\n")
    assert fp() == first  # code the stage never imports does not invalidate it
    (pkg / "helper.py").write_text("from . import deep\n\ndef f():\n    return 2\n")
    second = fp()
    assert second != first  # a lazily imported helper changed
    (pkg / "deep.py").write_text("X = 2\n")
    assert fp() != second  # ... and what that helper imports (relative import), transitively
    code_fingerprint.cache_clear()
