"""A strict stand-in for TensorRT's Python API (10.x and 11.x), for tests on machines without TensorRT or a GPU.

Installed onto sys.modules["tensorrt"] by the `fake_gpu` fixture (tests/test_tensorrt_engine.py); never
shipped. It implements only what EdgeChat calls, with the names, argument orders and return conventions
of tensorrt-stubs 10.13 (which scripts/typecheck.sh checks our calls against), and runs a "network" by
executing its ONNX graph with ONNX Runtime on CPU over buffers in the stand-in CUDA device
(tests/fake_tensorrt/cuda.py).

Strict where TensorRT is, and in TensorRT's manner (False / None plus a logged error, not exceptions):
- the ONNX parser rejects ops TensorRT has no importer for (com.microsoft contrib ops) and opsets
  outside 9-20;
- optimization profiles must give every dynamic input min <= opt <= max of the network's rank with its
  static dims; a STRONGLY_TYPED network refuses precision flags; BF16 needs SM >= 8.0, a network with INT4
  weights SM >= 8.0 and one with FP8 Q/DQ SM >= 8.9;
- the parser refuses Q/DQ nodes its importer asserts on (`export.trt_compat.qdq_problems`: non-zero or UINT8
  zero points, scales <= 0, blocks on more than one axis, INT4 on activations or with an odd last dimension);
- a build that needs more device memory than there is returns None ("OutOfMemory");
- an engine from another TensorRT version (unless built VERSION_COMPATIBLE and run by a later one of the
  same major) or for another SM does not deserialize (None);
- `set_input_shape` outside the context's profile returns False; `execute_async_v3` with an input shape
  or a tensor address unset returns False;
- a bound buffer smaller than its tensor (a dtype or shape mismatch) faults the stream, as a kernel
  reading past an allocation does: the next synchronize returns cudaErrorIllegalAddress.
- it plays the TensorRT version in `__version__` (the fixture sets it): 11.x has no precision builder flags
  (BuilderFlag.FP16/BF16/INT8/FP8/INT4, OBEY/PREFER_PRECISION_CONSTRAINTS), every network is strongly
  typed, and the V1 device-memory calls are gone (the names checked against the tensorrt_cu12_bindings
  10.3.0 and 11.4.0.106 wheels' compiled module);
- the parser refuses a node whose op and input types onnx-tensorrt's operator table for that version does
  not list (`export.trt_compat.node_problems`, the export-time check's own table);
- each optimization profile's min, opt and max points must each be shapes the network can run
  ("kOPT values for profile 0 violate shape constraints"): the stand-in runs the graph at each point;
- a version-compatible plan deserializes only with `Runtime.engine_host_code_allowed = True`;
- an execution context made with ExecutionContextAllocationStrategy.USER_MANAGED runs only after
  `set_device_memory(ptr, size)` with at least `device_memory_size_v2` bytes of live device memory; a
  STATIC one takes its own from the device;
- `execute_async_v3` checks what TensorRT checks at enqueue, then queues the work on the stream: it runs
  at the stream's next synchronization, in the calling thread's CUDA context, which must own the stream
  and the buffers (tests/fake_tensorrt/cuda.py).
A strongly typed network computes in the graph's own types (an fp16 graph runs in fp16 under ONNX Runtime).
What it does not emulate: a weakly typed FP16 build's reduced precision (it computes in fp32), tactic
timing, real memory use (a build "needs" twice its weights plus the workspace limit).
"""

from __future__ import annotations

import ast
import enum
import json

import sys

import numpy as np

from . import cuda as _cuda

__version__ = "10.3.0"  # the fixture sets the version it plays


def _major() -> int:
    return int(__version__.split(".")[0])
MAGIC = b"FAKETRT1"
MIN_OPSET, MAX_OPSET = 9, 21  # as export/trt_compat.py (21: INT4 weights)


# ----------------------------------------------------------------------------- enums and small types


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8


_ONNX_TO_TRT = {1: DataType.FLOAT, 10: DataType.HALF, 3: DataType.INT8, 6: DataType.INT32, 9: DataType.BOOL,
                2: DataType.UINT8, 16: DataType.BF16, 7: DataType.INT64}
_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}


def nptype(trt_type: DataType):
    if trt_type not in _NP:
        raise TypeError(f"Could not resolve TensorRT datatype to an equivalent numpy datatype: {trt_type!r}")
    return _NP[trt_type]


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class _NetworkDefinitionCreationFlag10(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class _NetworkDefinitionCreationFlag11(enum.IntEnum):
    STRONGLY_TYPED = 1  # accepted and ignored: every TensorRT 11 network is strongly typed


class _BuilderFlag10(enum.IntEnum):
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7
    SAFETY_SCOPE = 8
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    DIRECT_IO = 11
    REJECT_EMPTY_ALGORITHMS = 12
    VERSION_COMPATIBLE = 13
    EXCLUDE_LEAN_RUNTIME = 14
    FP8 = 15
    ERROR_ON_TIMING_CACHE_MISS = 16
    BF16 = 17
    INT4 = 18


# gone in TensorRT 11 (its migration guide; absent from the 11.4 bindings): weak typing's precision switches
_REMOVED_IN_11 = {"FP16", "INT8", "FP8", "BF16", "INT4", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS",
                  "DIRECT_IO"}
_BuilderFlag11 = enum.IntEnum("BuilderFlag", {f.name: f.value for f in _BuilderFlag10 if f.name not in _REMOVED_IN_11})
_PRECISION_FLAGS = {_BuilderFlag10.FP16, _BuilderFlag10.BF16, _BuilderFlag10.INT8, _BuilderFlag10.FP8,
                    _BuilderFlag10.INT4, _BuilderFlag10.TF32}


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


def __getattr__(name: str):
    """The enums whose members differ between TensorRT 10 and 11, for the version being played."""
    if name == "BuilderFlag":
        return _BuilderFlag11 if _major() >= 11 else _BuilderFlag10
    if name == "NetworkDefinitionCreationFlag":
        return _NetworkDefinitionCreationFlag11 if _major() >= 11 else _NetworkDefinitionCreationFlag10
    raise AttributeError(f"module 'tensorrt' has no attribute '{name}'")


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class Dims(tuple):
    """Behaves like a tuple, as TensorRT's Dims does."""

    def __new__(cls, shape=()):
        return super().__new__(cls, (int(s) for s in shape))


def _dims(x) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)):
        raise TypeError(f"incompatible function arguments: expected Dims, tuple or list, got {type(x).__name__}")
    return tuple(int(v) for v in x)


class Logger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = (Severity.INTERNAL_ERROR, Severity.ERROR, Severity.WARNING,
                                                     Severity.INFO, Severity.VERBOSE)

    def __init__(self, min_severity: "Logger.Severity" = Severity.WARNING) -> None:
        self.min_severity = min_severity
        self.messages: list[tuple[Logger.Severity, str]] = []

    def log(self, severity: "Logger.Severity", msg: str) -> None:
        self.messages.append((severity, msg))
        LOG.append((severity, msg))
        if severity <= self.min_severity:
            print(f"[TRT] [{'IEWIV'[severity]}] {msg}", file=sys.stderr)


LOG: list[tuple[Logger.Severity, str]] = []  # every message of every logger, for tests to read


class IHostMemory(bytes):
    """A serialized engine or timing cache: a buffer (bytes is one)."""

    @property
    def nbytes(self) -> int:
        return len(self)


# ----------------------------------------------------------------------------- network + parser


class _Tensor:
    def __init__(self, name: str, dtype: DataType, shape: tuple, symbols: tuple) -> None:
        self.name, self.dtype, self.shape, self.symbols = name, dtype, shape, symbols  # shape: -1 = dynamic


class INetworkDefinition:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.strongly_typed = _major() >= 11 or bool(flags & (1 << int(_NetworkDefinitionCreationFlag10.STRONGLY_TYPED)))
        self.inputs: list[_Tensor] = []
        self.outputs: list[_Tensor] = []
        self.model_bytes: bytes | None = None
        self.weight_bytes = 0
        self.quantized: set[str] = set()

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)


def _tensors(values) -> list[_Tensor]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [(d.dim_value if d.HasField("dim_value") else -1, d.dim_param) for d in t.shape.dim]
        out.append(_Tensor(v.name, _ONNX_TO_TRT.get(t.elem_type, DataType.FLOAT), tuple(d for d, _ in dims),
                           tuple(p for _, p in dims)))
    return out


def _quantized_types(m) -> set[str]:
    """The quantized types a graph's Q/DQ nodes carry: a DequantizeLinear's constant input, a zero point."""
    names = {3: "INT8", 17: "FP8", 22: "INT4"}
    inits = {i.name: i.data_type for i in m.graph.initializer}
    found = set()
    for n in m.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            for k in (0, 2):
                if k < len(n.input) and inits.get(n.input[k]) in names:
                    found.add(names[inits[n.input[k]]])
    return found


# the lowest SM each quantized type builds on (TensorRT's "Working with Quantized Types": INT4 weight-only GEMMs
# from Ampere, FP8 GEMMs from compute capability 8.9)
_MIN_SM = {"INT4": (8, 0), "FP8": (8, 9)}


class ParserError:
    def __init__(self, desc: str, node: str = "") -> None:
        self._desc, self._node = desc, node

    def desc(self) -> str:
        return self._desc

    def __str__(self) -> str:
        return f"In node {self._node or -1} (parseGraph): INVALID_NODE: {self._desc}"


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Logger) -> None:
        self.network, self.logger = network, logger
        self.errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> ParserError:
        return self.errors[index]

    def parse_from_file(self, model: str) -> bool:
        import onnx

        try:
            m = onnx.load(model)  # with its external weights, found beside the file
        except Exception as e:  # noqa: BLE001  TensorRT reports, it does not raise
            self.errors.append(ParserError(f"Failed to parse ONNX model from file: {model}: {e}"))
            return False
        opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
        if not MIN_OPSET <= opset <= MAX_OPSET:
            self.errors.append(ParserError(f"This version of TensorRT only supports opsets {MIN_OPSET} to "
                                           f"{MAX_OPSET}, the model has opset {opset}"))
        for n in m.graph.node:
            if n.domain not in ("", "ai.onnx"):
                self.errors.append(ParserError(f"No importer registered for op: {n.op_type}. Attempting to "
                                               "import as plugin. Plugin not found.", n.name))
        if not self.errors:  # onnx-tensorrt's operator table: which input types each op takes, per version
            from export.trt_compat import node_problems

            self.errors += [ParserError(f"Unsupported: {p}") for p in node_problems(m, __version__)]
        if not self.errors:  # QuantDequantLinearHelper's asserts: symmetric, positive scales, blocks, INT4 weight-only
            from export.trt_compat import qdq_problems

            self.errors += [ParserError(f"Assertion failed: {p}") for p in qdq_problems(m)[2]]
        if self.errors:
            for e in self.errors:
                self.logger.log(Logger.ERROR, str(e))
            return False
        self.network.inputs = [t for t in _tensors(m.graph.input)
                               if t.name not in {i.name for i in m.graph.initializer}]
        self.network.outputs = _tensors(m.graph.output)
        self.network.weight_bytes = sum(len(i.raw_data) for i in m.graph.initializer)
        self.network.quantized = _quantized_types(m)
        self.network.model_bytes = m.SerializeToString()  # the engine carries its weights, as a plan does
        return True


# ----------------------------------------------------------------------------- builder


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        self.valid = True

    def set_shape(self, input: str, min: Dims, opt: Dims, max: Dims) -> None:
        lo, mid, hi = _dims(min), _dims(opt), _dims(max)
        if not (len(lo) == len(mid) == len(hi)) or any(not a <= b <= c for a, b, c in zip(lo, mid, hi)) \
                or any(a < 0 for a in lo):
            self.valid = False
            LOG.append((Logger.ERROR, f"IOptimizationProfile::setDimensions: Error Code 3: API Usage Error "
                                      f"(min <= opt <= max violated for '{input}': {lo} {mid} {hi})"))
            return
        self.shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str) -> list[Dims]:
        return [Dims(s) for s in self.shapes[input]]

    def __bool__(self) -> bool:
        return self.valid


class ITimingCache:
    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)

    def serialize(self) -> IHostMemory:
        return IHostMemory(self.data or b"fake-timing-cache")


class IBuilderConfig:
    def __init__(self) -> None:
        self.flags: set[_BuilderFlag10] = set()
        self.pools: dict[MemoryPoolType, int] = {}
        self.profiles: list[IOptimizationProfile] = []
        self._level = 3
        self.timing_cache: ITimingCache | None = None

    @property
    def builder_optimization_level(self) -> int:
        return self._level

    @builder_optimization_level.setter
    def builder_optimization_level(self, level: int) -> None:
        if not 0 <= int(level) <= 5:
            raise ValueError(f"builder optimization level must be 0-5, got {level}")
        self._level = int(level)

    def set_flag(self, flag) -> None:
        self.flags.add(_BuilderFlag10(int(flag)))

    def get_flag(self, flag) -> bool:
        return _BuilderFlag10(int(flag)) in self.flags

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        if not isinstance(pool, MemoryPoolType):
            raise TypeError(f"incompatible function arguments: pool must be a MemoryPoolType, got {pool!r}")
        self.pools[pool] = int(pool_size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self.pools.get(pool, _cuda._device().memory_bytes)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        return ITimingCache(bytes(serialized_timing_cache))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache:
        return self.timing_cache or ITimingCache(b"")


def _profile_point_problem(network: INetworkDefinition, profile: IOptimizationProfile) -> tuple[str, str] | None:
    """TensorRT shape-checks the network at each profile's min, opt and max point; the stand-in runs the graph
    there (zeros for ids and positions, ones for masks and float inputs). (which point, why) or None."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(network.model_bytes, so, providers=["CPUExecutionProvider"])
    for k, which in enumerate(("min", "opt", "max")):
        feeds = {}
        for t in network.inputs:
            shape = profile.shapes[t.name][k] if t.name in profile.shapes else t.shape
            dtype = np.dtype(nptype(t.dtype))
            feeds[t.name] = np.ones(shape, dtype) if "mask" in t.name or dtype.kind == "f" else np.zeros(shape, dtype)
        try:
            sess.run(None, feeds)
        except Exception as e:  # noqa: BLE001  onnxruntime's own exception types
            return which, str(e).splitlines()[0][:300]
    return None


class Builder:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(int(flags))

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def _error(self, msg: str) -> None:
        self.logger.log(Logger.ERROR, msg)

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        dev = _cuda._device()
        if network.model_bytes is None:
            self._error("Error Code 4: API Usage Error (Network must have at least one output)")
            return None
        if network.strongly_typed and config.flags & _PRECISION_FLAGS:
            names = ", ".join(f.name for f in sorted(config.flags & _PRECISION_FLAGS))
            self._error(f"Error Code 3: API Usage Error (Parameter check failed, condition: !config.getFlag({names})."
                        " Precision flags are not allowed with a strongly typed network)")
            return None
        major = int(dev.sm.split(".")[0])
        if _BuilderFlag10.BF16 in config.flags and major < 8:
            self._error(f"Error Code 9: API Usage Error (BF16 is not supported on SM {dev.sm})")
            return None
        sm = tuple(int(x) for x in dev.sm.split(".")[:2])
        for qt in sorted(network.quantized):
            if sm < _MIN_SM.get(qt, (0, 0)):
                self._error(f"Error Code 9: Internal Error (no implementation of {qt} quantized GEMMs on SM {dev.sm}: "
                            f"{qt} needs SM >= {'.'.join(map(str, _MIN_SM[qt]))})")
                return None
        dynamic = [t for t in network.inputs if -1 in t.shape]
        if dynamic and not config.profiles:
            self._error("Error Code 4: API Usage Error (Network has dynamic or shape inputs, but no optimization "
                        "profile has been defined.)")
            return None
        for i, p in enumerate(config.profiles):
            for t in network.inputs:
                if t.name not in p.shapes:
                    if -1 in t.shape:
                        self._error(f"Error Code 4: API Usage Error (Optimization profile {i}: dynamic input "
                                    f"'{t.name}' has no shape)")
                        return None
                    continue
                for which, s in zip(("min", "opt", "max"), p.shapes[t.name]):
                    if len(s) != len(t.shape) or any(d != -1 and d != v for d, v in zip(t.shape, s)):
                        self._error(f"Error Code 4: API Usage Error ('{t.name}': optimization profile {i} {which} "
                                    f"{s} does not match the network's dimensions {t.shape})")
                        return None
            extra = set(p.shapes) - {t.name for t in network.inputs}
            if extra:
                self._error(f"Error Code 3: API Usage Error (profile {i} names tensors the network lacks: {sorted(extra)})")
                return None
        for i, p in enumerate(config.profiles):
            if (bad := _profile_point_problem(network, p)) is not None:
                self._error(f"Error Code 4: Internal Error (k{bad[0].upper()} values for profile {i} violate shape "
                            f"constraints: {bad[1]})")
                return None
        need = 2 * network.weight_bytes + config.pools.get(MemoryPoolType.WORKSPACE, 0)
        if need > dev.memory_bytes - dev.used:
            self._error(f"Error Code 2: OutOfMemory (Requested size was {need} bytes.)")
            return None
        header = {"tensorrt": __version__, "sm": dev.sm,
                  "version_compatible": _BuilderFlag10.VERSION_COMPATIBLE in config.flags,
                  "strongly_typed": network.strongly_typed,
                  "flags": sorted(f.name for f in config.flags),
                  "inputs": [[t.name, int(t.dtype), list(t.shape), list(t.symbols)] for t in network.inputs],
                  "outputs": [[t.name, int(t.dtype), list(t.shape), list(t.symbols)] for t in network.outputs],
                  "profiles": [{k: [list(x) for x in v] for k, v in p.shapes.items()} for p in config.profiles]}
        h = json.dumps(header).encode()
        return IHostMemory(MAGIC + len(h).to_bytes(8, "little") + h + network.model_bytes)


# ----------------------------------------------------------------------------- runtime


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger
        self.engine_host_code_allowed = False  # TensorRT's default

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> "ICudaEngine | None":
        data = bytes(serialized_engine)
        if not data.startswith(MAGIC):
            self.logger.log(Logger.ERROR, "Error Code 1: Serialization (Serialization assertion "
                                          "magicTagRead == kMAGIC_TAG failed.Magic tag does not match)")
            return None
        n = int.from_bytes(data[8:16], "little")
        header = json.loads(data[16:16 + n])
        built, here = header["tensorrt"], __version__
        b, h = [tuple(int(x) for x in v.split(".")[:3]) for v in (built, here)]
        if header["version_compatible"]:
            ok = b[0] == h[0] and h >= b
        else:
            ok = b == h
        if not ok:
            self.logger.log(Logger.ERROR, "Error Code 1: Serialization (Serialization assertion "
                                          f"stdVersionRead == kSERIALIZATION_VERSION failed.Version tag does not "
                                          f"match. Note: Current Version: {here}, Serialized Engine Version: {built})")
            return None
        if header["version_compatible"] and not self.engine_host_code_allowed:
            self.logger.log(Logger.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization "
                                          "assertion hostCodeAllowed failed. The engine contains host code (a "
                                          "version-compatible plan embeds its lean runtime); set "
                                          "IRuntime::setEngineHostCodeAllowed(true) to deserialize it)")
            return None
        dev = _cuda._device()
        if header["sm"] != dev.sm:
            want, got = header["sm"].replace(".", ""), dev.sm.replace(".", "")
            self.logger.log(Logger.ERROR, "Error Code 1: Serialization (Serialization assertion "
                                          "sizeRead == static_cast<uint64_t>(mEnd - mCurrent) failed. The engine plan "
                                          f"file is generated on an incompatible device, expecting compute {got} got "
                                          f"compute {want}, please rebuild.)")
            return None
        return (ICudaEngine11 if _major() >= 11 else ICudaEngine10)(header, data[16 + n:], self.logger)


def _eval_dim(expr: str, env: dict[str, int]) -> int:
    """'past_sequence_length + sequence_length' with the symbols bound from the input shapes; -1 if unknown."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise KeyError(expr)

    try:
        return int(ev(ast.parse(expr, mode="eval")))
    except (KeyError, SyntaxError):
        return -1


class ICudaEngine:
    def __init__(self, header: dict, model_bytes: bytes, logger: Logger) -> None:
        import onnxruntime as ort

        self.header, self.logger = header, logger
        self.tensors = {name: (TensorIOMode.INPUT, DataType(dt), tuple(shape), tuple(sym))
                        for name, dt, shape, sym in header["inputs"]}
        self.tensors |= {name: (TensorIOMode.OUTPUT, DataType(dt), tuple(shape), tuple(sym))
                         for name, dt, shape, sym in header["outputs"]}
        self.order = [t[0] for t in header["inputs"]] + [t[0] for t in header["outputs"]]
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_quant_qdq", "1")  # Q/DQ as written: TensorRT's arithmetic
        self.session = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        self.profiles_taken: set[int] = set()

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.header["profiles"])

    @property
    def num_io_tensors(self) -> int:
        return len(self.order)

    def get_tensor_name(self, index: int) -> str:
        return self.order[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self.tensors[name][0] if name in self.tensors else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return self.tensors[name][1]

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(self.tensors[name][2])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        return [Dims(s) for s in self.header["profiles"][profile_index][name]]

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        """Activation memory a context needs for one profile: a stand-in formula (a quarter of the largest
        outputs at the profile's max shapes, plus 1 MiB), deterministic so tests can count it."""
        prof = self.header["profiles"][profile_index]
        env: dict[str, int] = {}
        for name, (mode, _, shape, sym) in self.tensors.items():
            if mode == TensorIOMode.INPUT and name in prof:
                for d, p in zip(prof[name][2], sym):
                    if p and p.isidentifier():
                        env[p] = d
        total = 0
        for name, (mode, dt, shape, sym) in self.tensors.items():
            if mode == TensorIOMode.OUTPUT:
                dims = [d if d != -1 else max(_eval_dim(p, env), 1) for d, p in zip(shape, sym)]
                total += int(np.prod(dims)) * np.dtype(nptype(dt)).itemsize
        return total // 4 + (1 << 20)

    @property
    def device_memory_size_v2(self) -> int:
        return max(self.get_device_memory_size_for_profile_v2(i) for i in range(self.num_optimization_profiles))

    def create_execution_context(self, strategy: ExecutionContextAllocationStrategy =
                                 ExecutionContextAllocationStrategy.STATIC) -> "IExecutionContext | None":
        ctx = IExecutionContext(self, ExecutionContextAllocationStrategy(int(strategy)))
        return ctx if ctx.ok else None


class ICudaEngine10(ICudaEngine):
    """TensorRT 10's V1 device-memory calls (deprecated in 10, removed in 11)."""

    @property
    def device_memory_size(self) -> int:
        return self.device_memory_size_v2

    def get_device_memory_size_for_profile(self, profile_index: int) -> int:
        return self.get_device_memory_size_for_profile_v2(profile_index)

    def create_execution_context_without_device_memory(self) -> "IExecutionContext | None":
        return self.create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED)


class ICudaEngine11(ICudaEngine):
    pass


class IExecutionContext:
    def __init__(self, engine: ICudaEngine,
                 strategy: ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy.STATIC) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.strategy = strategy
        self.memory: tuple[int, int] | None = None  # (address, size) of its activation memory
        self._own: int | None = None
        self.ok = True
        if strategy != ExecutionContextAllocationStrategy.USER_MANAGED:  # TensorRT allocates it now
            dev = _cuda._device()
            dev.runtime_context()
            err, ptr = dev.malloc(engine.device_memory_size_v2)
            if err:
                engine.logger.log(Logger.ERROR, "Error Code 2: OutOfMemory (Requested size was "
                                                f"{engine.device_memory_size_v2} bytes.)")
                self.ok = False
                return
            self._own = ptr
            self.memory = (ptr, engine.device_memory_size_v2)
        free = [i for i in range(engine.num_optimization_profiles) if i not in engine.profiles_taken]
        self.profile = free[0] if free else 0
        engine.profiles_taken.add(self.profile)

    def __del__(self) -> None:
        if self._own is not None and _cuda.DEVICE is not None:
            _cuda.DEVICE.free(self._own)

    def set_device_memory(self, memory: int, size: int) -> None:
        need = self.engine.device_memory_size_v2
        if int(size) < need:
            raise RuntimeError(f"IExecutionContext::setDeviceMemoryV2: Error Code 3: API Usage Error (Parameter check "
                               f"failed, condition: size >= mEngine.getDeviceMemorySizeV2(). {size} < {need})")
        self.memory = (int(memory), int(size))

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return self.engine.get_device_memory_size_for_profile_v2(profile_index)

    def _error(self, msg: str) -> bool:
        self.engine.logger.log(Logger.ERROR, msg)
        return False

    @property
    def active_optimization_profile(self) -> int:
        return self.profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        e = self.engine
        if not 0 <= profile_index < e.num_optimization_profiles:
            return self._error(f"Error Code 3: API Usage Error (profileIndex {profile_index} out of range)")
        if _cuda._device().stream_error(stream_handle) is None:
            return self._error("Error Code 1: Cuda Runtime (invalid resource handle)")
        if profile_index != self.profile and profile_index in e.profiles_taken:
            return self._error(f"Error Code 3: API Usage Error (profile {profile_index} is used by another context)")
        e.profiles_taken.discard(self.profile)
        e.profiles_taken.add(profile_index)
        self.profile = profile_index
        self.shapes.clear()
        return True

    def set_input_shape(self, name: str, shape: Dims) -> bool:
        e = self.engine
        s = _dims(shape)
        if e.get_tensor_mode(name) != TensorIOMode.INPUT:
            return self._error(f"Error Code 3: API Usage Error ('{name}' is not an input tensor)")
        lo, _, hi = e.header["profiles"][self.profile][name]
        if len(s) != len(lo) or any(not a <= v <= b for a, v, b in zip(lo, s, hi)):
            return self._error(f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter check "
                               f"failed, condition: satisfyProfile. Set dimension {list(s)} for tensor {name} does "
                               f"not satisfy any optimization profiles. Valid range for profile {self.profile}: "
                               f"{lo}..{hi}.)")
        self.shapes[name] = s
        return True

    def _env(self) -> dict[str, int]:
        env = {}
        for name, (mode, _, shape, sym) in self.engine.tensors.items():
            if mode == TensorIOMode.INPUT and name in self.shapes:
                for d, p in zip(self.shapes[name], sym):
                    if p and p.isidentifier():
                        env[p] = d
        return env

    def get_tensor_shape(self, name: str) -> Dims:
        mode, _, shape, sym = self.engine.tensors[name]
        if mode == TensorIOMode.INPUT:
            return Dims(self.shapes.get(name, shape))
        env = self._env()
        return Dims(d if d != -1 else _eval_dim(p, env) for d, p in zip(shape, sym))

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE:
            return self._error(f"Error Code 3: API Usage Error (Parameter check failed, condition: "
                               f"tensor '{name}' is not an input or output of the engine)")
        self.addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        e = self.engine
        dev = _cuda._device()
        ctx = dev.runtime_context()  # TensorRT enqueues in the calling thread's context (the primary if none)
        if dev.stream_error(stream_handle) is None or dev.stream_ctx[int(stream_handle)] != ctx:
            return self._error("Error Code 1: Cuda Runtime (invalid resource handle)")
        if self.memory is None:
            return self._error("IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Parameter check failed, "
                               "condition: mContext.getDeviceMemory() != nullptr. The execution context was created "
                               "with USER_MANAGED device memory and none was set: call set_device_memory first)")
        if dev.view(self.memory[0], self.memory[1], ctx) is None:
            dev.fault(stream_handle)  # activation memory that is not (or no longer) a live allocation here
            return True
        for name, (mode, _, _, _) in e.tensors.items():
            if mode == TensorIOMode.INPUT and name not in self.shapes:
                return self._error("IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Parameter check "
                                   f"failed, condition: mContext.profileObliviousBindings.at(profileObliviousIndex) "
                                   f"|| getPtrOrNull(mOutputAllocators, profileObliviousIndex). Neither address or "
                                   f"allocator is set for input shape of tensor {name})")
            if name not in self.addresses:
                kind = "input" if mode == TensorIOMode.INPUT else "output"
                return self._error(f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Parameter check "
                                   f"failed, condition: mContext.profileObliviousBindings.at(profileObliviousIndex) "
                                   f"|| getPtrOrNull(mOutputAllocators, profileObliviousIndex). Address is not set "
                                   f"for {kind} tensor {name}. Call setInputTensorAddress or setTensorAddress "
                                   "before enqueue/execute.)")
        shapes = {name: tuple(self.get_tensor_shape(name)) for name in e.tensors}
        addresses = dict(self.addresses)
        dev.enqueue(stream_handle, lambda: self._compute(dev, stream_handle, ctx, shapes, addresses))
        return True

    def _compute(self, dev, stream_handle: int, ctx: int, shapes: dict, addresses: dict) -> None:
        """The kernels, run when the stream is synchronized, over the buffers as they are then."""
        e = self.engine
        feeds = {}
        views = {}
        for name, (mode, dt, _, _) in e.tensors.items():
            shape = shapes[name]
            dtype = np.dtype(nptype(dt))
            nbytes = int(np.prod(shape)) * dtype.itemsize
            view = dev.view(addresses[name], nbytes, ctx) if nbytes else np.zeros(0, np.uint8)
            if view is None:  # the kernel would read or write past the buffer, or another context's: a fault
                dev.fault(stream_handle)
                return
            views[name] = (view, shape, dtype)
            if mode == TensorIOMode.INPUT:
                feeds[name] = view.view(dtype).reshape(shape).copy()
        outs = e.session.run([n for n, t in e.tensors.items() if t[0] == TensorIOMode.OUTPUT], feeds)
        for (name, (mode, _, _, _)), out in zip([(n, t) for n, t in e.tensors.items() if t[0] == TensorIOMode.OUTPUT],
                                                outs):
            view, shape, dtype = views[name]
            if out.shape != shape:
                raise AssertionError(f"stand-in: output {name} has shape {out.shape}, inferred {shape}")
            view[:] = np.ascontiguousarray(out, dtype=dtype).view(np.uint8).reshape(-1)


def installed_modules() -> dict:
    """sys.modules entries the fixture installs: this module as `tensorrt`, the CUDA stand-in as cuda-python."""
    return {"tensorrt": sys.modules[__name__], "cuda.bindings.runtime": _cuda.runtime,
            "cuda.bindings.driver": _cuda.driver}


def play(version: str) -> None:
    """Play TensorRT `version` (the fixture does this; tests may switch to load a plan elsewhere)."""
    global __version__
    __version__ = version


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "ast", "enum", "json", "np", "re",
                                                                    "sys")] + ["BuilderFlag", "NetworkDefinitionCreationFlag"]
