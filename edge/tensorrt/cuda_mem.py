"""Device memory for the TensorRT backend behind one small interface: cuda-python, else pycuda.

Only what the decoder needs: a stream, device buffers, host<->device copies. cuda-python installs and
imports on any machine and fails cleanly at first use without a driver; pycuda is accepted where
only it is present (older Jetson images).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge.errors import EdgeChatError, MissingDependencyError


class CudaError(EdgeChatError):
    """The CUDA driver or runtime refused an operation."""


class CudaPython:
    name = "cuda-python"

    def __init__(self) -> None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            from cuda import cudart as rt  # older cuda-python
        self.rt = rt
        self.stream = self._ok(rt.cudaStreamCreate(), "cudaStreamCreate")

    def _ok(self, res, what: str):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            name = self.rt.cudaGetErrorName(err)[1]
            raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} "
                            "(is the NVIDIA driver loaded and the GPU visible? check nvidia-smi / tegrastats)")
        return rest[0] if len(rest) == 1 else (rest or None)

    def malloc(self, nbytes: int) -> int:
        return int(self._ok(self.rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))

    def free(self, ptr: int) -> None:
        self.rt.cudaFree(ptr)

    def htod(self, ptr: int, host: np.ndarray) -> None:
        self._ok(self.rt.cudaMemcpyAsync(ptr, host.ctypes.data, host.nbytes,
                                         self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream), "copy to GPU")

    def dtoh(self, host: np.ndarray, ptr: int) -> None:
        self._ok(self.rt.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes,
                                         self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream), "copy from GPU")
        self.sync()

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        self._ok(self.rt.cudaMemcpyAsync(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                         self.stream), "copy on GPU")

    def sync(self) -> None:
        self._ok(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    @property
    def stream_handle(self) -> int:
        return int(self.stream)


class PyCuda:
    name = "pycuda"

    def __init__(self) -> None:
        import pycuda.autoinit  # noqa: F401  creates the context
        import pycuda.driver as drv

        self.drv = drv
        self.stream = drv.Stream()
        self._allocs: dict[int, Any] = {}

    def malloc(self, nbytes: int) -> int:
        a = self.drv.mem_alloc(max(nbytes, 1))
        self._allocs[int(a)] = a
        return int(a)

    def free(self, ptr: int) -> None:
        a = self._allocs.pop(ptr, None)
        if a is not None:
            a.free()

    def htod(self, ptr: int, host: np.ndarray) -> None:
        self.drv.memcpy_htod_async(ptr, host, self.stream)

    def dtoh(self, host: np.ndarray, ptr: int) -> None:
        self.drv.memcpy_dtoh_async(host, ptr, self.stream)
        self.sync()

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        self.drv.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def sync(self) -> None:
        self.stream.synchronize()

    @property
    def stream_handle(self) -> int:
        return self.stream.handle


def open_cuda():
    """cuda-python if importable, else pycuda; a clear error when neither is."""
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        return CudaPython()
    if importlib.util.find_spec("pycuda") is not None:
        return PyCuda()
    raise MissingDependencyError("cuda-python", "the TensorRT backend (device buffers)",
                                 "pip install cuda-python (or pycuda)")


class DeviceArray:
    """A device buffer with a shape and dtype; `.numpy()` copies it to the host (as OrtValue does)."""

    def __init__(self, cuda, shape: tuple[int, ...], dtype, ptr: int | None = None) -> None:
        self.cuda, self.shape, self.dtype = cuda, tuple(int(s) for s in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.ptr = ptr if ptr is not None else cuda.malloc(self.nbytes)

    @classmethod
    def from_numpy(cls, cuda, array: np.ndarray) -> "DeviceArray":
        array = np.ascontiguousarray(array)
        d = cls(cuda, array.shape, array.dtype)
        if array.nbytes:
            cuda.htod(d.ptr, array)
        return d

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            self.cuda.dtoh(out, self.ptr)
        return out

    def __del__(self) -> None:
        try:
            self.cuda.free(self.ptr)
        except Exception:  # interpreter shutdown
            pass
