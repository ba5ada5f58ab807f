"""A stand-in for the cuda-python calls EdgeChat makes (`cuda.bindings.runtime` and `cuda.bindings.driver`),
backed by host memory: "device" allocations are numpy buffers, pointers are their addresses.

Strict where CUDA is:
- a copy or kernel touching memory outside a live allocation leaves the stream with
  cudaErrorIllegalAddress, which the next synchronizing call returns (as a faulting kernel does on a GPU);
  an allocation past the device's memory returns cudaErrorMemoryAllocation; a freed pointer is invalid;
- work is asynchronous: a device-to-device copy or a kernel (TensorRT's enqueue) runs only when its stream
  is synchronized (cudaStreamSynchronize, a device-to-host copy, cudaFree, which synchronizes the device);
  a host-to-device copy from pageable memory takes its bytes at the call, as the real one stages them;
- the driver has a CUDA version (`Device.driver_cuda`); bindings built for a newer CUDA major
  (`runtime.BINDINGS_CUDA`, cuda-python 13.x on a CUDA 12 driver) answer cudaErrorInsufficientDriver to
  everything but the version queries, as cuda-python 13 does on an R5xx driver;
- contexts are per thread: the runtime API makes the device's primary context current on first use in a
  thread; pycuda's `autoinit` makes a context of its own current on the importing thread only, and pycuda's
  calls on a thread with no current context raise; a stream or buffer used from a context that does not
  own it fails (cudaErrorInvalidResourceHandle / an illegal address), as it does across CUDA contexts.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import threading
import types
from typing import Callable

import numpy as np


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInsufficientDriver = 35
    cudaErrorInvalidResourceHandle = 400
    cudaErrorIllegalAddress = 700


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NO_DEVICE = 100


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class cudaStream_t:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


class Device:
    """The one fake GPU: its name, SM, memory, live allocations and streams."""

    PRIMARY = 1  # the primary context's id; pycuda's autoinit makes others

    def __init__(self, name: str = "Orin (fake)", sm: str = "8.7", memory_bytes: int = 8 << 30,
                 driver_cuda: str = "12.6") -> None:
        self.name, self.sm, self.memory_bytes, self.driver_cuda = name, sm, memory_bytes, driver_cuda
        self.allocs: dict[int, np.ndarray] = {}  # base address -> buffer
        self.owner: dict[int, int] = {}  # base address -> context id
        self._bases: list[int] = []
        self.streams: dict[int, cudaError_t] = {}  # handle -> sticky error
        self.stream_ctx: dict[int, int] = {}  # handle -> context id
        self.queues: dict[int, list[Callable[[], None]]] = {}  # handle -> work not yet run
        self.used = 0
        self.peak = 0
        self.contexts = 1
        self._tls = threading.local()
        # the device runs one thing at a time: queued work, a free (which waits for all work), an allocation;
        # re-entrant, as a free inside queued work is
        self._busy = threading.RLock()

    # ---------------------------------------------------------------- contexts (per thread)
    def current(self) -> int | None:
        """The context current on the calling thread (a stack, as CUDA's), None when none is."""
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else None

    def runtime_context(self) -> int:
        """What the runtime API uses: the current context, else the primary one, made current (lazily)."""
        if self.current() is None:
            self.push(self.PRIMARY)
        return self.current()  # type: ignore[return-value]

    def push(self, ctx: int) -> None:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        self._tls.stack.append(ctx)

    def pop(self) -> int | None:
        stack = getattr(self._tls, "stack", None)
        return stack.pop() if stack else None

    def new_context(self) -> int:
        self.contexts += 1
        return self.contexts

    # ---------------------------------------------------------------- memory
    def malloc(self, nbytes: int) -> tuple[cudaError_t, int]:
        with self._busy:
            return self._malloc(nbytes)

    def _malloc(self, nbytes: int) -> tuple[cudaError_t, int]:
        if nbytes <= 0:
            return cudaError_t.cudaErrorInvalidValue, 0
        if self.used + nbytes > self.memory_bytes:
            return cudaError_t.cudaErrorMemoryAllocation, 0
        buf = np.zeros(nbytes + 1, np.uint8)  # +1: two buffers never share an end address
        ptr = buf.ctypes.data
        self.allocs[ptr] = buf
        self.owner[ptr] = self.current() or self.PRIMARY
        bisect.insort(self._bases, ptr)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return cudaError_t.cudaSuccess, ptr

    def free(self, ptr: int) -> cudaError_t:
        with self._busy:  # cudaFree waits for the device's work (queued by any thread), as the real one does
            self.synchronize()
            return self._free(ptr)

    def _free(self, ptr: int) -> cudaError_t:
        buf = self.allocs.pop(int(ptr), None)
        if buf is None:
            return cudaError_t.cudaErrorInvalidValue
        self.owner.pop(int(ptr), None)
        self._bases.remove(int(ptr))
        self.used -= buf.size - 1
        return cudaError_t.cudaSuccess

    def view(self, ptr: int, nbytes: int, ctx: int | None = None) -> np.ndarray | None:
        """The device bytes [ptr, ptr + nbytes), or None when that is not inside one live allocation (of
        context `ctx`, when given: another context's memory is not addressable from this one)."""
        ptr = int(ptr)
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        base = self._bases[i]
        buf = self.allocs[base]
        off = ptr - base
        if off + nbytes > buf.size - 1 or (ctx is not None and self.owner.get(base) != ctx):
            return None
        return buf[off:off + nbytes]

    # ---------------------------------------------------------------- streams
    def stream_error(self, stream) -> cudaError_t | None:
        """None when `stream` is not a stream of this device."""
        return self.streams.get(int(stream))

    def fault(self, stream) -> None:
        if int(stream) in self.streams:
            self.streams[int(stream)] = cudaError_t.cudaErrorIllegalAddress

    def new_stream(self) -> int:
        handle = 0x5000 + len(self.streams) + 1
        self.streams[handle] = cudaError_t.cudaSuccess
        self.stream_ctx[handle] = self.current() or self.PRIMARY
        self.queues[handle] = []
        return handle

    def enqueue(self, stream, work: Callable[[], None]) -> None:
        """Work that runs when the stream is next synchronized (in order)."""
        with self._busy:
            self.queues[int(stream)].append(work)

    def run_queue(self, stream) -> cudaError_t:
        """Run the stream's queued work in order (what the GPU does while the host waits); its sticky error."""
        h = int(stream)
        with self._busy:
            q, self.queues[h] = self.queues.get(h, []), []
            for work in q:
                if self.streams[h]:
                    break  # a faulted stream runs nothing more
                work()
            return self.streams[h]

    def synchronize(self) -> None:
        with self._busy:
            for h in list(self.queues):
                self.run_queue(h)


DEVICE: Device | None = None  # set by the fixture; None = a machine without a driver


def _device() -> Device:
    if DEVICE is None:
        raise RuntimeError("fake CUDA: no device (the fixture did not install one)")
    return DEVICE


def _cuda_int(version: str) -> int:
    """'12.6' -> 12060, as cudaDriverGetVersion writes it."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major) * 1000 + int(minor) * 10


def _runtime() -> types.ModuleType:
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaError_t = cudaError_t
    rt.cudaMemcpyKind = cudaMemcpyKind
    rt.BINDINGS_CUDA = "12.9"  # the CUDA the stand-in bindings are built for (cuda-python 12.9.x); tests change it

    def _driver_ok() -> cudaError_t:
        """cuda-python built for a newer CUDA major than the driver's refuses every call (cuda-python 13 on R5xx)."""
        if int(rt.BINDINGS_CUDA.split(".")[0]) > int(_device().driver_cuda.split(".")[0]):
            return cudaError_t.cudaErrorInsufficientDriver
        _device().runtime_context()  # the runtime makes the primary context current on first use in a thread
        return cudaError_t.cudaSuccess

    def cudaGetErrorName(err):
        return cudaError_t.cudaSuccess, cudaError_t(int(err)).name.encode()

    def cudaDriverGetVersion():
        return cudaError_t.cudaSuccess, _cuda_int(_device().driver_cuda)

    def cudaRuntimeGetVersion():
        return cudaError_t.cudaSuccess, _cuda_int(rt.BINDINGS_CUDA)

    def cudaStreamCreate():
        if err := _driver_ok():
            return err, None
        return cudaError_t.cudaSuccess, cudaStream_t(_device().new_stream())

    def _stream(stream) -> cudaError_t | None:
        """The stream's sticky error; InvalidResourceHandle for no stream or another context's."""
        d = _device()
        err = d.stream_error(stream)
        if err is None or d.stream_ctx[int(stream)] != d.current():
            return cudaError_t.cudaErrorInvalidResourceHandle
        return err

    def cudaStreamSynchronize(stream):
        if err := _driver_ok() or _stream(stream):
            return (err,)
        return (_device().run_queue(stream),)

    def cudaMalloc(nbytes):
        if err := _driver_ok():
            return err, 0
        return _device().malloc(int(nbytes))

    def cudaFree(ptr):
        if err := _driver_ok():
            return (err,)
        return (_device().free(ptr),)

    def cudaMemcpyAsync(dst, src, nbytes, kind, stream):
        d = _device()
        if err := _driver_ok() or _stream(stream):
            return (err,)  # a faulted stream stays faulted
        nbytes = int(nbytes)
        kind = cudaMemcpyKind(int(kind))
        need_dst = kind in (cudaMemcpyKind.cudaMemcpyHostToDevice, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        need_src = kind in (cudaMemcpyKind.cudaMemcpyDeviceToHost, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        if (need_dst and d.view(dst, nbytes) is None) or (need_src and d.view(src, nbytes) is None):
            return (cudaError_t.cudaErrorInvalidValue,)  # the runtime checks a copy's device range up front
        dst, src = int(dst), int(src)
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:  # pageable host memory is staged at the call
            staged = ctypes.string_at(src, nbytes)
            d.enqueue(stream, lambda: ctypes.memmove(dst, staged, nbytes))
        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToDevice:
            d.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))
        else:  # to pageable host memory: returns when the copy is done, after the stream's earlier work
            if err := d.run_queue(stream):
                return (err,)
            ctypes.memmove(dst, src, nbytes)
        return (cudaError_t.cudaSuccess,)

    for f in (cudaGetErrorName, cudaDriverGetVersion, cudaRuntimeGetVersion, cudaStreamCreate, cudaStreamSynchronize,
              cudaMalloc, cudaFree, cudaMemcpyAsync):
        setattr(rt, f.__name__, f)
    return rt


def _driver() -> types.ModuleType:
    cu = types.ModuleType("cuda.bindings.driver")
    cu.CUresult = CUresult
    cu.CUdevice_attribute = CUdevice_attribute

    def cuInit(flags):
        return (CUresult.CUDA_SUCCESS if DEVICE is not None else CUresult.CUDA_ERROR_NO_DEVICE,)

    def cuGetErrorName(err):
        return CUresult.CUDA_SUCCESS, CUresult(int(err)).name.encode()

    def cuDeviceGet(ordinal):
        if DEVICE is None or ordinal != 0:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return CUresult.CUDA_SUCCESS, 0

    def cuDeviceGetName(length, dev):
        return CUresult.CUDA_SUCCESS, _device().name.encode()[:length - 1].ljust(length, b"\x00")

    def cuDeviceGetAttribute(attr, dev):
        major, minor = _device().sm.split(".")
        a = CUdevice_attribute(int(attr))
        return CUresult.CUDA_SUCCESS, int(major if a == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
                                          else minor)

    for f in (cuInit, cuGetErrorName, cuDeviceGet, cuDeviceGetName, cuDeviceGetAttribute):
        setattr(cu, f.__name__, f)
    return cu


runtime = _runtime()
driver = _driver()


def _pycuda() -> tuple[types.ModuleType, types.ModuleType]:
    """pycuda's `driver` calls EdgeChat makes (older Jetson images have only pycuda), on the same device.
    pycuda raises on errors where cuda-python returns codes, and every call needs a context current on the
    calling thread (pycuda's message when none is). `import pycuda.autoinit` makes a new context current on
    the importing thread only (`autoinit.context`); `Device(0).retain_primary_context()` is the primary one."""
    pkg = types.ModuleType("pycuda")
    pkg.__path__ = []  # a package, so `import pycuda.driver` works
    drv = types.ModuleType("pycuda.driver")

    class LogicError(RuntimeError):
        pass

    class MemoryError_(RuntimeError):
        pass

    def _need_context(what: str) -> int:
        ctx = _device().current()
        if ctx is None:
            raise LogicError(f"explicit_context_dependent failed: invalid device context - no currently active "
                             f"context? ({what})")
        return ctx

    class Context:
        def __init__(self, ident: int) -> None:
            self.ident = ident

        def push(self) -> None:
            _device().push(self.ident)

        @staticmethod
        def pop() -> None:
            if _device().pop() is None:
                raise LogicError("cuCtxPopCurrent failed: invalid device context")

        @staticmethod
        def get_current() -> "Context | None":
            ctx = _device().current()
            return Context(ctx) if ctx is not None else None

        def __eq__(self, other) -> bool:
            return isinstance(other, Context) and other.ident == self.ident

        def __hash__(self) -> int:
            return self.ident

        def detach(self) -> None:
            pass

    class Device:
        def __init__(self, ordinal: int) -> None:
            if ordinal != 0:
                raise LogicError("cuDeviceGet failed: invalid device ordinal")

        def retain_primary_context(self) -> Context:
            return Context(_device().PRIMARY)

        def make_context(self) -> Context:
            ctx = Context(_device().new_context())
            ctx.push()
            return ctx

    class DeviceAllocation:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def __int__(self) -> int:
            return self.ptr

        def free(self) -> None:
            _need_context("cuMemFree")
            if _device().free(self.ptr):
                raise LogicError("cuMemFree failed: invalid argument")

    class Stream:
        def __init__(self) -> None:
            _need_context("cuStreamCreate")
            self.handle = _device().new_stream()

        def synchronize(self) -> None:
            d = _device()
            if d.stream_ctx[self.handle] != _need_context("cuStreamSynchronize"):
                raise LogicError("cuStreamSynchronize failed: invalid resource handle")
            if err := d.run_queue(self.handle):
                raise LogicError(f"cuStreamSynchronize failed: {err.name}")

    def mem_alloc(nbytes):
        _need_context("cuMemAlloc")
        err, ptr = _device().malloc(int(nbytes))
        if err:
            raise MemoryError_("cuMemAlloc failed: out of memory")
        return DeviceAllocation(ptr)

    def _copy(dst, src, nbytes, kind, stream):
        _need_context("cuMemcpyAsync")
        err, = runtime.cudaMemcpyAsync(int(dst), int(src), nbytes, kind, stream.handle)
        if err:
            raise LogicError(f"cuMemcpy failed: {err.name}")

    drv.LogicError, drv.MemoryError, drv.DeviceAllocation, drv.Stream, drv.mem_alloc = (
        LogicError, MemoryError_, DeviceAllocation, Stream, mem_alloc)
    drv.Context, drv.Device = Context, Device
    drv.init = lambda flags=0: None
    drv.memcpy_htod_async = lambda dst, src, stream: _copy(dst, src.ctypes.data, src.nbytes,
                                                           cudaMemcpyKind.cudaMemcpyHostToDevice, stream)
    drv.memcpy_dtoh_async = lambda dst, src, stream: _copy(dst.ctypes.data, src, dst.nbytes,
                                                           cudaMemcpyKind.cudaMemcpyDeviceToHost, stream)
    drv.memcpy_dtod_async = lambda dst, src, size, stream: _copy(dst, src, size,
                                                                 cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
    pkg.driver = drv
    return pkg, drv


class PycudaAutoinit:
    """A meta-path finder for `pycuda.autoinit` that does what importing the real one does: make a new
    context and push it on the importing thread (only), as `autoinit.context`. Tests put it on sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(name, self) if name == "pycuda.autoinit" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.context = pycuda_driver.Device(0).make_context()


pycuda, pycuda_driver = _pycuda()
