"""A stand-in for the cuda-python calls EdgeChat makes (`cuda.bindings.runtime` and `cuda.bindings.driver`),
backed by host memory: "device" allocations are numpy buffers, pointers are their addresses.

Strict where CUDA is: a copy or kernel touching memory outside a live allocation leaves the stream with
cudaErrorIllegalAddress, which the next synchronizing call returns (as a faulting kernel does on a GPU);
an allocation past the device's memory returns cudaErrorMemoryAllocation; a freed pointer is invalid.
Copies run at once (a host-memory device has nothing to overlap).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import types

import numpy as np


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
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

    def __init__(self, name: str = "Orin (fake)", sm: str = "8.7", memory_bytes: int = 8 << 30) -> None:
        self.name, self.sm, self.memory_bytes = name, sm, memory_bytes
        self.allocs: dict[int, np.ndarray] = {}  # base address -> buffer
        self._bases: list[int] = []
        self.streams: dict[int, cudaError_t] = {}  # handle -> sticky error
        self.used = 0
        self.peak = 0

    # ---------------------------------------------------------------- memory
    def malloc(self, nbytes: int) -> tuple[cudaError_t, int]:
        if nbytes <= 0:
            return cudaError_t.cudaErrorInvalidValue, 0
        if self.used + nbytes > self.memory_bytes:
            return cudaError_t.cudaErrorMemoryAllocation, 0
        buf = np.zeros(nbytes + 1, np.uint8)  # +1: two buffers never share an end address
        ptr = buf.ctypes.data
        self.allocs[ptr] = buf
        bisect.insort(self._bases, ptr)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return cudaError_t.cudaSuccess, ptr

    def free(self, ptr: int) -> cudaError_t:
        buf = self.allocs.pop(int(ptr), None)
        if buf is None:
            return cudaError_t.cudaErrorInvalidValue
        self._bases.remove(int(ptr))
        self.used -= buf.size - 1
        return cudaError_t.cudaSuccess

    def view(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """The device bytes [ptr, ptr + nbytes), or None when that is not inside one live allocation."""
        ptr = int(ptr)
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        base = self._bases[i]
        buf = self.allocs[base]
        off = ptr - base
        if off + nbytes > buf.size - 1:
            return None
        return buf[off:off + nbytes]

    # ---------------------------------------------------------------- streams
    def stream_error(self, stream) -> cudaError_t | None:
        """None when `stream` is not a stream of this device."""
        return self.streams.get(int(stream))

    def fault(self, stream) -> None:
        if int(stream) in self.streams:
            self.streams[int(stream)] = cudaError_t.cudaErrorIllegalAddress


DEVICE: Device | None = None  # set by the fixture; None = a machine without a driver


def _device() -> Device:
    if DEVICE is None:
        raise RuntimeError("fake CUDA: no device (the fixture did not install one)")
    return DEVICE


def _runtime() -> types.ModuleType:
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaError_t = cudaError_t
    rt.cudaMemcpyKind = cudaMemcpyKind

    def cudaGetErrorName(err):
        return cudaError_t.cudaSuccess, cudaError_t(int(err)).name.encode()

    def cudaStreamCreate():
        d = _device()
        handle = 0x5000 + len(d.streams) + 1
        d.streams[handle] = cudaError_t.cudaSuccess
        return cudaError_t.cudaSuccess, cudaStream_t(handle)

    def cudaStreamSynchronize(stream):
        err = _device().stream_error(stream)
        if err is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        return (err,)

    def cudaMalloc(nbytes):
        return _device().malloc(int(nbytes))

    def cudaFree(ptr):
        return (_device().free(ptr),)

    def cudaMemcpyAsync(dst, src, nbytes, kind, stream):
        d = _device()
        err = d.stream_error(stream)
        if err is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        if err:
            return (err,)  # a faulted stream stays faulted
        nbytes = int(nbytes)
        kind = cudaMemcpyKind(int(kind))
        need_dst = kind in (cudaMemcpyKind.cudaMemcpyHostToDevice, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        need_src = kind in (cudaMemcpyKind.cudaMemcpyDeviceToHost, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        if (need_dst and d.view(dst, nbytes) is None) or (need_src and d.view(src, nbytes) is None):
            return (cudaError_t.cudaErrorInvalidValue,)  # the runtime checks a copy's device range up front
        ctypes.memmove(int(dst), int(src), nbytes)
        return (cudaError_t.cudaSuccess,)

    for f in (cudaGetErrorName, cudaStreamCreate, cudaStreamSynchronize, cudaMalloc, cudaFree, cudaMemcpyAsync):
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


def _pycuda() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """pycuda's `driver` calls EdgeChat makes (older Jetson images have only pycuda), on the same device.
    pycuda raises on errors where cuda-python returns codes."""
    pkg = types.ModuleType("pycuda")
    pkg.__path__ = []  # a package, so `import pycuda.driver` works
    drv = types.ModuleType("pycuda.driver")
    autoinit = types.ModuleType("pycuda.autoinit")

    class LogicError(RuntimeError):
        pass

    class MemoryError_(RuntimeError):
        pass

    class DeviceAllocation:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def __int__(self) -> int:
            return self.ptr

        def free(self) -> None:
            if _device().free(self.ptr):
                raise LogicError("cuMemFree failed: invalid argument")

    class Stream:
        def __init__(self) -> None:
            _, s = runtime.cudaStreamCreate()
            self.handle = int(s)

        def synchronize(self) -> None:
            err = _device().stream_error(self.handle)
            if err:
                raise LogicError(f"cuStreamSynchronize failed: {err.name}")

    def mem_alloc(nbytes):
        err, ptr = _device().malloc(int(nbytes))
        if err:
            raise MemoryError_("cuMemAlloc failed: out of memory")
        return DeviceAllocation(ptr)

    def _copy(dst, src, nbytes, kind, stream):
        err, = runtime.cudaMemcpyAsync(int(dst), int(src), nbytes, kind, stream.handle)
        if err:
            raise LogicError(f"cuMemcpy failed: {err.name}")

    drv.LogicError, drv.MemoryError, drv.DeviceAllocation, drv.Stream, drv.mem_alloc = (
        LogicError, MemoryError_, DeviceAllocation, Stream, mem_alloc)
    drv.memcpy_htod_async = lambda dst, src, stream: _copy(dst, src.ctypes.data, src.nbytes,
                                                           cudaMemcpyKind.cudaMemcpyHostToDevice, stream)
    drv.memcpy_dtoh_async = lambda dst, src, stream: _copy(dst.ctypes.data, src, dst.nbytes,
                                                           cudaMemcpyKind.cudaMemcpyDeviceToHost, stream)
    drv.memcpy_dtod_async = lambda dst, src, size, stream: _copy(dst, src, size,
                                                                 cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
    pkg.driver, pkg.autoinit = drv, autoinit
    return pkg, drv, autoinit


pycuda, pycuda_driver, pycuda_autoinit = _pycuda()
