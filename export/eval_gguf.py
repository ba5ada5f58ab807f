"""llama.cpp rows for `edge-export eval`: a GGUF's logits on our token ids, and same-weights GGUFs to compare.

Through llama-cpp-python (the optional `bench` extra), so llama.cpp scores exactly the token ids the ONNX
engines score (llama-perplexity --kl-divergence tokenizes the text itself). `LLAMA_CPP_LIB_PATH` may point
at an already-built libllama (see llama-cpp-python's docs) so installing it does not compile llama.cpp again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

import numpy as np

from edge.errors import DataError, MissingDependencyError

CACHE = Path(os.environ.get("EDGECHAT_CACHE", Path.home() / ".cache" / "edgechat")) / "gguf"
# llama_ftype values (llama.h): what `llama-quantize` calls Q8_0, Q4_0, Q4_K_M
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}


def _llama_cpp():
    try:
        import llama_cpp
    except (ImportError, OSError):  # not installed, or installed without its library (FileNotFoundError)
        raise MissingDependencyError("llama-cpp-python", "scoring a GGUF",
                                     'pip install "edgechat[bench]" (or LLAMA_CPP_LIB_PATH=<dir of libllama.so> '
                                     'CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install llama-cpp-python)') from None
    return llama_cpp


@contextlib.contextmanager
def quiet_stderr():
    """llama.cpp prints per-tensor lines on the C stderr: keep them out of the terminal."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class GGUFModel:
    """One GGUF in llama.cpp, scoring given token ids (all positions' logits)."""

    def __init__(self, path: str | Path, n_ctx: int = 1024, threads: int | None = None) -> None:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"GGUF file {p} does not exist")
        llama_cpp = _llama_cpp()
        self.path, self.n_ctx = p, n_ctx
        with quiet_stderr():
            try:
                self.llm = llama_cpp.Llama(model_path=str(p), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                           logits_all=True, verbose=False, n_threads=threads or os.cpu_count() or 1,
                                           n_threads_batch=threads or os.cpu_count() or 1)
            except ValueError as e:
                raise DataError(f"llama.cpp cannot load {p}: {e}") from None

    @property
    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    def logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids) - 1, vocab] logits predicting ids[1:]."""
        if len(ids) > self.n_ctx:
            raise DataError(f"{len(ids)} tokens exceed the {self.n_ctx}-token context {self.path.name} was opened with")
        self.llm.reset()
        self.llm.eval(ids[:-1])
        return np.array(self.llm.scores[: len(ids) - 1], dtype=np.float32)


def f32_copy(src: Path, dst: Path) -> Path:
    """`src`'s weights dequantized to F32 in a new GGUF (the same weights a model loaded from `src` has)."""
    import gguf
    from gguf.quants import dequantize

    if dst.is_file():
        return dst
    tmp = dst.with_suffix(".partial")
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(tmp), r.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        val = 0 if f.name == gguf.Keys.General.FILE_TYPE else f.contents()  # 0 = ALL_F32
        w.add_key_value(f.name, val, vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


def same_weights(src: Path, kinds: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_K_M")) -> dict[str, Path]:
    """F32 and llama.cpp's own quantizations of the weights in `src` (cached by source name), made by
    llama_model_quantize from the F32 copy (no importance matrix, as `llama-quantize` does by default)."""
    llama_cpp = _llama_cpp()
    bad = [k for k in kinds if k not in FTYPES]
    if bad:
        raise DataError(f"unknown llama.cpp type {bad[0]}: choose from {', '.join(FTYPES)}")
    out = CACHE / src.stem
    out.mkdir(parents=True, exist_ok=True)
    paths = {"F32": f32_copy(src, out / "f32.gguf")}
    for k in kinds:
        path = out / f"{k.lower()}.gguf"
        if not path.is_file():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = FTYPES[k], os.cpu_count() or 1
            tmp = path.with_suffix(".partial")
            with quiet_stderr():
                rc = llama_cpp.llama_model_quantize(str(paths["F32"]).encode(), str(tmp).encode(), ctypes.byref(params))
            if rc != 0:
                raise DataError(f"llama.cpp could not quantize {src.name} to {k} (llama_model_quantize returned {rc})")
            tmp.rename(path)
        paths[k] = path
    return paths
