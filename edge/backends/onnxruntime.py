"""The ONNX Runtime backend: a decoder graph in an InferenceSession.

The KV cache is kept as OrtValues bound through IO binding, never copied through numpy: for a plain
graph the present outputs of one step are bound as the past inputs of the next; for a fused graph (the
engine's `io` says which) one buffer sized for prompt + answer is bound as both past and present and
written in place.
"""

from __future__ import annotations

import logging
import operator
import os
import threading

import numpy as np

from edge import precisions
from edge.bundle import Bundle, EngineEntry, ModelDims
from edge.backends.decoder import Decoder, KVCache
from edge.errors import BundleError, ContextOverflowError, DimensionError, MissingDependencyError
from edge.io_contract import DecoderIO
from edge.device.machine import physical_cores

log = logging.getLogger("edgechat")


def _ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise MissingDependencyError("onnxruntime", "the edge runtime",
                                     "pip install 'edgechat[cpu]' (or 'edgechat[gpu]' on a T4/L4, never both; on a Jetson, JetPack's "
                                     "onnxruntime-gpu from a Jetson index: docs/deploy.md)") from None
    return ort


def session_options(threads: int | None, spin: bool, config: dict[str, str] | None = None):
    """The session options every decoder graph runs with. `spin=False` is for a process with other busy threads
    (the server: HTTP, SSE writes; a draft model beside its target): ORT's workers must not busy-wait on the
    cores between calls (with spinning on, each call leaves them spinning ~25 ms), yet within a call they still
    spin between operators: `allow_spinning=0` made every operator wake its workers, ~15% of a small model's
    decode step through the server (docs/speed.md, "The serving path's cost per token")."""
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or physical_cores()
    so.inter_op_num_threads = 1
    if not spin:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return so


class OrtDecoder(Decoder):
    """One ONNX decoder graph in an InferenceSession (from a bundle, or a bare file during export)."""

    def __init__(self, path: str | os.PathLike, dims: ModelDims, io: DecoderIO, threads: int | None = None,
                 providers: list | None = None, name: str | None = None, spin: bool = True,
                 session_config: dict[str, str] | None = None, arena: bool = True,
                 logit_ids: np.ndarray | None = None, precision: str | None = None) -> None:
        """`providers`: execution provider names, or (name, options) pairs; `session_config`: extra ONNX Runtime
        session config entries (scripts/sweep_ort.py measures them);
        `arena`: ONNX Runtime's CPU memory arena; `logit_ids`: the vocabulary ids of a cut LM head's columns;
        `precision`: the graph's, whose CPU session settings (edge.precisions) apply when it runs on CPU alone."""
        ort = _ort()
        super().__init__(dims, io, name or os.path.basename(str(path)))
        self.logit_ids = logit_ids
        names = [p if isinstance(p, str) else p[0] for p in providers or []]  # a provider or (name, options)
        want_gpu = any("CUDA" in p or "Tensorrt" in p for p in names)
        cpu_only = all(n == "CPUExecutionProvider" for n in names)
        own = dict(precisions.get(precision).cpu_session_config) if precision and cpu_only else {}
        so = session_options(threads, spin, own | (session_config or {}))
        so.enable_cpu_mem_arena = arena
        so.log_severity_level = 3
        asked = providers or ["CPUExecutionProvider"]
        self.asked_providers = list(asked)
        missing = [n for n in (names or ["CPUExecutionProvider"]) if n not in ort.get_available_providers()]
        if missing:
            log.warning("execution providers %s are not in this onnxruntime build (%s); they will be skipped",
                        missing, ort.get_available_providers())
        keep = [p for p in asked if (p if isinstance(p, str) else p[0]) not in missing] or ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), so, providers=keep)
        except Exception as e:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail...)
            if session_config:
                try:  # the settings, or the file? the same file without them tells
                    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                except Exception:
                    pass
                else:
                    raise BundleError(f"ONNX Runtime refuses the session settings {session_config} for {self.name}: "
                                      f"{str(e).splitlines()[0]}") from None
            raise BundleError(f"ONNX Runtime cannot load {self.name}: {str(e).splitlines()[0]} — "
                              "the file is damaged or was written by a newer exporter; rebuild the bundle") from None
        self.providers = self.session.get_providers()
        if want_gpu and self.providers[0] == "CPUExecutionProvider":
            log.warning("asked for %s but ONNX Runtime fell back to CPU (CUDA/cuDNN libraries not found?): running on CPU", asked)
        self.device = "cuda" if self.providers[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"
        self._check_dims()
        past0 = next(i for i in self.session.get_inputs() if i.name == self.past_names[0])
        self._kv_dtype = kv_dtype(past0.type, self.name, io)
        # per calling thread (two threads may decode on one decoder: Generator.stream runs in its caller's): the
        # kept binding (K/V buffers bound, binding: _fused_binding) and the logits buffers (_logits_buffer)
        self._mine = threading.local()
        out0 = next((o for o in self.session.get_outputs() if o.name == self.io.logits), None)
        width = out0.shape[-1] if out0 is not None and out0.shape else None
        self._logits_width = width if isinstance(width, int) and out0.type in KV_DTYPES else None
        self._logits_dtype = KV_DTYPES.get(out0.type) if out0 is not None else None

    @classmethod
    def from_entry(cls, bundle: Bundle, entry: EngineEntry, threads: int | None = None,
                   providers: list | None = None, spin: bool = True) -> "OrtDecoder":
        """The decoder for one ONNX engine of a bundle (edge.backends.choose picks which)."""
        m = bundle.manifest
        io = DecoderIO.from_dict(m.engine_io(entry))
        ids = _logit_ids(bundle, io.logit_ids, m.model.vocab_size) if io.logit_ids else None
        dec = cls(bundle.path(entry.file), m.model, io, threads, providers, name=entry.file, spin=spin, logit_ids=ids,
                  precision=entry.fingerprint.precision)
        dec.engine = entry
        return dec

    def _check_dims(self) -> None:
        d = self.dims
        inputs = {i.name: i for i in self.session.get_inputs()}
        expect = self.io.input_names(d.num_layers)
        problems = [f"missing input '{n}'" for n in expect if n not in inputs]
        extra = [n for n in inputs if n not in expect]
        if extra:
            problems.append(f"unexpected inputs {extra[:4]} (graph has more layers than the manifest's {d.num_layers}?)")
        k0 = inputs.get(self.io.past_key.format(i=0))
        if k0 is not None:
            shape = k0.shape
            if isinstance(shape[1], int) and shape[1] != d.num_kv_heads:
                problems.append(f"KV heads {shape[1]} != manifest {d.num_kv_heads}")
            if isinstance(shape[3], int) and shape[3] != d.head_dim:
                problems.append(f"head dim {shape[3]} != manifest {d.head_dim}")
        logits = self.session.get_outputs()[0]
        columns = d.vocab_size if self.logit_ids is None else len(self.logit_ids)
        if isinstance(logits.shape[-1], int) and logits.shape[-1] != columns:
            problems.append(f"vocab {logits.shape[-1]} != manifest {d.vocab_size}" if self.logit_ids is None else
                            f"LM head {logits.shape[-1]} columns != {columns} ids in {self.io.logit_ids}")
        if problems:
            raise DimensionError(f"{self.name} does not match the manifest: " + "; ".join(problems))

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> KVCache:
        """An empty cache. For a fused graph, `capacity` columns are allocated up front (default: the
        model's context) and grown by `reserve` if a longer sequence comes."""
        ort = _ort()
        if not self.io.fused:
            empty = np.zeros((batch, self.dims.num_kv_heads, 0, self.dims.head_dim), dtype=self._kv_dtype)
            return KVCache([ort.OrtValue.ortvalue_from_numpy(empty, self.device, 0) for _ in self.past_names])
        cap = min(self.dims.max_context, capacity or self.dims.max_context)
        cache = KVCache([])  # _place sets the buffers and their capacity
        self._place(cache, [np.zeros(self._kv_shape(batch, cap), self._kv_dtype) for _ in self.past_names])
        return cache

    def _kv_shape(self, batch: int, columns: int) -> tuple[int, int, int, int]:
        return (batch, self.dims.num_kv_heads, columns, self.dims.head_dim)

    def _place(self, cache: KVCache, arrays: list[np.ndarray]) -> None:
        """Make `arrays` the cache's buffers: shared memory on CPU, a device copy on a GPU."""
        ort = _ort()
        cache.capacity = arrays[0].shape[2]
        if self.device == "cpu":
            cache.arrays = arrays
            cache.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
        else:
            cache.arrays = None
            cache.values = [ort.OrtValue.ortvalue_from_numpy(a, self.device, 0) for a in arrays]

    def reserve(self, cache: KVCache, columns: int) -> None:
        """Fused graphs: make the buffers hold at least `columns` tokens (doubling, up to the context),
        keeping what they hold. Rare: the runtime sizes a cache for prompt + max_new_tokens."""
        if not self.io.fused or columns <= cache.capacity:
            return
        if columns > self.dims.max_context:
            raise ContextOverflowError(f"{columns} tokens exceed the model's context of {self.dims.max_context}")
        cap = min(self.dims.max_context, max(columns, 2 * cache.capacity))
        old = cache.arrays if cache.arrays is not None else [v.numpy() for v in cache.values]
        grown = []
        for a in old:
            g = np.zeros(self._kv_shape(a.shape[0], cap), self._kv_dtype)
            g[:, :, : a.shape[2]] = a
            grown.append(g)
        self._place(cache, grown)

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list) -> tuple[np.ndarray, list]:
        """One plain-graph call: returns (logits [batch, seq, vocab], present OrtValues to pass as the next past)."""
        b = self.session.io_binding()
        b.bind_cpu_input(self.io.input_ids, np.ascontiguousarray(ids, dtype=np.int64))
        b.bind_cpu_input(self.io.attention_mask, np.ascontiguousarray(mask, dtype=np.int64))
        b.bind_cpu_input(self.io.position_ids, np.ascontiguousarray(positions, dtype=np.int64))
        for name, val in zip(self.past_names, past):
            b.bind_ortvalue_input(name, val)
        b.bind_output(self.io.logits, "cpu")
        for name in self.present_names:
            b.bind_output(name, self.device)
        self.session.run_with_iobinding(b)
        outs = b.get_outputs()
        return self._vocab(outs[0].numpy()), outs[1:]

    def _vocab(self, logits: np.ndarray) -> np.ndarray:
        """A cut LM head's columns spread over the whole vocabulary (-inf for ids it cannot pick)."""
        if self.logit_ids is None:
            return logits
        full = np.full(logits.shape[:-1] + (self.dims.vocab_size,), -np.inf, np.float32)
        full[..., self.logit_ids] = logits
        return full

    def run_fused(self, ids: np.ndarray, seqlens_k: np.ndarray, total: int, buffers: list,
                  at: np.ndarray | None = None) -> np.ndarray:
        """One fused-graph call: row i's new K/V go in place into `buffers` (bound as past AND present)
        after its seqlens_k[i] + 1 - seq cached tokens. Returns logits [batch, k, vocab] at the input
        positions `at` [batch, k] (None: every position, k = seq). A graph written before logit_positions
        existed computes every position; the rows asked for are picked here, so callers see one shape."""
        everywhere = at is None
        if everywhere:
            at = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape)
        b = self._fused_binding(buffers)
        b.bind_cpu_input(self.io.input_ids, np.ascontiguousarray(ids, dtype=np.int64))
        b.bind_cpu_input(self.io.seqlens_k, np.ascontiguousarray(seqlens_k, dtype=np.int32))
        b.bind_cpu_input(self.io.total_sequence_length, np.array(total, dtype=np.int32))
        if self.io.logit_positions:
            b.bind_cpu_input(self.io.logit_positions, np.ascontiguousarray(at, dtype=np.int64))
        out = self._logits_buffer(ids.shape[0], at.shape[1] if self.io.logit_positions else ids.shape[1])
        if out is None:
            b.bind_output(self.io.logits, "cpu")
        else:
            b.bind_ortvalue_output(self.io.logits, out[1])
        self.session.run_with_iobinding(b)
        if out is None:  # bound after every present (`_fused_binding`), so it comes after them
            raw = b.get_outputs()[len(self.present_names)].numpy()
        else:  # a kept buffer is written again by the next call: the caller gets its own copy
            raw = out[0].copy() if out[2] else out[0]
        logits = self._vocab(raw)
        if self.io.logit_positions or everywhere:
            return logits
        return np.take_along_axis(logits, np.asarray(at, np.int64)[:, :, None], axis=1)

    def _fused_binding(self, buffers: list):
        """The IO binding of the last call when it bound these same K/V buffers (a decode step's usual case):
        binding a 30-layer model's 120 past/present names anew, and reading every output back, cost ~1 ms of a
        10 ms step (docs/speed.md). Only the small inputs and the logits are bound again."""
        held = getattr(self._mine, "binding", None)
        if held is not None and len(held[0]) == len(buffers) and all(map(operator.is_, held[0], buffers)):
            return held[1]
        b = self.session.io_binding()
        for past, present, val in zip(self.past_names, self.present_names, buffers):
            b.bind_ortvalue_input(past, val)
            b.bind_ortvalue_output(present, val)
        self._mine.binding = (list(buffers), b)
        return b

    def _logits_buffer(self, batch: int, positions: int) -> tuple[np.ndarray, object, bool] | None:
        """A host array, its OrtValue, and whether it is kept (per shape, for the next call of that shape); None
        when the graph's vocabulary dimension is not fixed (ONNX Runtime then allocates the output). Decode and
        verify steps reuse their few shapes every token; a prefill or scoring call's [rows, positions, vocab]
        is hundreds of MB per shape (512 x 152k floats: 311 MB): above `KEEP_LOGITS_BYTES` the array is new
        and the caller's (keeping one per length seen grew a scoring run by GBs; docs/models.md)."""
        if self._logits_width is None:
            return None
        shape = (batch, positions, self._logits_width)
        if batch * positions * self._logits_width * np.dtype(self._logits_dtype).itemsize > KEEP_LOGITS_BYTES:
            arr = np.empty(shape, self._logits_dtype)
            return arr, _ort().OrtValue.ortvalue_from_numpy(arr), False
        kept = getattr(self._mine, "logits", None)
        if kept is None:
            kept = self._mine.logits = {}
        held = kept.get(shape)
        if held is None:
            if len(kept) > 16:  # batch x positions shapes seen: a handful in practice
                kept.clear()
            arr = np.empty(shape, self._logits_dtype)
            held = kept[shape] = (arr, _ort().OrtValue.ortvalue_from_numpy(arr), True)
        return held

    def to_device(self, array: np.ndarray):
        return _ort().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=self._kv_dtype), self.device, 0)

    def share(self, array: np.ndarray):
        """An OrtValue over `array`'s memory, no copy (a fused CPU cache binds views of its slots)."""
        return _ort().OrtValue.ortvalue_from_numpy(array)


KEEP_LOGITS_BYTES = 32 << 20  # the largest logits buffer an OrtDecoder keeps between calls (`_logits_buffer`)
KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # ONNX Runtime's names of the K/V types
INT8 = "tensor(int8)"


def kv_dtype(declared: str, name: str, io: DecoderIO | None = None) -> type:
    """The numpy dtype of the K/V cache, as the graph declares its past inputs (fp16 graphs keep an fp16 cache),
    checked against what the manifest's contract says it holds: an int8 cache (`io.kv_cache`) is never guessed
    from the graph, and a graph that disagrees with its manifest is refused."""
    if io is not None and io.kv_int8:
        if declared != INT8:
            raise BundleError(f"{name}: the manifest says its KV cache is int8 but the graph declares {declared}: "
                              "the bundle is damaged, rebuild it")
        return np.int8
    if declared == INT8:
        raise BundleError(f"{name} declares an int8 KV cache that its manifest does not name (io.kv_cache): "
                          "the bundle is damaged, rebuild it")
    try:
        return KV_DTYPES[declared]
    except KeyError:
        raise BundleError(f"{name} declares its past K/V as {declared}; this runtime keeps {' or '.join(KV_DTYPES)} "
                          "caches: re-export the engine with edge-export (fp32 or fp16)") from None


def _logit_ids(bundle: Bundle, rel: str, vocab: int) -> np.ndarray:
    """The ids file a cut LM head names (listed in the manifest, so verified with the bundle), checked."""
    try:
        ids = np.load(bundle.path(rel), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read the LM head's ids {rel} ({e}): the bundle is damaged, rebuild it") from None
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or not len(ids) \
            or ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != len(ids):
        raise BundleError(f"{rel} must hold distinct vocabulary ids (0..{vocab - 1}) in one row: the bundle is "
                          "damaged, rebuild it")
    return ids.astype(np.int64)
