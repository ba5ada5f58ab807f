"""The TensorRT backend: runs a bundle's serialized engine behind the `edge.backends.decoder.Decoder` interface,
so the one decode loop drives it like any other backend (`forward` and `prefill` come from there; this
module implements `run`, `new_cache` and `to_device`). Engines are built from the plain graph: KV caches
stay on the GPU as `DeviceArray`s and the present buffers of one step are the past of the next. Shapes
are set per call; the engine's two optimization profiles (prefill, decode; see
`edge.backends.tensorrt.settings.shape_profiles`) each get an execution context, and the two share one block of
activation memory (they never run at once: one stream, one lock), which on an 8 GB Orin is the
difference between one and two copies of it. Inputs and logits live in device buffers reused from token
to token; only the growing KV cache is allocated per step. Every call runs with the CUDA context current
on the calling thread (`CudaPython/PyCuda.active`), since the server decodes on its scheduler thread.
A version-compatible plan embeds its lean runtime (host code): it is loaded with
`engine_host_code_allowed`, and only when the bundle's fingerprint says it was built so.

Imports `tensorrt` lazily, so this module loads anywhere; it runs where TensorRT and a GPU exist.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import numpy as np

from edge.bundle import Bundle, EngineEntry, ModelDims
from edge.backends.tensorrt.cuda_mem import DeviceArray, Scratch, open_cuda
from edge.errors import BundleError, MissingDependencyError
from edge.io_contract import DecoderIO
from edge.backends.decoder import Decoder, KVCache

log = logging.getLogger("edgechat")


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise MissingDependencyError(
            "tensorrt", "building or running TensorRT engines",
            "on Jetson: sudo apt install python3-libnvinfer (JetPack ships TensorRT); on x86: "
            "pip install tensorrt (needs NVIDIA's package index)") from None
    if not hasattr(trt, "Builder"):  # e.g. only tensorrt-stubs installed: an empty namespace package
        raise MissingDependencyError(
            "tensorrt", "building or running TensorRT engines",
            f"'import tensorrt' found {list(getattr(trt, '__path__', [])) or trt} without TensorRT's Python "
            "bindings (type stubs alone?): install TensorRT itself") from None
    return trt


def _shape(dims) -> tuple[int, ...]:
    """A TensorRT Dims as a tuple (Dims indexes like a tuple; the stubs do not declare it iterable)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


class TensorRTDecoder(Decoder):
    """A TensorRT engine behind the Decoder interface."""

    def __init__(self, path: str | os.PathLike, dims: ModelDims, io: DecoderIO, name: str | None = None,
                 version_compatible: bool = False) -> None:
        import_tensorrt()
        import tensorrt as trt

        super().__init__(dims, io, name or os.path.basename(str(path)))
        self.trt = trt
        self.cuda = open_cuda()
        self.logger = trt.Logger(trt.Logger.WARNING)
        self._lock = threading.Lock()
        with self.cuda.active():
            self._load(path, version_compatible)

    def _load(self, path: str | os.PathLike, version_compatible: bool) -> None:
        trt, io, dims = self.trt, self.io, self.dims
        runtime = trt.Runtime(self.logger)
        runtime.engine_host_code_allowed = version_compatible  # such a plan carries its own lean runtime
        with open(path, "rb") as f:
            self.engine_ = runtime.deserialize_cuda_engine(f.read())
        if self.engine_ is None:
            raise BundleError(f"TensorRT could not load {self.name}: built by another TensorRT version or for another "
                              "GPU; rebuild it here with edge-chat build-engine (TensorRT's message above says which)")
        # one activation block for both contexts (USER_MANAGED: TensorRT allocates none of its own)
        self.activations = DeviceArray(self.cuda, (self.engine_.device_memory_size_v2,), np.uint8)
        self.contexts = []
        for i in range(self.engine_.num_optimization_profiles):
            ctx = self.engine_.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if ctx is None:  # TensorRT logs why and answers None
                raise BundleError(f"TensorRT could not create an execution context for {self.name} (not enough "
                                  "free GPU memory?)")
            ctx.set_device_memory(self.activations.ptr, self.activations.nbytes)
            ctx.set_optimization_profile_async(i, self.cuda.stream_handle)
            self.contexts.append(ctx)
        self.scratch = Scratch(self.cuda)
        self.providers = ["TensorRT"]
        self.device = "cuda"
        self._kv_dtype = np.dtype(trt.nptype(self.engine_.get_tensor_dtype(self.past_names[0])))
        self._logits_dtype = np.dtype(trt.nptype(self.engine_.get_tensor_dtype(io.logits)))
        # the prompt chunk the prefill profile (0) takes at most: Decoder.prefill cuts prompts to it
        self.prefill_chunk = _shape(self.engine_.get_tensor_profile_shape(io.input_ids, 0)[2])[1]
        # and the batch the decode profile (the last) takes at most: the scheduler keeps to it
        self.max_batch = _shape(self.engine_.get_tensor_profile_shape(io.input_ids, len(self.contexts) - 1)[2])[0]
        # an engine built with a shorter --max-context than the model's: the generation loop stops there
        # (finish "length") instead of the next step failing outside the profile
        context = _shape(self.engine_.get_tensor_profile_shape(io.attention_mask, len(self.contexts) - 1)[2])[1]
        if context < dims.max_context:
            self.dims = dataclasses.replace(dims, max_context=context)
        # the engine's own input types (TensorRT 10 keeps the graph's INT64 ids; an engine may declare INT32)
        self._in_dtype = {n: np.dtype(trt.nptype(self.engine_.get_tensor_dtype(n)))
                          for n in (io.input_ids, io.attention_mask, io.position_ids)}

    @classmethod
    def from_entry(cls, bundle: Bundle, entry: EngineEntry) -> "TensorRTDecoder":
        m = bundle.manifest
        dec = cls(bundle.path(entry.file), m.model, DecoderIO.from_dict(m.engine_io(entry)), name=entry.file,
                  version_compatible=entry.fingerprint.version_compatible)
        dec.engine = entry
        return dec

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> KVCache:
        """Engines are built from the plain graph: the past grows each step, `capacity` does not apply."""
        shape = (batch, self.dims.num_kv_heads, 0, self.dims.head_dim)
        with self.cuda.active():
            return KVCache([DeviceArray(self.cuda, shape, self._kv_dtype) for _ in self.past_names])

    def to_device(self, array: np.ndarray) -> DeviceArray:
        with self.cuda.active():
            return DeviceArray.from_numpy(self.cuda, np.asarray(array, dtype=self._kv_dtype))

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list) -> tuple[np.ndarray, list]:
        # the contexts' shapes and addresses are set per call: one caller at a time, in the CUDA context
        with self._lock, self.cuda.active():
            return self._run(ids, mask, positions, past)

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list) -> tuple[np.ndarray, list]:
        batch, seq = ids.shape
        # profile 0 = prefill (batch 1, many tokens), 1 = decode (one token per sequence)
        past_len = past[0].shape[2] if past else 0
        ctx = self.contexts[1 if seq == 1 and past_len >= 1 and len(self.contexts) > 1 else 0]
        for name, arr in ((self.io.input_ids, ids), (self.io.attention_mask, mask), (self.io.position_ids, positions)):
            d = self.scratch.view(name, arr.shape, self._in_dtype[name])
            d.write(arr)  # staged at the call (pageable host memory), ordered on the stream before the engine
            self._bind_input(ctx, name, d, batch, seq, past_len)
        for name, val in zip(self.past_names, past):
            if val.dtype != self._kv_dtype:
                raise BundleError(f"{self.name}: past '{name}' is {val.dtype} but the engine takes {self._kv_dtype} "
                                  "(a cache made for another engine?)")
            self._bind_input(ctx, name, val, batch, seq, past_len)
        logits = self.scratch.view(self.io.logits, _shape(ctx.get_tensor_shape(self.io.logits)), self._logits_dtype)
        ctx.set_tensor_address(self.io.logits, logits.ptr)
        present = []
        for name in self.present_names:
            d = DeviceArray(self.cuda, _shape(ctx.get_tensor_shape(name)), self._kv_dtype)
            ctx.set_tensor_address(name, d.ptr)
            present.append(d)
        if not ctx.execute_async_v3(self.cuda.stream_handle):
            raise BundleError(f"TensorRT failed to run {self.name} for batch {batch} x {seq} tokens after "
                              f"{past[0].shape[2] if past else 0} (outside the engine's shape profiles?)")
        out = logits.numpy()  # synchronizes the stream: the engine has run, the next call may reuse the scratch
        return out.astype(np.float32, copy=False), present

    def _bind_input(self, ctx, name: str, d: DeviceArray, batch: int, seq: int, past_len: int) -> None:
        """TensorRT answers a shape outside the context's optimization profile with False (and a logged
        error), not an exception: say which input and what the engine was built for."""
        if not ctx.set_input_shape(name, d.shape):
            lo, _, hi = (_shape(x) for x in self.engine_.get_tensor_profile_shape(name, self.contexts.index(ctx)))
            raise BundleError(f"{self.name}: '{name}' shape {d.shape} (batch {batch} x {seq} tokens after {past_len}) "
                              f"is outside the engine's shape profile {lo}..{hi}; rebuild the engine with a larger "
                              "--max-context / --max-batch")
        ctx.set_tensor_address(name, d.ptr)
