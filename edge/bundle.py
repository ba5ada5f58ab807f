"""The bundle: a folder with `manifest.json` that says exactly what it holds.

The manifest is the contract between `export` (which writes bundles) and `edge`
(which serves them): model dims, tokenizer, chat template, EOS ids, every file
with its size and SHA-256, a record per export stage, and per engine a
compatibility fingerprint. Code never guesses what a bundle holds.

Writes are atomic: files go into a hidden `.NAME.partial-*` folder next to the
destination, the manifest is written last, everything is re-verified, and only
then is the folder renamed into place. An interrupted write never leaves a folder
that loads as complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from edge.errors import (
    BundleFileMissingError,
    HashMismatchError,
    IncompleteBundleError,
    ManifestError,
    SchemaVersionError,
)

log = logging.getLogger("edgechat")
SCHEMA_VERSION = 8
# 2: an engine may carry its own `io` contract (the fused graph's differs from the plain one's);
# a version-1 manifest still reads, every engine using the manifest's `io`.
# 3: a fused engine's `io` may name `logit_positions` (the graph returns logits at those positions only);
# an edgechat that reads only 1-2 refuses such a bundle by its version instead of failing on the key.
# 4: a stage record may carry `memory` (its measured peak resident memory).
# 5: `io` carries `prefill_chunk` (the most prompt tokens one plain-graph call takes); a reader of 1-4 builds its
# DecoderIO from every key and would fail on it.
# 6: an engine's `io` may name `logit_ids` (its LM head was cut to those vocabulary ids: a draft model's), and a
# manifest may carry `draft` (a draft model's bundle inside this one).
# 7: an engine's `io` may say `kv_cache: "int8"` with its scale names (an 8-bit KV cache, export/kv_int8.py);
# a reader of 1-6 refuses such a bundle by its version instead of binding int8 buffers as float.
# 8: `tokenizer.add_bos` (a raw prompt starts with the BOS token, as the model was trained: Gemma, Llama 2);
# written only when true, and a reader of 1-7 refuses such a bundle instead of feeding raw prompts without it.
READS_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
MANIFEST = "manifest.json"
PARTIAL_TAG = ".partial-"

Verify = Literal["none", "size", "stamp", "full"]
# "stamp": hash every file on the first load and record what was verified (size, mtime, ctime, inode, hash) in
# a state file (verified_stamp_path); later loads re-hash only files whose stat no longer matches their stamp,
# so a restart stays fast and a changed byte (which changes mtime and ctime) is still caught.
STATE_DIR_ENV = "EDGECHAT_STATE_DIR"


def schema_needed(draft: dict, engines: list, add_bos: bool = False) -> int:
    """The oldest schema that says what a manifest holds, so an older runtime still serves a bundle that uses
    nothing newer (a draft or a cut LM head needs 6, an 8-bit KV cache 7, a tokenizer that adds BOS 8)."""
    if add_bos:
        return 8
    if any(e.io.get("kv_cache") for e in engines):
        return 7
    return 6 if draft or any(e.io.get("logit_ids") for e in engines) else 5


def verified_stamp_path(root: Path) -> Path:
    """Where the verified stamp of the bundle at `root` is kept: $EDGECHAT_STATE_DIR, else the user's cache
    ($XDG_CACHE_HOME or ~/.cache)/edgechat/verified/, one file per bundle path."""
    base = os.environ.get(STATE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "edgechat", "verified")
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]
    return Path(base) / f"{key}.json"


def _stat_stamp(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class ModelDims:
    """What the runtime and the planner need to know about the network."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    num_parameters: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ManifestError(f"model.{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ManifestError(
                f"model.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


@dataclass(frozen=True)
class TokenizerSpec:
    file: str
    chat_template: str
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    # a raw prompt (text completion, `edge-chat run --raw`) starts with bos_token_id, as the model was trained
    # (the GGUF's tokenizer.ggml.add_bos_token, the HF tokenizer_config's add_bos_token); chat templates write
    # their own. Schema 8; written only when true.
    add_bos: bool = False

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ManifestError("tokenizer.eos_token_ids is empty: generation would never stop")
        if not isinstance(self.add_bos, bool):
            raise ManifestError(f"tokenizer.add_bos must be true or false, got {self.add_bos!r}: the manifest is "
                                "damaged, re-export the bundle")
        if self.add_bos and not isinstance(self.bos_token_id, int):
            raise ManifestError("tokenizer.add_bos is true but tokenizer.bos_token_id names no token: the manifest "
                                "is damaged, re-export the bundle")


@dataclass(frozen=True)
class Fingerprint:
    """What an engine needs from the machine that runs it."""

    format: str  # "onnx" | "tensorrt"
    precision: str  # fp32 | fp16 | int8-dynamic | int8-qdq | int4-weight
    opset: int | None = None
    variant: str = "plain"  # plain (standard ops, for TensorRT) | fused (ORT contrib ops)
    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    onnxruntime_version: str | None = None  # min version that built / validated it
    tensorrt_version: str | None = None
    cuda_version: str | None = None
    gpu_sm: str | None = None  # e.g. "8.7"
    gpu_name: str | None = None
    shapes: dict | None = None
    version_compatible: bool = False  # TensorRT engine built to run on later TensorRT of the same major


@dataclass(frozen=True)
class EngineEntry:
    name: str
    file: str
    fingerprint: Fingerprint
    quality: dict = field(default_factory=dict)
    io: dict = field(default_factory=dict)  # this engine's DecoderIO when it is not the manifest's `io`


@dataclass(frozen=True)
class StageRecord:
    name: str
    params: dict
    seconds: float
    tool_versions: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    finished: str = ""
    memory: dict = field(default_factory=dict)  # peak_rss_bytes, start_rss_bytes, peak_is_per_stage


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    bundle_id: str
    model_name: str
    model: ModelDims
    tokenizer: TokenizerSpec
    io: dict
    engines: list[EngineEntry]
    files: dict[str, FileEntry] = field(default_factory=dict)
    stages: list[StageRecord] = field(default_factory=list)
    generation: dict = field(default_factory=dict)
    golden: list[dict] = field(default_factory=list)
    source: str = ""
    created: str = ""
    schema_version: int = SCHEMA_VERSION
    # a draft model shipped inside the bundle (export/draft.py): a complete bundle of its own in the folder
    # `path` (its files listed and hashed in this manifest's `files` too), the engine that drafts, its
    # size and the acceptance measured at build time.
    draft: dict = field(default_factory=dict)

    def engine(self, name: str) -> EngineEntry:
        for e in self.engines:
            if e.name == name:
                return e
        have = ", ".join(e.name for e in self.engines) or "none"
        raise ManifestError(f"bundle has no engine named '{name}' (it has: {have})")

    def engine_bytes(self, name: str) -> int:
        """An engine's bytes: every listed file in its folder (the graph and its external weights)."""
        folder = self.engine(name).file.rsplit("/", 1)[0] + "/"
        return sum(f.size for rel, f in self.files.items() if rel.startswith(folder))

    def engine_io(self, entry: EngineEntry) -> dict:
        """The input/output contract `entry`'s graph follows (edge.io_contract.DecoderIO as a dict)."""
        return entry.io or self.io

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.tokenizer.add_bos:  # an older reader (schema <= 7) knows no such key
            d["tokenizer"].pop("add_bos")
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError("manifest.json must hold a JSON object")
        version = d.get("schema_version")
        if version not in READS_SCHEMA_VERSIONS:
            raise SchemaVersionError(
                f"manifest schema_version {version!r} is not supported by this edgechat "
                f"(it reads versions {', '.join(map(str, READS_SCHEMA_VERSIONS))}); upgrade edgechat or re-export the bundle"
            )
        try:
            return cls(
                schema_version=version,
                bundle_id=_req(d, "bundle_id", str),
                model_name=_req(d, "model_name", str),
                model=_build(ModelDims, _req(d, "model", dict), "model"),
                tokenizer=_build(TokenizerSpec, _req(d, "tokenizer", dict), "tokenizer"),
                io=_req(d, "io", dict),
                engines=[
                    EngineEntry(
                        name=_req(e, "name", str),
                        file=_req(e, "file", str),
                        fingerprint=_build(Fingerprint, _req(e, "fingerprint", dict), f"engines[{i}].fingerprint"),
                        quality=e.get("quality", {}),
                        io=_engine_io(e.get("io", {}), i),
                    )
                    for i, e in enumerate(_req(d, "engines", list))
                ],
                files={k: _build(FileEntry, v, f"files[{k!r}]") for k, v in _req(d, "files", dict).items()},
                stages=[_build(StageRecord, s, f"stages[{i}]") for i, s in enumerate(d.get("stages", []))],
                generation=d.get("generation", {}),
                golden=d.get("golden", []),
                source=d.get("source", ""),
                created=d.get("created", ""),
                draft=_draft_record(d.get("draft", {})),
            )
        except TypeError as e:  # unexpected / missing dataclass fields
            raise ManifestError(f"manifest.json does not follow schema {SCHEMA_VERSION}: {e}") from None


def _engine_io(io: Any, i: int) -> dict:
    if not isinstance(io, dict):
        raise ManifestError(f"manifest 'engines[{i}].io' must be an object")
    if "logit_ids" in io and not isinstance(io["logit_ids"], str):
        raise ManifestError(f"manifest 'engines[{i}].io.logit_ids' must be a file path in the bundle")
    return io


def _draft_record(d: Any) -> dict:
    """The `draft` entry: {} or an object naming the draft bundle's folder (inside this one) and its engine."""
    if not isinstance(d, dict):
        raise ManifestError("manifest key 'draft' must be an object")
    if not d:
        return {}
    for key in ("path", "engine"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise ManifestError(f"manifest 'draft' needs '{key}' (a non-empty string); the bundle is damaged, rebuild it")
    parts = Path(d["path"]).parts
    if Path(d["path"]).is_absolute() or not parts or ".." in parts:
        raise ManifestError(f"manifest 'draft' path {d['path']!r} must be a folder inside the bundle")
    for key, kind in (("acceptance", dict), ("num_parameters", int), ("num_layers", int), ("bytes", int),
                      ("head_tokens", int), ("target_engine", str), ("bundle_id", str)):
        if key in d and (not isinstance(d[key], kind) or isinstance(d[key], bool)):
            raise ManifestError(f"manifest 'draft' {key} must be a {kind.__name__}; the bundle is damaged, rebuild it")
    return d


def _req(d: dict, key: str, typ: type) -> Any:
    if key not in d:
        raise ManifestError(f"manifest.json is missing the required key '{key}'")
    if not isinstance(d[key], typ):
        raise ManifestError(f"manifest key '{key}' must be a {typ.__name__}, got {type(d[key]).__name__}")
    return d[key]


def _build(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise ManifestError(f"manifest '{where}' must be an object")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ManifestError(f"manifest '{where}' has unknown keys {sorted(unknown)} (schema {SCHEMA_VERSION})")
    try:
        return cls(**d)
    except TypeError as e:
        raise ManifestError(f"manifest '{where}': {e}") from None


# ----------------------------------------------------------------------------- reading


class Bundle:
    """An opened, verified bundle folder."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest
        self.hashed: list[str] = []  # files whose SHA-256 the last verify() computed (the others: sizes or stamps)

    @classmethod
    def open(cls, path: str | os.PathLike, verify: Verify = "size") -> "Bundle":
        root = Path(path)
        if not root.is_dir():
            partials = sorted(root.parent.glob(f".{root.name}{PARTIAL_TAG}*")) if root.parent.is_dir() else []
            if partials:
                raise IncompleteBundleError(
                    f"{root} does not exist, but an interrupted write left {partials[0].name}: rebuild the bundle"
                )
            raise BundleFileMissingError(f"bundle folder {root} does not exist")
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise IncompleteBundleError(
                f"{root} has no {MANIFEST}: it is not a complete bundle (an interrupted export leaves "
                "its files without a manifest); rebuild it with `edge-export build`"
            )
        try:
            raw = json.loads(mpath.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{mpath} is not valid JSON ({e}); the bundle is damaged, rebuild it") from None
        bundle = cls(root, Manifest.from_dict(raw))
        if verify != "none":
            bundle.verify(full=(verify == "full"), stamp=(verify == "stamp"))
        return bundle

    def path(self, rel: str) -> Path:
        return self.root / rel

    def verify(self, full: bool = True, stamp: bool = False) -> None:
        """Check every file the manifest lists: presence and size always; SHA-256 when `full`, or with `stamp`
        for each file whose verified stamp (see Verify) is missing or no longer matches its stat."""
        m = self.manifest
        listed = set(m.files)
        needed = {m.tokenizer.file} | {e.file for e in m.engines} | ({f"{m.draft['path']}/{MANIFEST}"} if m.draft else set())
        needed |= {e.io["logit_ids"] for e in m.engines if e.io.get("logit_ids")}
        for rel in sorted(needed - listed):
            raise ManifestError(f"manifest refers to '{rel}' but does not list it under 'files'")
        state = verified_stamp_path(self.root) if stamp else None
        old = _read_stamps(state) if state is not None else {}
        new: dict[str, dict] = {}
        self.hashed = []
        try:
            for rel, entry in sorted(m.files.items()):
                p = self.root / rel
                if not p.is_file():
                    raise BundleFileMissingError(f"bundle file '{rel}' is missing from {self.root}; re-copy or rebuild")
                st = p.stat()
                if st.st_size != entry.size:
                    raise HashMismatchError(
                        f"bundle file '{rel}' has {st.st_size} bytes, manifest says {entry.size}: it is truncated or "
                        "was changed; re-copy or rebuild the bundle"
                    )
                seen = {**_stat_stamp(st), "sha256": entry.sha256}
                if not (full or stamp) or (stamp and old.get(rel) == seen):
                    new[rel] = old.get(rel, {})
                    continue
                self.hashed.append(rel)
                if sha256_file(p) != entry.sha256:
                    raise HashMismatchError(
                        f"bundle file '{rel}' does not match its SHA-256 in the manifest: it was changed or "
                        "corrupted; re-copy or rebuild the bundle (edge-chat refuses to serve it)"
                    )
                new[rel] = seen
        finally:
            if state is not None and new != old:
                _write_stamps(state, self.root, {k: v for k, v in new.items() if v})

    def draft_bundle(self) -> "Bundle | None":
        """The draft bundle shipped inside this one (None when it has none). Its files were checked with this
        bundle's (they are listed in this manifest), so it opens without hashing them again."""
        if not self.manifest.draft:
            return None
        return Bundle.open(self.root / self.manifest.draft["path"], verify="none")

    def update_manifest(self, manifest: Manifest) -> None:
        """Replace the manifest in place (e.g. after adding an engine), atomically."""
        _write_json_atomic(self.root / MANIFEST, manifest.to_dict())
        self.manifest = manifest


def _read_stamps(path: Path) -> dict:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")).get("files", {}))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:
        log.warning("ignoring the unreadable verified stamp %s (%s): every file is hashed again", path, e)
        return {}


def _write_stamps(path: Path, root: Path, files: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(path, {"bundle": str(root.resolve()), "files": files})
    except OSError as e:  # verification itself passed; only the next start's shortcut is lost
        log.warning("could not record the verified stamp in %s (%s): the next start hashes the bundle again; "
                    "set %s to a writable folder", path, e, STATE_DIR_ENV)


# ----------------------------------------------------------------------------- writing


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hash_tree(root: Path) -> dict[str, FileEntry]:
    """Size and SHA-256 of every file under root (the manifest itself excluded; a nested draft bundle's
    manifest is listed like any file)."""
    out: dict[str, FileEntry] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p != root / MANIFEST and ".tmp-" not in p.name:
            out[p.relative_to(root).as_posix()] = FileEntry(size=p.stat().st_size, sha256=sha256_file(p))
    return out


class BundleWriter:
    """Write a bundle atomically: `with BundleWriter(dst) as w: ...; w.commit(manifest)`.

    Files are written under `w.root` (a hidden partial folder). `commit` hashes them,
    writes the manifest, verifies everything and renames the folder to `dst`,
    replacing an older bundle there only after the new one verified. Leaving the
    block without commit (an exception, Ctrl-C) removes the partial folder.
    """

    def __init__(self, dst: str | os.PathLike) -> None:
        self.dst = Path(dst).absolute()
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        self.root = self.dst.parent / f".{self.dst.name}{PARTIAL_TAG}{uuid.uuid4().hex[:8]}"
        self._done = False

    def __enter__(self) -> "BundleWriter":
        self.root.mkdir()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._done:
            shutil.rmtree(self.root, ignore_errors=True)

    def commit(self, manifest: Manifest) -> Bundle:
        files = hash_tree(self.root)
        manifest = dataclasses.replace(
            manifest, files=files, created=manifest.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        )
        _write_json_atomic(self.root / MANIFEST, manifest.to_dict())
        Bundle.open(self.root, verify="full")  # re-read and re-hash what is on disk
        old = None
        if self.dst.exists():
            old = self.dst.parent / f".{self.dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.dst, old)
        os.rename(self.root, self.dst)
        self._done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return Bundle.open(self.dst, verify="none")


def iter_partials(parent: Path) -> Iterator[Path]:
    """Leftover partial folders (from interrupted writes) under `parent`."""
    yield from parent.glob(f".*{PARTIAL_TAG}*")
