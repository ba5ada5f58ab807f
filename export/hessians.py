"""GPTQ's input statistics: H = X^T X of every weight MatMul's input on calibration text, what export/gptq.py
rounds with.

The inputs X come from the plain fp32 graph run on calibration chats and training prose (never the held-out
texts): `Hessians` adds every weight MatMul's input to the graph's outputs and collects in passes of at most
ONE_PASS_BYTES of matrices; `LayerHessians` runs the Hugging Face model one decoder block at a time (one forward
pass for any size), and `StreamedLayerHessians` does the same with each block's weights read from the checkpoint
(the streaming build). export/gptq_statistics.py keeps them on disk for a build's other engines.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from export.onnx_weights import GraphWeights, untie_lm_head, weight_matmuls

ONE_PASS_BYTES = 2 << 30  # statistics up to this size come from one pass of the graph; beyond, block by block


def _input_widths(gw: GraphWeights) -> dict[str, int]:
    """K of each distinct weight-MatMul input (its statistics are K x K), in graph order."""
    return {n.input[0]: gw.shape(n.input[1])[0] for n in weight_matmuls(gw.model)}


def _add_xtx(acc: dict[str, np.ndarray], x: str, a: np.ndarray) -> None:
    """acc[x] += a^T a for one text's rows a: in fp32 (2x faster), the sum over texts in fp64 (no K x K fp64
    temporary)."""
    xtx = a.T @ a
    if x in acc:
        np.add(acc[x], xtx, out=acc[x])
    else:
        acc[x] = xtx.astype(np.float64)


def _finish(acc: dict[str, np.ndarray], rows: int, input_of: dict[str, str]) -> dict[str, np.ndarray]:
    """The sums divided by the token count, in place (a pass holds its matrices once), checked finite."""
    for x, h in acc.items():
        h /= rows
        if not np.isfinite(h).all():
            users = [n for n, i in input_of.items() if i == x]
            raise ValueError(f"GPTQ: the fp32 model's input to {', '.join(users)} ({x}) is not finite on the "
                             "calibration text (NaN or inf): GPTQ cannot use it; set int8_rounding / "
                             "int4_rounding = 'minmax' (--int8-rounding / --int4-rounding minmax)")
    return acc


class Hessians:
    """H = X^T X / rows (float64) of each weight MatMul's input on `feeds`, by plain-graph MatMul name.

    Every weight MatMul's input becomes a graph output of one session over the plain fp32 graph. The
    matrices are K x K per distinct input: for a 135M model all of them fit at once (~0.8 GB); for larger
    ones they are collected in passes over the calibration text, `max_bytes` at a time, in graph order
    (the order the quantizer asks for them), so memory stays bounded whatever the model."""

    method = "graph (onnxruntime)"  # recorded in the quantize stage's metrics

    def __init__(self, plain: Path, work: Path, feeds: list[dict], max_bytes: int | None = None,
                 threads: int | None = None) -> None:
        import onnx

        if not feeds or not sum(int(np.prod(f["input_ids"].shape)) for f in feeds):
            raise ValueError("GPTQ needs calibration text: no tokens were given")
        gw = GraphWeights(plain)
        untie_lm_head(gw)
        self.path = work / "hessian.onnx"
        try:  # a failure here leaves no graph behind (the caller never gets an object to close)
            gw.save(self.path)
            model = onnx.load(str(self.path), load_external_data=False)
            self.input_of = {n.name: n.input[0] for n in weight_matmuls(model)}
            self.width = _input_widths(gw)
            self.order = list(self.width)
            known = {o.name for o in model.graph.output}
            for x in self.order:
                if x not in known:
                    model.graph.output.append(onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None))
            onnx.save_model(model, str(self.path))
        except BaseException:
            self.close()
            raise
        self.feeds, self.threads, self.max_bytes = feeds, threads, ONE_PASS_BYTES if max_bytes is None else max_bytes
        self.rows = sum(int(np.prod(f["input_ids"].shape)) for f in feeds)
        self.loaded: dict[str, np.ndarray] = {}
        self.passes = 0

    def __enter__(self) -> "Hessians":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, node: str) -> np.ndarray:
        x = self.input_of[node]
        if x not in self.loaded:
            self._collect(self.order.index(x))
        return self.loaded[x]

    def _collect(self, start: int) -> None:
        import onnxruntime as ort

        names, size = [], 0
        for x in self.order[start:]:
            size += self.width[x] ** 2 * 8
            if names and size > self.max_bytes:
                break
            names.append(x)
        self.loaded = {}  # drop the last pass's matrices before this one's
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = self.threads
        sess = ort.InferenceSession(str(self.path), so, providers=["CPUExecutionProvider"])
        acc: dict[str, np.ndarray] = {}
        for f in tqdm(self.feeds, desc=f"GPTQ statistics, pass {self.passes + 1}", unit="text", leave=False):
            for x, a in zip(names, sess.run(names, f)):
                _add_xtx(acc, x, a.reshape(-1, a.shape[-1]).astype(np.float32, copy=False))
        del sess
        self.loaded = _finish(acc, self.rows, self.input_of)
        self.passes += 1

    def close(self) -> None:
        self.loaded = {}
        for p in (self.path, self.path.with_name(self.path.name + ".data")):
            p.unlink(missing_ok=True)



def statistics_bytes(plain: Path) -> int:
    """Bytes of every weight MatMul's input statistics at once (K x K float64 per distinct input)."""
    gw = GraphWeights(plain)
    untie_lm_head(gw)
    return sum(k * k * 8 for k in _input_widths(gw).values())


class _Captured(Exception):
    """Raised by the hook that records the first block's inputs: the rest of the forward pass is not needed."""


class LayerHessians:
    """The same statistics as `Hessians`, from the Hugging Face model one decoder block at a time.

    `Hessians` collects a pass of the whole graph per `max_bytes` of matrices: fine for a 135M model (one
    pass), ~33 passes for Llama-3-8B (65 GB of matrices). Here the calibration texts' hidden states are kept
    between blocks (texts x tokens x hidden floats: 0.8 GB for an 8B model on 96 x 512 tokens) and each block
    runs once, as GPTQ's own implementation does: one forward pass in all, one block's matrices in memory.
    The inputs are the fp32 model's (not the quantized blocks' outputs), as in `Hessians`. Keyed by the plain
    graph's MatMul names, mapped to modules by the exporter's naming ('/model/layers.3/mlp/up_proj/MatMul' ->
    'model.layers.3.mlp.up_proj'); a graph whose names do not map raises ValueError (use `Hessians`)."""

    method = "by block (torch)"

    def __init__(self, hf_dir: Path, plain: Path, feeds: list[dict], threads: int | None = None) -> None:
        self._start(feeds, threads)
        gw = GraphWeights(plain)
        untie_lm_head(gw)
        nodes = weight_matmuls(gw.model)
        self.input_of = {n.name: n.input[0] for n in nodes}
        self.hf_dir = hf_dir
        with self._threads():
            self._load()
            import torch

            modules = dict(self.model.named_modules())
            self.module_of: dict[str, str] = {}
            for n in nodes:
                name = n.name.strip("/").removesuffix("/MatMul").replace("/", ".")
                if not isinstance(modules.get(name), torch.nn.Linear):
                    raise ValueError(f"the plain graph's MatMul {n.name} maps to no Linear module ({name})")
                self.module_of[n.name] = name
            self.step_of = {node: self._step(m) for node, m in self.module_of.items()}
            # every block is called with the first one's arguments: blocks that differ (sliding-window layers
            # get their own attention mask) cannot be run that way
            if len({getattr(layer, "attention_type", None) for layer in self.layers}) > 1:
                raise ValueError("the decoder blocks differ in attention type (each gets its own mask)")
            self._capture()  # fail here, where the caller can fall back, not halfway through the stage
            with torch.no_grad():
                out = self.layers[0](self._hidden[0], *self._args[0][0], **self._args[0][1])
            if not isinstance(out, tuple | torch.Tensor):
                raise ValueError(f"a decoder block returned {type(out).__name__}, not its hidden states")

    def _start(self, feeds: list[dict], threads: int | None) -> None:
        """The state both kinds begin with: the calibration texts, no block run yet, nothing loaded."""
        if not feeds or not sum(int(np.prod(f["input_ids"].shape)) for f in feeds):
            raise ValueError("GPTQ needs calibration text: no tokens were given")
        self.feeds, self.threads = feeds, threads or os.cpu_count() or 1
        self.rows = sum(int(np.prod(f["input_ids"].shape)) for f in feeds)
        self.loaded: dict[str, np.ndarray] = {}
        self.passes, self._at, self._loaded_step, self._hidden, self._args = 0, None, None, [], []
        self.model, self._bar = None, None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()
        inner = getattr(self.model, "model", None)
        self.layers = getattr(inner, "layers", None)
        if self.layers is None or not hasattr(inner, "norm"):
            raise ValueError(f"{type(self.model).__name__} keeps no model.layers and model.norm")

    @contextlib.contextmanager
    def _threads(self):
        """torch's thread count for this work only (a distill stage before may have left it at its own)."""
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _step(self, module: str) -> int:
        """Which block computes a module's input: i for model.layers.i, len(layers) for the LM head."""
        parts = module.split(".")
        if parts[:2] == ["model", "layers"] and parts[2].isdigit():
            return int(parts[2])
        if module == "lm_head":
            return len(self.layers)
        raise ValueError(f"GPTQ statistics by block: {module} is in no decoder block")

    def __enter__(self) -> "LayerHessians":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, node: str) -> np.ndarray:
        x, step = self.input_of[node], self.step_of[node]
        if step != self._loaded_step:
            with self._threads():
                if self._at is None or step < self._at:  # asked out of order: start the pass again
                    self._capture()
                while self._at < step:
                    self._run_block(collect=False)
                self._run_block(collect=True)
            if self._at > len(self.layers):  # past the LM head: free the fp32 model until it is asked again
                self.model, self.layers, self._hidden, self._args, self._at = None, None, [], [], None
                self._bar.close()
                self._bar = None
        return self.loaded[x]

    def _capture(self) -> None:
        """The first block's inputs for every text: hidden states and the other arguments it is called with."""
        import torch

        if self.model is None:
            self._load()
        self._hidden, self._args, self.loaded, self._loaded_step = [], [], {}, None

        def hook(mod, args, kwargs):
            self._hidden.append(args[0] if args else kwargs["hidden_states"])
            self._args.append((args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"}))
            raise _Captured

        handle = self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                for f in self.feeds:
                    try:
                        self.model(input_ids=torch.from_numpy(f["input_ids"]),
                                   position_ids=torch.from_numpy(f["position_ids"]) if "position_ids" in f else None,
                                   use_cache=False)
                    except _Captured:
                        pass
        finally:
            handle.remove()
        if len(self._hidden) != len(self.feeds):
            raise ValueError("GPTQ statistics by block: the model never called its first decoder block")
        self._at, self.passes = 0, self.passes + 1
        if self._bar is not None:
            self._bar.close()
        self._bar = tqdm(total=len(self.layers) + 1, desc=f"GPTQ statistics, pass {self.passes}", unit="block",
                         leave=False)

    def _run_block(self, collect: bool) -> None:
        """Run block `_at` on every text (its outputs become the next block's inputs; past the last block, the
        LM head's input); with `collect`, X^T X / rows of each distinct input of its weight MatMuls."""
        import torch

        modules = dict(self.model.named_modules())
        wanted: dict[str, str] = {}  # input name -> one module that reads it (q, k and v read the same)
        for node, step in self.step_of.items():
            if collect and step == self._at:
                wanted.setdefault(self.input_of[node], self.module_of[node])
        acc: dict[str, np.ndarray] = {}

        def adder(x: str):
            def hook(mod, args):
                self._add(acc, x, args[0].reshape(-1, args[0].shape[-1]).float().numpy())
            return hook

        handles = [modules[m].register_forward_pre_hook(adder(x)) for x, m in wanted.items()]
        try:
            with torch.no_grad():
                for i, (h, (args, kw)) in enumerate(zip(self._hidden, self._args)):
                    if self._at < len(self.layers):
                        out = self.layers[self._at](h, *args, **kw)
                        self._hidden[i] = out[0] if isinstance(out, tuple) else out
                    elif wanted:
                        self.model.lm_head(self.model.model.norm(h))
        finally:
            for handle in handles:
                handle.remove()
        if collect:
            self.loaded, self._loaded_step = self._done(acc), self._at
        self._at += 1
        if self._bar is not None:
            self._bar.update()

    def _add(self, acc: dict[str, np.ndarray], x: str, a: np.ndarray) -> None:
        """One text's rows `a` of input `x` into the block's sums (a subclass collects other statistics)."""
        _add_xtx(acc, x, a)

    def _done(self, acc: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _finish(acc, self.rows, self.input_of)

    def close(self) -> None:
        self.loaded, self._hidden, self._args = {}, [], []
        self.model = self.layers = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

def linear_modules(model, nodes) -> dict[str, str]:
    """Each weight MatMul name of a streamed graph -> the Linear module it computes, in either graph: the plain
    graph's ('/model/layers.3/mlp/up_proj/MatMul' -> 'model.layers.3.mlp.up_proj') or the fused graph's packed
    projections (its qkv_proj / gate_up_proj -> the first Linear of the pack, whose input it reads)."""
    import torch

    from export.sensitivity import target_name

    by_graph_name: dict[str, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            plain = "/" + re.sub(r"\.(?!\d)", "/", name) + "/MatMul"
            by_graph_name.setdefault(target_name(plain, True), name)
            by_graph_name.setdefault(plain, name)
    missing = [n for n in nodes if n not in by_graph_name]
    if missing:
        raise ValueError(f"the graph's MatMul {missing[0]} maps to no Linear module of the model")
    return {n: by_graph_name[n] for n in nodes}


class StreamedLayerHessians(LayerHessians):
    """`LayerHessians` with no model loaded: the module tree built without weights (export/weight_source.py
    `empty_model`), each decoder block's weights read from the checkpoint (a `WeightSource`) when it runs and
    dropped after, as the streaming build's reference does (export/stream_reference.py). Memory: one block's
    weights and matrices and the calibration texts' hidden states, whatever the model's size. Keyed by the
    streamed graph's own MatMul names (`input_of`: fused names such as '/model/layers.3/mlp/gate_up_proj/MatMul',
    mapped to the first Linear reading that input, 'model.layers.3.mlp.gate_proj'); the LM head's input is
    the final norm's output, taken without computing logits."""

    method = "by block (torch, each block's weights read from the checkpoint)"

    def __init__(self, source, input_of: dict[str, str], feeds: list[dict], threads: int | None = None) -> None:
        self._start(feeds, threads)
        self.source, self.input_of = source, dict(input_of)
        with self._threads():
            self._load()
            self.module_of = linear_modules(self.model, self.input_of)
            self.step_of = {node: self._step(m) for node, m in self.module_of.items()}
            if len({getattr(layer, "attention_type", None) for layer in self.layers}) > 1:
                raise ValueError("the decoder blocks differ in attention type (each gets its own mask)")
            self._capture()  # fail here, before the stage writes anything

    def _load(self) -> None:
        from export.weight_source import empty_model

        self.model = empty_model(self.source.config)
        inner = getattr(self.model, "model", None)
        self.layers = getattr(inner, "layers", None)
        if self.layers is None or not hasattr(inner, "norm"):
            raise ValueError(f"{type(self.model).__name__} keeps no model.layers and model.norm")

    def _capture(self) -> None:
        from export.stream_reference import _materialize

        if self.model is None:
            self._load()
        embed = self.model.model.embed_tokens
        _materialize(embed, "model.embed_tokens", self.source)
        try:
            super()._capture()
        finally:
            embed.to("meta")

    def _run_block(self, collect: bool) -> None:
        from export.stream_reference import _materialize

        if self._at < len(self.layers):
            i = self._at
            _materialize(self.layers[i], f"model.layers.{i}", self.source)
            try:
                super()._run_block(collect)
            finally:
                self.layers[i].to("meta")
            return
        wanted = {self.input_of[n] for n, step in self.step_of.items() if collect and step == self._at}
        acc: dict[str, np.ndarray] = {}
        if wanted:  # the LM head's input: the final norm's output (the logits are not needed)
            import torch

            norm = self.model.model.norm
            _materialize(norm, "model.norm", self.source)
            with torch.no_grad():
                for h in self._hidden:
                    a = norm(h)
                    a = a.reshape(-1, a.shape[-1]).float().numpy()
                    for x in wanted:
                        self._add(acc, x, a)
            norm.to("meta")
        if collect:
            self.loaded, self._loaded_step = self._done(acc), self._at
        self._at += 1
        if self._bar is not None:
            self._bar.update()
