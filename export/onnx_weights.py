"""ONNX graphs of any size: the graph in memory, the weights on disk, one tensor at a time.

Protobuf cannot serialise a message over 2 GB, so `onnx.save(model)`, `model.ByteSize()` and
`model.SerializeToString()` fail on every model past ~500M fp32 parameters, and `onnx.load` of the
weights holds all of them in RAM at once. Every stage that edits a graph goes through `GraphWeights`
instead: the graph is loaded without its external data, a weight is read from its file only when asked
for (`array`), edits are recorded per tensor (`set`, a value or a callable computed at save time), and
`save` streams every tensor into one external data file, so the largest thing in memory is the largest
tensor, plus whatever new (quantized) tensors the caller keeps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union

import numpy as np

from edge.errors import EdgeChatError

Value = Union[np.ndarray, Callable[[], np.ndarray]]
INLINE_MAX = 1024  # tensors up to this many bytes stay inside the graph proto (as onnx.save's size_threshold)
ALIGN = 4096  # external tensors start on page boundaries, so ONNX Runtime can memory-map them
COPY_CHUNK = 64 << 20
FOUR_BIT = (21, 22)  # onnx.TensorProto.UINT4, INT4: stored two values a byte


def load_graph(path: Path):
    """The ModelProto without its external weights (they stay on disk)."""
    import onnx

    return onnx.load(str(path), load_external_data=False)


def _external(init) -> dict[str, str] | None:
    from onnx import TensorProto

    if init.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in init.external_data}


def attribute_tensors(model) -> list:
    """Tensors held in node attributes (Constant values), which may also live in external data."""
    from onnx import AttributeProto

    out = []
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.TENSOR:
                out.append(a.t)
            elif a.type == AttributeProto.TENSORS:
                out.extend(a.tensors)
    return out


def tensor_nbytes(init) -> int:
    """Bytes of an initializer's data, from its record (no data is read)."""
    from onnx import helper

    ext = _external(init)
    if ext is not None and "length" in ext:
        return int(ext["length"])
    if init.raw_data:
        return len(init.raw_data)
    count = int(np.prod(init.dims, dtype=np.int64))
    if init.data_type in FOUR_BIT:
        return (count + 1) // 2
    return count * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize


def pack_4bit(data: np.ndarray) -> np.ndarray:
    """ONNX's INT4/UINT4 bytes: two values a byte, the first in the low nibble (numpy's int4 holds one a byte)."""
    u = data.reshape(-1).view(np.uint8) & 0x0F
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def unpack_4bit(raw: np.ndarray, count: int, dtype) -> np.ndarray:
    """The inverse of pack_4bit: `count` values of `dtype` (ml_dtypes int4/uint4)."""
    u = np.empty(raw.size * 2, np.uint8)
    u[0::2], u[1::2] = raw & 0x0F, raw >> 4
    u = u[:count]
    if np.dtype(dtype).name == "int4":
        u = np.where(u > 7, u.astype(np.int16) - 16, u).astype(np.int8)
    return u.astype(dtype)


def append_external(f, t, chunks, nbytes: int, location: str) -> None:
    """Append a tensor's bytes to the open data file `f` at a page boundary and make `t` a record of them."""
    from onnx import TensorProto

    f.write(b"\0" * ((-f.tell()) % ALIGN))
    offset = f.tell()
    for c in chunks:
        f.write(c)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v


def graph_bytes(path: Path) -> int:
    """Bytes of a graph on disk: the .onnx file and every external data file it names."""
    model = load_graph(path)
    files = {path}
    for init in [*model.graph.initializer, *attribute_tensors(model)]:
        ext = _external(init)
        if ext is not None:
            files.add(path.parent / ext["location"])
    return sum(f.stat().st_size for f in files if f.is_file())


def _records_only(model):
    """A copy of the graph whose initializers are records without data (what shape inference needs: types, dims)."""
    import onnx

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for init in probe.graph.initializer:
        init.ClearField("raw_data")
        init.ClearField("external_data")
        init.data_location = onnx.TensorProto.DEFAULT
    return probe


def tensor_types(model) -> dict[str, int]:
    """Element type (onnx.TensorProto enum) of every tensor of the graph, from onnx's shape inference on the graph
    alone: no weight is read, so a graph of any size is typed in the memory of its nodes."""
    import onnx

    g = model.graph
    inferred = onnx.shape_inference.infer_shapes(_records_only(model), data_prop=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *g.input, *g.output]}
    types |= {i.name: i.data_type for i in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            types[n.output[0]] = n.attribute[0].t.data_type
    return {k: v for k, v in types.items() if v}


def type_mismatches(model) -> list[str]:
    """Nodes whose inputs bound to one type variable of the op's schema (MatMul's A and B, Concat's inputs...)
    have different types: what ONNX Runtime refuses at load and onnx's shape inference does not check."""
    import onnx

    types = tensor_types(model)
    opsets = {o.domain or "": o.version for o in model.opset_import}
    out = []
    for n in model.graph.node:
        try:
            schema = onnx.defs.get_schema(n.op_type, opsets.get(n.domain or "", 1), n.domain or "")
        except onnx.defs.SchemaError:
            continue  # a contrib op: its schema lives in ONNX Runtime
        bound: dict[str, dict[int, str]] = {}
        for k, name in enumerate(n.input):
            if name and name in types and schema.inputs:
                formal = schema.inputs[min(k, len(schema.inputs) - 1)]
                bound.setdefault(formal.type_str, {}).setdefault(types[name], name)
        for var, seen in bound.items():
            if len(seen) > 1:
                kinds = ", ".join(f"{onnx.TensorProto.DataType.Name(t)} ({name})" for t, name in sorted(seen.items()))
                out.append(f"{n.op_type} '{n.name}': inputs of type {var} differ: {kinds}")
    return out


def weight_matmuls(model) -> list:
    """MatMul nodes whose B input is a constant 2-D weight (the only ones we quantize)."""
    inits = {i.name: i for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2]


def lm_head_matmul(model):
    """The weight MatMul node that writes the graph's logits output (the LM head), by graph structure."""
    outs = {o.name for o in model.graph.output}
    return next((n for n in weight_matmuls(model) if n.output[0] in outs), None)


class GraphWeights:
    """A graph loaded without its weights, with per-tensor reads and edits, saved by streaming."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.base = self.path.parent
        self.model = load_graph(self.path)
        self._edits: dict[str, Value] = {}
        self._orig: dict = {}  # records of edited tensors as they were on disk
        self._sources: dict[str, Value] = {}  # a graph made in memory: where its tensors' values come from
        self._dropped: dict[str, Value] = {}  # edits of removed tensors, for computed edits that read them

    @classmethod
    def in_memory(cls, model, base: Path, sources: dict[str, Value]) -> "GraphWeights":
        """A graph built in memory (never saved yet) whose large tensors are `sources` (name -> array, or a
        callable computed when read: e.g. read from a checkpoint one tensor at a time). Their records in `model`
        carry dims and type only. They count as stored: edits and removals work as on a graph read from disk."""
        gw = cls.__new__(cls)
        gw.path, gw.base, gw.model = Path(base) / "model.onnx", Path(base), model
        gw._edits, gw._orig, gw._sources, gw._dropped = {}, {}, dict(sources), {}
        return gw

    @property
    def edited(self) -> bool:
        """Whether some tensor differs from what is on disk at `path`."""
        return bool(self._edits)

    # ------------------------------------------------------------------ lookup
    def initializer(self, name: str):
        for init in self.model.graph.initializer:
            if init.name == name:
                return init
        raise KeyError(name)

    def names(self) -> set[str]:
        return {i.name for i in self.model.graph.initializer}

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._edits and not callable(self._edits[name]):
            return tuple(self._edits[name].shape)
        return tuple(self.initializer(name).dims)

    def array(self, name: str) -> np.ndarray:
        """The tensor's current value: an edit if there is one, else read from its file (a fresh array)."""
        v = self._edits.get(name, self._dropped.get(name))
        if v is not None:
            return v() if callable(v) else v
        return self.stored(name)

    def stored(self, name: str) -> np.ndarray:
        """The tensor as it is on disk, ignoring edits."""
        if name in self._orig:
            return self._read(self._orig[name])
        return self._read(self.initializer(name))

    def transform(self, name: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        """Edit a tensor as a function of its current value (edits compose; computed on save)."""
        prev = self._edits.get(name)

        def value() -> np.ndarray:
            base = self.stored(name) if prev is None else (prev() if callable(prev) else prev)
            return fn(base)

        init = self.initializer(name)
        from onnx import helper

        self.set(name, value, dims=tuple(init.dims), dtype=helper.tensor_dtype_to_np_dtype(init.data_type))

    def _read(self, init) -> np.ndarray:
        from onnx import helper, numpy_helper

        if init.name in self._sources:
            v = self._sources[init.name]
            return v() if callable(v) else v
        ext = _external(init)
        if ext is None:
            return numpy_helper.to_array(init)
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        count = int(np.prod(init.dims, dtype=np.int64))
        with open(self.base / ext["location"], "rb") as f:
            if init.data_type in FOUR_BIT:
                raw = np.fromfile(f, dtype=np.uint8, count=(count + 1) // 2, offset=int(ext.get("offset", 0)))
                return unpack_4bit(raw, count, dtype).reshape(tuple(init.dims))
            a = np.fromfile(f, dtype=dtype, count=count, offset=int(ext.get("offset", 0)))
        if a.size != count:
            raise EdgeChatError(f"{self.base / ext['location']} ends before the tensor {init.name!r} it should hold "
                                "(a truncated or half-copied file): build again with --fresh")
        return a.reshape(tuple(init.dims))

    # ------------------------------------------------------------------ edits
    def set(self, name: str, value: Value, dims: tuple[int, ...] | None = None, dtype=None) -> None:
        """Replace or add a tensor. A callable is computed at save time (and by `array`): give its dims and dtype."""
        from onnx import TensorProto, helper

        if callable(value):
            if dims is None or dtype is None:
                raise ValueError("a computed tensor needs its dims and dtype")
        else:
            value = np.ascontiguousarray(value)
            dims, dtype = value.shape, value.dtype
        names = self.names()
        if name in names:
            init = self.initializer(name)
            self._keep_stored(init)
            init.ClearField("external_data")
            init.ClearField("raw_data")
            init.data_location = TensorProto.DEFAULT
            del init.dims[:]
        else:
            init = self.model.graph.initializer.add()
            init.name = name
        init.dims.extend(int(d) for d in dims)
        init.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self._edits[name] = value

    def remove(self, name: str) -> None:
        """Drop a tensor from the graph; a computed edit that reads it (`array`, `stored`) still can until the save."""
        init = self.initializer(name)
        self._keep_stored(init)
        self.model.graph.initializer.remove(init)
        if name in self._edits:
            self._dropped[name] = self._edits.pop(name)

    def _keep_stored(self, init) -> None:
        """Before a record is rewritten or removed: remember where its stored value is, for `stored`."""
        if init.name not in self._orig and init.name not in self._edits:
            self._orig[init.name] = type(init)()
            self._orig[init.name].CopyFrom(init)

    def drop_unused(self) -> None:
        """Remove initializers no node or graph output reads."""
        used = {i for n in self.model.graph.node for i in n.input} | {o.name for o in self.model.graph.output}
        for init in [i for i in self.model.graph.initializer if i.name not in used]:
            self.remove(init.name)

    # ------------------------------------------------------------------ save
    def save(self, dst: Path) -> int:
        """Write the graph to `dst` and its tensors to `dst.name + ".data"` beside it; returns the bytes written.

        Safe when `dst` is the file this graph was read from: the data goes to a temporary file first and
        both files are renamed into place at the end. Afterwards this object reads from what it wrote."""
        import onnx

        dst = Path(dst)
        data_name = dst.name + ".data"
        tmp_data = dst.with_name(f".{data_name}.partial-{os.getpid()}")
        tmp_graph = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
        out = type(self.model)()
        out.CopyFrom(self.model)  # the graph only: records are rewritten on the copy, the original stays readable
        written = 0
        try:
            with open(tmp_data, "wb") as f:
                for init in out.graph.initializer:
                    written += self._write_tensor(f, init, data_name)
                for t in attribute_tensors(out):  # Constant nodes' values (a quantizer may move them out)
                    written += self._write_tensor(f, t, data_name, editable=False)
            onnx.save_model(out, str(tmp_graph))
            # the data first, then the graph: a crash between the two leaves the folder half-written, which
            # callers only ever do inside a stage's partial folder (never renamed into place unfinished)
            os.replace(tmp_data, dst.parent / data_name)
            os.replace(tmp_graph, dst)
        finally:
            for t in (tmp_data, tmp_graph):
                if t.exists():
                    t.unlink()
        # now point this graph's records at what was written (the same object: callers hold its nodes)
        for a, b in zip(self.model.graph.initializer, out.graph.initializer):
            a.CopyFrom(b)
        for a, b in zip(attribute_tensors(self.model), attribute_tensors(out)):
            a.CopyFrom(b)
        self.path, self.base, self._edits, self._orig, self._sources, self._dropped = dst, dst.parent, {}, {}, {}, {}
        return written

    def _write_tensor(self, f, init, data_name: str, editable: bool = True) -> int:
        """Append one tensor's bytes to `f` (a small one stays inline) and point `init` at them."""
        from onnx import TensorProto, helper

        ext = _external(init)
        if editable and init.name in self._edits:
            data = np.ascontiguousarray(self.array(init.name))
            want = (tuple(init.dims), helper.tensor_dtype_to_np_dtype(init.data_type))
            if (data.shape, data.dtype) != want:
                raise ValueError(f"edit of {init.name!r} is {data.dtype}{list(data.shape)}, its record says "
                                 f"{want[1]}{list(want[0])}")
            chunks, nbytes = [data.reshape(-1).view(np.uint8)], data.nbytes
            if init.data_type in FOUR_BIT:
                chunks = [pack_4bit(data)]
                nbytes = chunks[0].nbytes
        elif init.name in self._sources:
            data = np.ascontiguousarray(self._read(init))
            chunks, nbytes = [data.reshape(-1).view(np.uint8)], data.nbytes
        elif ext is not None:
            nbytes = tensor_nbytes(init)  # "length" is optional in external data records
            chunks = self._file_chunks(ext, nbytes)
        elif tensor_nbytes(init) <= INLINE_MAX:
            return 0  # a small inline tensor stays as it is
        else:
            data = np.ascontiguousarray(self._read(init))
            chunks, nbytes = [data.reshape(-1).view(np.uint8)], data.nbytes
        for field in ("external_data", "raw_data", "float_data", "int32_data", "int64_data", "double_data",
                      "uint64_data", "string_data"):
            init.ClearField(field)
        if nbytes <= INLINE_MAX:
            init.data_location = TensorProto.DEFAULT
            init.raw_data = b"".join(bytes(c) for c in chunks)
            return 0
        append_external(f, init, chunks, nbytes, data_name)
        return nbytes

    def _file_chunks(self, ext: dict[str, str], length: int):
        """The bytes of an external tensor, read in chunks (never the whole file in memory)."""
        offset = int(ext.get("offset", 0))
        with open(self.base / ext["location"], "rb") as src:
            src.seek(offset)
            left = length
            while left:
                chunk = src.read(min(COPY_CHUNK, left))
                if not chunk:
                    raise EdgeChatError(f"{self.base / ext['location']} ends before the tensor it should hold "
                                        "(a truncated or half-copied file): build again with --fresh")
                left -= len(chunk)
                yield chunk


class TensorFile:
    """Writes initializers straight to an external data file as they are made (a graph built op by op
    never holds more than one weight in memory). Use as a context manager; `tensor` returns the record."""

    def __init__(self, data_path: Path) -> None:
        self.path = Path(data_path)
        self._f = None

    def __enter__(self) -> "TensorFile":
        self._f = open(self.path, "wb")
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def tensor(self, name: str, array: np.ndarray):
        from onnx import TensorProto, helper, numpy_helper

        array = np.ascontiguousarray(array)
        if array.nbytes <= INLINE_MAX:
            return numpy_helper.from_array(array, name)
        t = TensorProto()
        t.name = name
        t.dims.extend(array.shape)
        t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        append_external(self._f, t, [array.reshape(-1).view(np.uint8)], array.nbytes, self.path.name)
        return t


def untie_lm_head(gw: GraphWeights) -> None:
    """Give the LM head its own [hidden, vocab] weight when it is Transpose(embedding), so it can be quantized.

    The transposed copy is computed when first read (quantized, or written on save), never held twice."""
    from onnx import helper

    model = gw.model
    inits = gw.names()
    producers = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        p = producers.get(node.input[1])
        if p is not None and p.op_type == "Transpose" and p.input[0] in inits:
            src = p.input[0]
            rows, cols = gw.shape(src)
            name = src + ".lm_head_T"
            dtype = helper.tensor_dtype_to_np_dtype(gw.initializer(src).data_type)
            gw.set(name, lambda s=src: np.ascontiguousarray(gw.array(s).T), dims=(cols, rows), dtype=dtype)
            node.input[1] = name
            if not any(p.output[0] in n.input for n in model.graph.node):
                model.graph.node.remove(p)


def set_opset(gw: GraphWeights, opset: int) -> None:
    """Raise the default-domain opset: 18 -> 19/21 changes no op this exporter writes (they add types: INT4,
    FP8, and Cast's `saturate`), so the graph means the same."""
    for o in gw.model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, opset)
    gw.model.ir_version = max(gw.model.ir_version, 10 if opset >= 21 else 9)
