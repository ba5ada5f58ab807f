"""The ONNX Runtime decoder and the one generation loop everything consumes.

`Decoder` owns an InferenceSession and runs prefill/decode steps with the KV
cache kept as OrtValues bound through IO binding, never copied through numpy:
for a plain graph the present outputs of one step are bound as the past inputs
of the next; for a fused graph (the engine's `io` says which) one buffer sized
for prompt + answer is bound as both past and present and written in place.
`Generator.stream` is the single token iterator with stop conditions; the CLI,
the Gradio page and the HTTP API only consume it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from edge.bundle import Bundle, EngineEntry, ModelDims
from edge.errors import BundleError, ContextOverflowError, DimensionError, EdgeChatError, MissingDependencyError
from edge.io_contract import DecoderIO
from edge.machine import physical_cores
from edge.sampling import Sampler, SamplingConfig
from edge.tokenizer import ChatTokenizer

log = logging.getLogger("edgechat")
PREFILL_CHUNK = 512
# Fused graphs prefill in calls that start and end at fixed absolute positions (16, 32, 64, 128, then every
# 128), and the prompt cache reuses K/V only up to one of them: a prompt whose start came from the cache then
# runs exactly the calls (same kernels, same shapes, same past) it would have run without it, so its answer
# does not depend on what was asked before. Small steps first so a short shared start (a system prompt) is
# reusable; 128 after that so a long prompt does not pay a weight read per handful of tokens.
PREFILL_BOUNDARY_FIRST, PREFILL_BOUNDARY_STEP = 16, 128


def next_boundary(pos: int) -> int:
    """The first prefill boundary after `pos` (see PREFILL_BOUNDARY_STEP)."""
    if pos < PREFILL_BOUNDARY_STEP:
        b = PREFILL_BOUNDARY_FIRST
        while b <= pos:
            b *= 2
        return min(b, PREFILL_BOUNDARY_STEP)
    return (pos // PREFILL_BOUNDARY_STEP + 1) * PREFILL_BOUNDARY_STEP


def boundary_at_or_below(n: int) -> int:
    """The last prefill boundary <= n (0 if none): how much of a cached start a prompt may reuse."""
    if n >= PREFILL_BOUNDARY_STEP:
        return n // PREFILL_BOUNDARY_STEP * PREFILL_BOUNDARY_STEP
    b = 0
    while next_boundary(b) <= n:
        b = next_boundary(b)
    return b


def _ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise MissingDependencyError("onnxruntime", "the edge runtime",
                                     "pip install 'edgechat[cpu]' (or 'edgechat[gpu]' on NVIDIA machines, never both)") from None
    return ort


def pick_engine(bundle: Bundle, name: str | None = None, prefer_gpu: bool = False) -> EngineEntry:
    """Choose an ONNX engine: by name, else the fastest precision the bundle has for this machine."""
    m = bundle.manifest
    if name:
        return m.engine(name)
    onnx = [e for e in m.engines if e.fingerprint.format == "onnx"]
    if not onnx:
        raise BundleError("bundle has no ONNX engine to run with ONNX Runtime")
    order = ["fp16", "int8-qdq", "int8-dynamic", "int4-weight", "fp32"] if prefer_gpu else \
        ["int8-dynamic", "int4-weight", "fp32", "int8-qdq", "fp16"]
    onnx.sort(key=lambda e: (order.index(e.fingerprint.precision) if e.fingerprint.precision in order else 99,
                             e.fingerprint.variant != "fused"))
    return onnx[0]


@dataclass
class KVCache:
    """Per-layer past key/values as OrtValues, plus the length they cover.

    Plain graphs: each step's present outputs become the next past (`values` is replaced).
    Fused graphs: `values` are fixed [batch, kv_heads, capacity, head_dim] buffers that the
    graph writes in place; `arrays` holds the numpy memory behind them on CPU.
    """

    values: list  # OrtValue per past input, in DecoderIO.past_names order
    length: int = 0
    capacity: int = 0  # fused: columns the buffers hold; 0 = grows with each step (plain)
    arrays: list | None = None  # fused on CPU: the numpy arrays the OrtValues share memory with


class Decoder:
    """One ONNX decoder graph in an InferenceSession (from a bundle, or a bare file during export)."""

    prefill_chunk = PREFILL_CHUNK  # most prompt tokens one plain-graph call takes (a TensorRT engine: its profile's)
    max_batch: int | None = None  # most sequences one decode step takes (None: any; a TensorRT engine: its profile's)

    def __init__(self, path: str | os.PathLike, dims: ModelDims, io: DecoderIO, threads: int | None = None,
                 providers: list[str] | None = None, name: str | None = None, spin: bool = True) -> None:
        ort = _ort()
        self.dims = dims
        self.io = io
        self.name = name or os.path.basename(str(path))
        want_gpu = bool(providers and any("CUDA" in p or "Tensorrt" in p for p in providers))
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads or physical_cores()
        so.inter_op_num_threads = 1
        if not spin:  # a server has other threads (HTTP, clients): idle ORT workers must not busy-wait on the cores
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        asked = providers or ["CPUExecutionProvider"]
        missing = [p for p in asked if p not in ort.get_available_providers()]
        if missing:
            log.warning("execution providers %s are not in this onnxruntime build (%s); they will be skipped",
                        missing, ort.get_available_providers())
        try:
            self.session = ort.InferenceSession(str(path), so, providers=[p for p in asked if p not in missing] or ["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail...)
            raise BundleError(f"ONNX Runtime cannot load {self.name}: {str(e).splitlines()[0]} — "
                              "the file is damaged or was written by a newer exporter; rebuild the bundle") from None
        self.providers = self.session.get_providers()
        if want_gpu and self.providers[0] == "CPUExecutionProvider":
            log.warning("asked for %s but ONNX Runtime fell back to CPU (CUDA/cuDNN libraries not found?): running on CPU", asked)
        self.device = "cuda" if self.providers[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"
        self._check_dims()
        self.past_names = self.io.past_names(self.dims.num_layers)
        self.present_names = self.io.present_names(self.dims.num_layers)
        past0 = next(i for i in self.session.get_inputs() if i.name == self.past_names[0])
        self._kv_dtype = np.float16 if "float16" in past0.type else np.float32

    @classmethod
    def from_bundle(cls, bundle: Bundle, engine: str | None = None, threads: int | None = None,
                    providers: list[str] | None = None, spin: bool = True) -> "Decoder":
        want_gpu = bool(providers and any("CUDA" in p or "Tensorrt" in p for p in providers))
        entry = pick_engine(bundle, engine, prefer_gpu=want_gpu)
        m = bundle.manifest
        dec = cls(bundle.path(entry.file), m.model, DecoderIO.from_dict(m.engine_io(entry)), threads, providers, name=entry.file,
                  spin=spin)
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
        if isinstance(logits.shape[-1], int) and logits.shape[-1] != d.vocab_size:
            problems.append(f"vocab {logits.shape[-1]} != manifest {d.vocab_size}")
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

    def forward(self, ids: np.ndarray, cache: KVCache, last_only: bool = True) -> np.ndarray:
        """Run `ids` [batch, seq] after the cached past; returns logits (last position, or all)."""
        if ids.ndim == 1:
            ids = ids[None, :]
        batch, seq = ids.shape
        past = cache.length
        if past + seq > self.dims.max_context:
            raise ContextOverflowError(f"{past + seq} tokens exceed the model's context of {self.dims.max_context}")
        if self.io.fused:
            self.reserve(cache, past + seq)
            at = np.full((batch, 1), seq - 1, np.int64) if last_only else None
            logits = self.run_fused(ids, np.full(batch, past + seq - 1, np.int32), past + seq, cache.values, at)
        else:
            mask = np.ones((batch, past + seq), dtype=np.int64)
            positions = np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq))
            logits, cache.values = self.run(ids, mask, positions, cache.values)
        cache.length = past + seq
        return logits[:, -1, :] if last_only else logits

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
        return outs[0].numpy(), outs[1:]

    def run_fused(self, ids: np.ndarray, seqlens_k: np.ndarray, total: int, buffers: list,
                  at: np.ndarray | None = None) -> np.ndarray:
        """One fused-graph call: row i's new K/V go in place into `buffers` (bound as past AND present)
        after its seqlens_k[i] + 1 - seq cached tokens. Returns logits [batch, k, vocab] at the input
        positions `at` [batch, k] (None: every position, k = seq). A graph written before logit_positions
        existed computes every position; the rows asked for are picked here, so callers see one shape."""
        b = self.session.io_binding()
        everywhere = at is None
        if everywhere:
            at = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape)
        b.bind_output(self.io.logits, "cpu")  # first, so it is get_outputs()[0]
        b.bind_cpu_input(self.io.input_ids, np.ascontiguousarray(ids, dtype=np.int64))
        b.bind_cpu_input(self.io.seqlens_k, np.ascontiguousarray(seqlens_k, dtype=np.int32))
        b.bind_cpu_input(self.io.total_sequence_length, np.array(total, dtype=np.int32))
        if self.io.logit_positions:
            b.bind_cpu_input(self.io.logit_positions, np.ascontiguousarray(at, dtype=np.int64))
        for past, present, val in zip(self.past_names, self.present_names, buffers):
            b.bind_ortvalue_input(past, val)
            b.bind_ortvalue_output(present, val)
        self.session.run_with_iobinding(b)
        logits = b.get_outputs()[0].numpy()
        if self.io.logit_positions or everywhere:
            return logits
        return np.take_along_axis(logits, np.asarray(at, np.int64)[:, :, None], axis=1)

    def to_ortvalue(self, array: np.ndarray):
        return _ort().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=self._kv_dtype), self.device, 0)

    def prefill(self, ids: list[int] | np.ndarray, cache: KVCache) -> np.ndarray:
        """Run `ids` after what `cache` holds; returns the last position's logits. A fused graph runs one call
        per span between prefill boundaries (absolute positions, see `next_boundary`), so the same prompt
        always runs the same calls, whether its start was computed here or copied from the prompt cache."""
        ids = np.asarray(ids, dtype=np.int64)
        logits = None
        start = 0
        while start < len(ids):
            end = next_boundary(cache.length) - cache.length if self.io.fused else self.prefill_chunk
            logits = self.forward(ids[start:start + end], cache)
            start += end
        assert logits is not None, "empty prompt"
        return logits


@dataclass
class StreamEvent:
    """A piece of generated text; the last event carries finish_reason and stats."""

    text: str
    finish_reason: str | None = None  # stop | length | cancelled
    token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


class Generator:
    """Bundle + tokenizer + decoder: prompts in, streamed text out."""

    def __init__(self, tokenizer: ChatTokenizer, decoder: Decoder, defaults: dict | None = None,
                 bundle: Bundle | None = None) -> None:
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.max_context = decoder.dims.max_context
        self.defaults = defaults or {}
        self.bundle = bundle

    @classmethod
    def from_bundle(cls, bundle: Bundle, engine: str | None = None, threads: int | None = None,
                    providers: list[str] | None = None, spin: bool = True) -> "Generator":
        """Load with the backend the fallback chain picks here (edge.backends), unless `providers` forces
        ONNX Runtime execution providers."""
        m = bundle.manifest
        tok = ChatTokenizer(bundle.path(m.tokenizer.file), m.tokenizer)
        if providers is not None:
            return cls(tok, Decoder.from_bundle(bundle, engine, threads, providers, spin), m.generation, bundle)
        from edge.backends import decide
        from edge.machine import detect

        here = detect()
        choice = decide(m, here, engine)
        dec: Decoder | None = None
        failed: list[str] = []
        dropped: set[str] = set()
        while choice.backend == "tensorrt":  # an engine whose fingerprint matches can still fail to load
            from edge.trt_runtime import TensorRTDecoder

            try:
                dec = TensorRTDecoder.from_entry(bundle, m.engine(choice.engine))
                break
            except EdgeChatError as e:
                if engine:  # asked for by name: no fallback
                    raise
                failed.append(f"TensorRT '{choice.engine}': it did not load here: {e}")
                dropped.add(choice.engine)
                choice = decide(dataclasses.replace(m, engines=[x for x in m.engines if x.name not in dropped]), here)
        choice = dataclasses.replace(choice, skipped=failed + choice.skipped)
        for line in choice.skipped:
            (log.warning if line.startswith("TensorRT '") else log.info)("skipped %s", line)
        log.info("running %s", choice.describe())
        if dec is None:
            dec = Decoder.from_bundle(bundle, choice.engine, threads, list(choice.providers), spin)
        gen = cls(tok, dec, m.generation, bundle)
        gen.choice = choice
        return gen

    def sampling(self, **overrides) -> SamplingConfig:
        base = {k: v for k, v in self.defaults.items() if k in SamplingConfig.__dataclass_fields__}
        base.update({k: v for k, v in overrides.items() if v is not None})
        if "stop" in base:
            base["stop"] = tuple([base["stop"]] if isinstance(base["stop"], str) else base["stop"])
        return SamplingConfig(**base)

    def tokens(self, prompt_ids: list[int], cfg: SamplingConfig,
               cancel: threading.Event | None = None) -> Iterator[int]:
        """Raw token ids after the prompt; stops at EOS, max_new_tokens or the end of the context."""
        if not prompt_ids:
            raise EdgeChatError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_context}: shorten it")
        cache = self.decoder.new_cache(capacity=len(prompt_ids) + cfg.max_new_tokens + 1)
        sampler = Sampler(cfg)
        seen = list(prompt_ids)
        logits = self.decoder.prefill(prompt_ids, cache)[0]
        for _ in range(cfg.max_new_tokens):
            tok = sampler(logits, np.asarray(seen) if cfg.repetition_penalty != 1.0 else None)
            if tok in self.tokenizer.eos_ids and not cfg.ignore_eos:
                return
            yield tok
            seen.append(tok)
            if cancel is not None and cancel.is_set():
                return
            if cache.length + 1 >= self.max_context:
                return
            logits = self.decoder.forward(np.array([[tok]]), cache)[0]

    def stream(self, prompt_ids: list[int], cfg: SamplingConfig,
               cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        text = TextStream(self.tokenizer, cfg, len(prompt_ids), self.max_context)
        it = self.tokens(prompt_ids, cfg, cancel)
        for tok in it:
            ev = text.push(tok)
            if ev is not None:
                yield ev
            if text.stopped:
                it.close()
                break
        yield from text.finish(cancelled=cancel is not None and cancel.is_set())

    def complete(self, prompt_ids: list[int], cfg: SamplingConfig) -> tuple[str, StreamEvent]:
        parts = []
        last = None
        for ev in self.stream(prompt_ids, cfg):
            parts.append(ev.text)
            last = ev
        assert last is not None
        return "".join(parts), last


class TextStream:
    """One answer's token ids in, StreamEvents out: incremental text, stop strings, finish reason, stats.

    Shared by the single-user `Generator.stream` and the batching scheduler, so
    both end an answer the same way.
    """

    def __init__(self, tokenizer: ChatTokenizer, cfg: SamplingConfig, prompt_len: int, max_context: int) -> None:
        self.cfg = cfg
        self.prompt_len = prompt_len
        self.max_context = max_context
        self.detok = tokenizer.streamer()
        self.held = ""  # text that might be the start of a stop string
        self.ids: list[int] = []
        self.stopped = False  # a stop string was hit
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prompt cache (not prefilled)

    def push(self, tok: int) -> StreamEvent | None:
        self.ids.append(tok)
        if self.first is None:
            self.first = time.perf_counter()
        self.held += self.detok.push(tok)
        out, self.held, self.stopped = _split_stop(self.held, self.cfg.stop)
        return StreamEvent(out, token_ids=[tok]) if out else None

    def finish(self, cancelled: bool = False, reason: str | None = None) -> list[StreamEvent]:
        """Flush held text and close with a finish reason (stop, length, cancelled; EOS counts as stop)."""
        n = len(self.ids)
        events = []
        if self.stopped:
            reason = "stop"
        elif reason is None:
            if cancelled:
                reason = "cancelled"
            elif n < self.cfg.max_new_tokens and self.prompt_len + n + 1 < self.max_context:
                reason = "stop"  # EOS
            else:
                reason = "length"
        if not self.stopped:
            self.held += self.detok.flush()
            out, _, hit = _split_stop(self.held, self.cfg.stop, final=True)
            if hit:
                reason = "stop"
            if out:
                events.append(StreamEvent(out))
        events.append(StreamEvent("", finish_reason=reason, token_ids=self.ids, stats=self.stats()))
        return events

    def stats(self) -> dict:
        t1 = time.perf_counter()
        n = len(self.ids)
        first = self.first or t1
        decode_s = t1 - first
        return {"prompt_tokens": self.prompt_len, "cached_prompt_tokens": self.cached_tokens,
                "completion_tokens": n, "ttft_s": first - self.t0,
                "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, "total_s": t1 - self.t0}


def _split_stop(text: str, stops: tuple[str, ...], final: bool = False) -> tuple[str, str, bool]:
    """Return (safe to emit, held back, stop hit)."""
    if not stops:
        return text, "", False
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        pos = min(h[0] for h in hits)
        return text[:pos], "", True
    if final:
        return text, "", False
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return (text[:-keep], text[-keep:], False) if keep else (text, "", False)
