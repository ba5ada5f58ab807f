"""Device memory for the TensorRT backend behind one small interface: cuda-python, else pycuda.

Only what the decoder needs: a stream, device buffers, host<->device copies, and `active()`, which makes
the CUDA context current on the calling thread (the server decodes on its scheduler thread, not the one
that loaded the engine). cuda-python's runtime API does that by itself (the device's primary context);
pycuda needs it done, so it retains the primary context too (the one TensorRT's runtime uses) and pushes
it around each call. cuda-python installs and imports on any machine; opening it checks that the
driver's CUDA major is at least the bindings' (cuda-python 13 on a CUDA 12 driver refuses every call).
pycuda is accepted where only it is present (older Jetson images).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

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
        self._check_driver()
        self.stream = self._ok(rt.cudaStreamCreate(), "cudaStreamCreate")

    def _check_driver(self) -> None:
        """One clear line when the bindings need a newer driver than this one (or there is none)."""
        err, driver = self.rt.cudaDriverGetVersion()
        err2, built = self.rt.cudaRuntimeGetVersion()
        if int(err) != 0 or int(err2) != 0:
            return  # older bindings: the first real call says what is wrong
        if int(driver) == 0:
            raise CudaError("no NVIDIA driver is loaded (cudaDriverGetVersion gives 0): check nvidia-smi / tegrastats")
        have, need = int(driver) // 1000, int(built) // 1000
        if have < need:
            raise CudaError(f"cuda-python {_bindings_version()} is built for CUDA {need}, but this NVIDIA driver runs "
                            f"CUDA {have}.{int(driver) % 1000 // 10} at most: pip install 'cuda-python>={have}.0,"
                            f"<{have + 1}' (the bindings of the driver's CUDA), or update the driver")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The runtime API makes the primary context current on any thread by itself."""
        yield

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
    """pycuda over the device's primary context (not `pycuda.autoinit`'s own, which is current only on the
    thread that imported it): TensorRT's runtime API uses the primary context, so buffers, the stream and
    the engine all live in one context, made current on whichever thread calls."""

    name = "pycuda"

    def __init__(self) -> None:
        import pycuda.driver as drv

        self.drv = drv
        drv.init()
        self.context = drv.Device(0).retain_primary_context()
        self._allocs: dict[int, Any] = {}
        with self.active():
            self.stream = drv.Stream()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The primary context current on this thread for the block (pushed only when it is not already)."""
        if self.drv.Context.get_current() == self.context:
            yield
            return
        self.context.push()
        try:
            yield
        finally:
            self.drv.Context.pop()

    def malloc(self, nbytes: int) -> int:
        with self.active():
            a = self.drv.mem_alloc(max(nbytes, 1))
        self._allocs[int(a)] = a
        return int(a)

    def free(self, ptr: int) -> None:
        a = self._allocs.pop(ptr, None)
        if a is not None:
            with self.active():
                a.free()

    def htod(self, ptr: int, host: np.ndarray) -> None:
        with self.active():
            self.drv.memcpy_htod_async(ptr, host, self.stream)

    def dtoh(self, host: np.ndarray, ptr: int) -> None:
        with self.active():
            self.drv.memcpy_dtoh_async(host, ptr, self.stream)
            self.stream.synchronize()

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        with self.active():
            self.drv.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def sync(self) -> None:
        with self.active():
            self.stream.synchronize()

    @property
    def stream_handle(self) -> int:
        return self.stream.handle


def _bindings_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("cuda-python")
    except Exception:  # noqa: BLE001  not installed as a distribution (vendored, stand-in)
        return "(version unknown)"


def open_cuda():
    """cuda-python if importable, else pycuda; a clear error when neither is."""
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        return CudaPython()
    if importlib.util.find_spec("pycuda") is not None:
        return PyCuda()
    from edge.device.runtimes import CUDA_PYTHON_ADVICE

    raise MissingDependencyError("cuda-python", "the TensorRT backend (device buffers)", CUDA_PYTHON_ADVICE)


class DeviceArray:
    """A device buffer with a shape and dtype; `.numpy()` copies it to the host (as OrtValue does). Given a
    `ptr`, it is a view into memory someone else owns (a reused scratch buffer) and never frees it."""

    def __init__(self, cuda, shape: tuple[int, ...], dtype, ptr: int | None = None) -> None:
        self.cuda, self.shape, self.dtype = cuda, tuple(int(s) for s in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.owned = ptr is None
        self.ptr = cuda.malloc(self.nbytes) if ptr is None else ptr

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

    def write(self, array: np.ndarray) -> None:
        """Copy a host array of this buffer's size into it."""
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.nbytes != self.nbytes:
            raise ValueError(f"writing {array.nbytes} bytes into a {self.nbytes}-byte device buffer")
        if array.nbytes:
            self.cuda.htod(self.ptr, array)

    def __del__(self) -> None:
        if not getattr(self, "owned", False):
            return
        try:
            self.cuda.free(self.ptr)
        except Exception:  # interpreter shutdown
            pass


class Scratch:
    """Named device buffers reused across calls (inputs and logits of every decode step), grown when a call
    needs more: a token costs no cudaMalloc/cudaFree for them. `view` hands out a DeviceArray into one."""

    def __init__(self, cuda) -> None:
        self.cuda = cuda
        self._buffers: dict[str, DeviceArray] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype) -> DeviceArray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            grown = max(nbytes, 2 * buf.nbytes if buf is not None else 0, 256)
            buf = self._buffers[name] = DeviceArray(self.cuda, (grown,), np.uint8)
        return DeviceArray(self.cuda, shape, dtype, ptr=buf.ptr)

