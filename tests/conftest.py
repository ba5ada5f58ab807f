"""Fixtures: a tiny random-init Llama chat model with a real BPE tokenizer, built in process, offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# verified-bundle stamps (edge.bundle) go to a folder of this run, not the user's cache; removed at exit
if "EDGECHAT_STATE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["EDGECHAT_STATE_DIR"] = tempfile.mkdtemp(prefix="edgechat-state-")
    atexit.register(shutil.rmtree, os.environ["EDGECHAT_STATE_DIR"], ignore_errors=True)
ROOT = Path(__file__).resolve().parent.parent
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "Hello! How are you doing today? I am fine, thanks for asking.",
    "What is the capital of Japan? The capital of Japan is Tokyo.",
    "I like to read books about the ocean, the stars and octopuses.",
    "Naïve café owners serve crème brûlée — 日本語 and emoji 🙂 too.",
    "You are a tiny test model. Tell me a fun fact.",
] * 20


# what a run writes at most under pytest's temporary folder at once (measured 2026-12-07 with `df` every 5 s over
# the README's test command: the large model's build in the slow tier, ~17 GB of graphs, on ~3 GB of others)
DISK_GB = {"slow": 22, "fast": 4}


def pytest_collection_finish(session) -> None:
    """Refuse to start a run the disk cannot hold, naming the folder and what to do: CI once ran out of disk
    in the slow tier's large-model build and reported 120 unrelated errors."""
    import tempfile

    if not session.items or session.config.option.collectonly:
        return
    tier = "slow" if any(i.get_closest_marker("slow") for i in session.items) else "fast"
    where = Path(session.config.option.basetemp or tempfile.gettempdir())
    probe = where if where.exists() else where.parent
    free = shutil.disk_usage(probe).free / 1e9
    if free < DISK_GB[tier]:
        pytest.exit(f"the {tier} tier writes up to {DISK_GB[tier]} GB under {probe} and {free:.1f} GB are free there: free "
                    "some space, give --basetemp a folder on a larger disk"
                    + (", or run the fast tier alone (-m 'not slow')" if tier == "slow" else ""), returncode=3)


MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3",
               "Gemma3ForCausalLM": "gemma3_text"}


def make_tiny_model(dst: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, seed: int = 0, max_pos: int = 512, arch: str = "LlamaForCausalLM",
                    tie: bool = True, chat_template: str | None = CHATML, added_tokens: tuple[str, ...] = (),
                    **config) -> Path:
    """A random-init causal LM of `arch` (a Hugging Face architectures name) with a real BPE tokenizer;
    `config`: extra config.json keys (rope_scaling, sliding_window, ...); `added_tokens`: more added (not
    special) tokens, e.g. a thinking model's <think> and </think>; `chat_template` None: a base model's."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = chat_template
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(MODEL_TYPES[arch], **{
        "vocab_size": tok.get_vocab_size(), "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos, "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "rope_theta": 10000.0, **config})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    fast.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def loaded_plain(d: Path, exporter: str = "optimum", **model) -> dict[str, Path]:
    """A tiny model (`model`: make_tiny_model's options) through the load stage (d/hf) and the plain fp32 export
    (d/plain, by `exporter`): what a TensorRT format's quantize stage starts from."""
    from export import load, onnx_export
    from export.model_source import resolve

    src = make_tiny_model(d / "src", **model)
    (d / "hf").mkdir()
    load.run(resolve(str(src)), d / "hf")
    (d / "plain").mkdir()
    onnx_export.run(d / "hf", d / "plain", onnx_export.ExportOptions(fused=False, greedy_tokens=8, exporter=exporter))
    return {"hf": d / "hf", "fp32": d / "plain"}


@pytest.fixture(scope="session")
def tiny_plain_graph(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model's plain fp32 graph alone (the export stage without the fused graph): folder with model.onnx."""
    from export import onnx_export

    dst = tmp_path_factory.mktemp("plain")
    onnx_export.run(tiny_model_dir, dst, onnx_export.ExportOptions(fused=False, greedy_tokens=8))
    return dst


def embedding_forms(plain: Path, tmp_path: Path) -> dict[str, Path]:
    """The plain fp32 graph with its embedding quantized in both forms (export/embedding.py): "gather-int8"
    (Gather on the INT8 table, Cast, scale: ONNX Runtime's, and the int8-qdq graph's before it took TensorRT's)
    and "dq-gather" (DequantizeLinear, then Gather: TensorRT's)."""
    from export.embedding import quantize_embedding
    from export.onnx_weights import GraphWeights, untie_lm_head

    out = {}
    for name, first in (("gather-int8", False), ("dq-gather", True)):
        gw = GraphWeights(plain / "model.onnx")
        untie_lm_head(gw)
        quantize_embedding(gw, dequantize_first=first)
        (tmp_path / name).mkdir()
        gw.save(tmp_path / name / "model.onnx")
        out[name] = tmp_path / name / "model.onnx"
    return out


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_model_dir):
    from export.recipe import BuildOptions, build

    out = tmp_path_factory.mktemp("bundles") / "tiny.bundle"
    return build(BuildOptions(output=out, model=str(tiny_model_dir), precisions=("fp32", "int8-dynamic", "int8-qdq", "int4-weight"),
                              max_context=256, eval_samples=4, calibration_samples=8, smoothquant_ablation=True),
                 log=lambda s: None)


@pytest.fixture(scope="session")
def tiny_generator(tiny_bundle):
    from edge.bundle import Bundle
    from edge.decode.generate import Generator

    return Generator.from_bundle(Bundle.open(tiny_bundle.root), engine="fp32", threads=1)


@pytest.fixture(scope="session")
def fused_generator(tiny_bundle):
    """The int8-dynamic engine: quantized from the fused (GroupQueryAttention, in-place KV) graph."""
    from edge.bundle import Bundle
    from edge.decode.generate import Generator

    gen = Generator.from_bundle(Bundle.open(tiny_bundle.root), engine="int8-dynamic", threads=1)
    assert gen.decoder.io.fused
    return gen


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """TensorRT 10.3 and an SM 8.7 GPU, as on an Orin, for this test only: the strict stand-ins in
    tests/fake_tensorrt on sys.modules["tensorrt"] and cuda-python's runtime/driver modules."""
    import cuda.bindings

    import fake_tensorrt  # tests/ is on sys.path (conftest's folder)
    from fake_tensorrt import cuda as fcuda

    dev = fcuda.Device(name="Orin (fake)", sm="8.7", memory_bytes=8 << 30)
    monkeypatch.setattr(fcuda, "DEVICE", dev)
    monkeypatch.setattr(fake_tensorrt, "__version__", "10.3.0")
    for name, mod in fake_tensorrt.installed_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(cuda.bindings, "runtime", fcuda.runtime, raising=False)
    monkeypatch.setattr(cuda.bindings, "driver", fcuda.driver, raising=False)
    monkeypatch.setenv("EDGECHAT_CACHE", str(tmp_path / "cache"))
    fake_tensorrt.LOG.clear()
    yield dev
    # device buffers this test left in reference cycles are freed now, on its own device: later, a stale
    # pointer would free an allocation of the next test's device that happens to sit at the same address
    import gc

    gc.collect()


TRT_PROFILE = "orin-nano-8gb"  # what the TensorRT stand-in plays (an SM 8.7 Orin)


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    """A copy of the tiny bundle a test may add engines to."""
    dst = tmp_path / "b.bundle"
    shutil.copytree(tiny_bundle.root, dst)
    return dst


def build_trt(path, precision: str = "fp32", recheck: bool = False, profile: str = TRT_PROFILE, **kw):
    """Build a TensorRT engine into the bundle at `path` on the stand-in (with the golden check when `recheck`)."""
    from edge.backends.tensorrt.builder import build_engine, plan_build
    from edge.bundle import Bundle
    from edge.decode.golden import engine_recheck
    from edge.device.machine import detect

    here = detect()
    bundle = Bundle.open(path)
    plan = plan_build(bundle, profile, precision, tensorrt_version=here.tensorrt, available_gb=8.0, **kw)
    return build_engine(plan, here, recheck=engine_recheck(bundle, plan.source.name) if recheck else None)


def trt_errors() -> list[str]:
    """Every error the stand-in's TensorRT loggers recorded in this test."""
    import fake_tensorrt

    return [m for s, m in fake_tensorrt.LOG if s <= fake_tensorrt.Logger.ERROR]


def assert_batched_steps_equal_alone(dec, prompts: list[list[int]], tokens: list[int], capacity: int, atol: float,
                                     steps: int = 3) -> None:
    """Prefill each prompt into a SharedBatchCache row, decode `steps` batched steps (row i always fed
    tokens[i]), and check every row's logits equal the same row decoded alone."""
    import numpy as np

    from edge.decode.cache import SharedBatchCache

    bc = SharedBatchCache(dec, slots=len(prompts) + 1, capacity=capacity)
    for p in prompts:
        row = bc.new_row(len(p))
        dec.prefill(p, row)
        bc.add(row)
    batched = [bc.step(tokens) for _ in range(steps)]
    for i, p in enumerate(prompts):
        alone = dec.new_cache(capacity=capacity)
        dec.prefill(p, alone)
        for k, step in enumerate(batched):
            np.testing.assert_allclose(step[i], dec.forward(np.array([[tokens[i]]]), alone)[0], atol=atol, rtol=0,
                                       err_msg=f"{dec.name}: row {i}, step {k}")


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`edge-chat serve` as a real subprocess on a free loopback port."""

    def __init__(self, bundle: Path, *args: str, startup_s: float = 120, env: dict | None = None) -> None:
        import time
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", str(bundle), "--port", str(self.port),
                                      "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, env={**os.environ, **(env or {})})
        deadline = time.time() + startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError(f"server did not answer /health within {startup_s} s")

    def stop(self) -> tuple[int, str]:
        """SIGTERM, as a service manager would; returns (exit code, everything it printed)."""
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            return -9, out
        return self.proc.returncode, out


def served(root, *flags: str):
    """A module fixture's body: `edge-chat serve ROOT FLAGS` for the module's tests, then a clean stop (exit 0,
    no traceback)."""
    s = ServerProcess(root, *flags)
    yield s
    code, out = s.stop()
    assert code == 0, out
    assert "EdgeChat: stopped" in out and "Traceback" not in out, out


@pytest.fixture(scope="session")
def long_bundle(tmp_path_factory):
    """fp32 only, 4k context: answers long enough to press Stop in the middle of one."""
    from export.recipe import BuildOptions, build

    # wider than the other tiny model so an answer takes seconds, not the ~1 s 2000 tokens take at 64 wide
    src = make_tiny_model(tmp_path_factory.mktemp("tiny4k") / "tiny-llama-4k", max_pos=4096, layers=4, hidden=256,
                          heads=4, kv_heads=2, intermediate=768)
    out = tmp_path_factory.mktemp("bundles") / "long.bundle"
    bundle = build(BuildOptions(output=out, model=str(src), precisions=("fp32",), max_context=4096, eval_samples=2,
                                calibration_samples=2), log=lambda s: None)
    # a random model samples EOS about once in 400 tokens; this bundle's defaults say to run to max tokens
    bundle.manifest.generation["ignore_eos"] = True
    bundle.update_manifest(bundle.manifest)
    return bundle


def run_matmulnbits(a, q, scales, zero_points, k: int, block: int, bits: int = 4):
    """A @ W through ONNX Runtime's MatMulNBits, W given as block levels [N, k_blocks, block], scales and
    zero points [N, k_blocks] (export.int4's layout, packed here the way the quantizer packs them); zero_points
    None: the graph gives none, so the kernel uses its implicit 2^(bits-1)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.int4 import pack

    n = q.shape[0]
    b, zp = pack(q, np.zeros(q.shape[:2], np.uint8) if zero_points is None else zero_points, bits)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"] + (["Z"] if zero_points is not None else []), ["Y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    rows = a.shape[0]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, n])],
                              [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales.reshape(-1), "S")]
                              + ([numpy_helper.from_array(zp.reshape(-1), "Z")] if zero_points is not None else []))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": np.ascontiguousarray(a, np.float32)})[0]
