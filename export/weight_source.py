"""A model's weights read one tensor at a time, by Hugging Face name, straight from the files on disk.

The streaming build (export/stream_build.py) writes a graph from this instead of from a model loaded in torch:
safetensors files are read at each tensor's offset and a GGUF by the `gguf` package's reader (a memory map),
so asking for a tensor reads that tensor's bytes alone, in its own dtype, and converts that one
tensor to fp32. Memory is then bounded by the largest tensor, whatever the model's size (llama.cpp's converter
works the same way).

- `SafetensorsSource`: a Hugging Face folder, `model.safetensors` or sharded with `model.safetensors.index.json`,
  each tensor read from its offset in the file.
- `GGUFSource`: a GGUF file; each tensor dequantized alone (`gguf.quants.dequantize`), renamed and permuted as
  transformers does when it loads the file (`get_gguf_hf_weights_map` and its `TENSOR_PROCESSORS`: llama.cpp
  stores q/k rows interleaved, Gemma stores norm weights + 1), so the names and values equal the HF-loaded
  model's state dict (tests/test_weight_source.py checks both against transformers).

A tied LM head is the embedding: when the checkpoint has no `lm_head.weight`, it is answered with the embedding.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from edge.errors import ModelSourceError

HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


class WeightSource:
    """Tensors by HF state-dict name: `names()`, `shape(name)`, `get(name)` (a fresh fp32 array) and the
    model's config.json as a dict (`config`)."""

    config: dict

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _get(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        """The tensor in fp32 (read from disk now: only this tensor is in memory)."""
        return np.ascontiguousarray(self._get(self._resolve(name)), dtype=np.float32)

    def has(self, name: str) -> bool:
        return name in set(self.names()) or name == HEAD and EMBED in set(self.names())

    def _resolve(self, name: str) -> str:
        if name == HEAD and HEAD not in set(self.names()):  # tied (a config may leave its class's default out)
            return EMBED
        if name not in set(self.names()):
            raise ModelSourceError(f"the checkpoint has no tensor {name!r} (it has {len(self.names())}, e.g. "
                                   f"{', '.join(sorted(self.names())[:3])}): is it a {self.config.get('architectures')} "
                                   "checkpoint as transformers saves one?")
        return name

    def dims_shape(self, name: str) -> tuple[int, ...]:
        """The shape `get(name)` returns (a tied head's is the embedding's)."""
        return self.shape(self._resolve(name))


class SafetensorsSource(WeightSource):
    """A Hugging Face folder's safetensors file(s), each tensor read with one positioned read of its bytes (the
    header gives dtype, shape and offsets); bf16 and fp16 are widened to fp32 one tensor at a time. Not a memory
    map: mapped pages a read touched would stay in the process's resident memory until the file is closed."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.config = json.loads((self.folder / "config.json").read_text())
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ModelSourceError(f"{self.folder} has no model.safetensors (or model.safetensors.index.json): the "
                                   "streaming build reads safetensors checkpoints or GGUF files")
        self._where: dict[str, tuple[Path, int, str, tuple[int, ...]]] = {}
        for file in files:
            path = self.folder / file
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, h in header.items():
                if name != "__metadata__":
                    self._where[name] = (path, 8 + n + h["data_offsets"][0], h["dtype"], tuple(h["shape"]))
        self._names = sorted(self._where)

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][3]

    def _get(self, name: str) -> np.ndarray:
        path, offset, dtype, shape = self._where[name]
        count = int(np.prod(shape, dtype=np.int64))
        if dtype not in _SAFETENSORS_DTYPES:
            raise ModelSourceError(f"{path.name}: tensor {name!r} is {dtype}, which the streaming build does not read "
                                   f"({', '.join(_SAFETENSORS_DTYPES)})")
        raw = np.fromfile(path, dtype=_SAFETENSORS_DTYPES[dtype], count=count, offset=offset)
        if raw.size != count:
            raise ModelSourceError(f"{path} ends before its tensor {name!r}: a truncated download?")
        if dtype == "BF16":  # bf16 is the top half of an fp32; shifted in place (no third copy of the tensor)
            wide = raw.astype(np.uint32)
            del raw
            wide <<= 16
            raw = wide.view(np.float32)
        return raw.reshape(shape)


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class GGUFSource(WeightSource):
    """A GGUF file's tensors under their HF names, dequantized one at a time, as transformers maps them."""

    def __init__(self, path: Path) -> None:
        try:
            import gguf  # noqa: F401
            from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                                  get_gguf_hf_weights_map, load_gguf_checkpoint)
        except ImportError:
            from edge.errors import MissingDependencyError

            raise MissingDependencyError("gguf", "reading a GGUF file", "pip install 'edgechat[export]'") from None
        from gguf import GGUFReader

        self.path = Path(path)
        parsed = load_gguf_checkpoint(str(self.path), return_tensors=False)  # metadata only: the config
        cfg = dict(parsed["config"])
        self.config = _hf_config(cfg)
        skeleton = empty_model(self.config)
        reader = GGUFReader(str(self.path))
        arch = reader.fields["general.architecture"]
        arch = bytes(arch.parts[arch.data[0]]).decode()
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg)
        self._map = get_gguf_hf_weights_map(skeleton)
        self._tensors = {}
        for t in reader.tensors:  # where each tensor lies, not the reader's views into its memory map: the reader
            if t.name in self._map:  # goes, and the pages its parse touched (~0.5 GB of a 1.1 GB file) with it
                self._tensors[self._map[t.name]] = SimpleNamespace(
                    name=t.name, tensor_type=t.tensor_type, shape=tuple(int(d) for d in t.shape),
                    n_elements=int(t.n_elements), n_bytes=int(t.n_bytes), data_offset=int(t.data_offset))
        del reader
        self._names = sorted(self._tensors)

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims fastest-first

    def _get(self, name: str) -> np.ndarray:
        """Dequantized a few MB of rows at a time from positioned reads of the file (not the reader's memory map:
        pages a read touched would stay in the process's resident memory, the whole file by the build's end),
        into one fp32 array: dequantizing a whole tensor at once holds several fp32-sized temporaries."""
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        t = self._tensors[name]
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        cols = int(t.shape[0])  # GGUF lists dims fastest-first
        rows = int(t.n_elements) // cols
        row_bytes = cols // block * type_size
        if rows * row_bytes != int(t.n_bytes):
            raise ModelSourceError(f"{self.path.name}: tensor {t.name!r} holds {t.n_bytes} bytes, its type and shape "
                                   f"say {rows * row_bytes}: a damaged file?")
        out = np.empty((rows, cols), np.float32)
        step = max(1, (32 << 20) // (4 * cols))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            raw = np.fromfile(self.path, np.uint8, count=n * row_bytes, offset=int(t.data_offset) + r * row_bytes)
            if raw.size != n * row_bytes:
                raise ModelSourceError(f"{self.path} ends inside its tensor {t.name!r}: a truncated download?")
            try:
                out[r:r + n] = dequantize(raw.reshape(n, row_bytes), t.tensor_type)
            except NotImplementedError:
                raise ModelSourceError(f"{self.path.name}: tensor {t.name!r} is {t.tensor_type.name}, which the gguf "
                                       "package cannot dequantize: build from a GGUF of another quantization type "
                                       "(Q4_K_M, Q8_0, ...) or from the safetensors folder") from None
        w = out.reshape(tuple(int(d) for d in reversed(t.shape)))
        w = self._processor.process(weights=w, name=t.name, tensor_key_mapping=self._map, parsed_parameters={}).weights
        return np.asarray(w).reshape(self.shape(name))


def _hf_config(parsed: dict) -> dict:
    """The config.json transformers would write for a GGUF's parsed config (model_type -> architectures)."""
    from transformers import AutoConfig

    cfg = dict(parsed)
    model_type = cfg.pop("model_type")
    conf = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "architectures"})
    d = conf.to_dict()
    if not d.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return d


def empty_model(config: dict):
    """The HF model with no weights (parameters on the meta device) but its real buffers (rotary inv_freq):
    its module tree, names and config, for a few MB whatever the model's size."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    conf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(conf).eval()


def open_source(path: Path, gguf_file: str | None = None) -> WeightSource:
    """The weight source of an HF folder (safetensors) or a GGUF file (`gguf_file` inside folder `path`)."""
    path = Path(path)
    if gguf_file:
        return GGUFSource(path / gguf_file)
    if path.suffix == ".gguf":
        return GGUFSource(path)
    return SafetensorsSource(path)


class ModuleSource(WeightSource):
    """The weights of a model already loaded in torch (the export stage's parity reference), by the same names."""

    def __init__(self, model) -> None:
        self._sd = model.state_dict()
        self.config = model.config.to_dict()
        self._names = sorted(self._sd)

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def _get(self, name: str) -> np.ndarray:
        return self._sd[name].detach().float().numpy()


class Lazy:
    """A tensor known by its shape now and computed when its writer asks (from a source, one at a time)."""

    def __init__(self, shape: tuple[int, ...], fn, dtype=np.float32) -> None:
        self.shape, self.fn, self.dtype = tuple(int(d) for d in shape), fn, np.dtype(dtype)

    def __call__(self) -> np.ndarray:
        a = np.ascontiguousarray(self.fn(), dtype=self.dtype)
        if a.shape != self.shape:
            raise ValueError(f"a lazy tensor computed {list(a.shape)}, its record says {list(self.shape)}")
        return a
