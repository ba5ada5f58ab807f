"""Load stage: any model reference -> a Hugging Face folder (fp32 safetensors + tokenizer).

GGUF checkpoints are dequantized by transformers (`gguf_file=`). Offline by
default: HF_HUB_OFFLINE=1 unless the user passes --online.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edge.bundle import ModelDims, TokenizerSpec
from edge.errors import MissingDependencyError, ModelSourceError
from export.architectures import dims_from_hf_config
from export.model_source import ModelRef

META = "edgechat_source.json"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError("transformers", "edge-export", "pip install 'edgechat[export,cpu]'") from None
    return transformers


def check_architecture(ref: ModelRef) -> None:
    """Refuse, before any weight is read, a model whose architecture is not in the table (one line naming it and
    the supported ones), or a GGUF whose architecture transformers cannot read."""
    from export.architectures import arch_from_gguf, arch_spec

    if ref.gguf_file:
        from export.gguf_meta import read_gguf_meta

        meta, shapes = read_gguf_meta(Path(ref.location) / ref.gguf_file)
        arch = str(meta.get("general.architecture"))
        spec = arch_from_gguf(arch)
        instead = f"use the {spec.hf_name} checkpoint's Hugging Face folder (safetensors) instead"
        version = _transformers().__version__
        if not spec.gguf_loads:
            raise ModelSourceError(f"{ref.gguf_file}: transformers {version} cannot read '{arch}' GGUF files; {instead}")
        if arch == "phi3":  # transformers maps neither rope.dimension_count nor the LongRoPE factor tensors
            head = int(meta.get("phi3.embedding_length", 0)) // max(1, int(meta.get("phi3.attention.head_count", 1)))
            rot = int(meta.get("phi3.rope.dimension_count", head))
            if rot != head or "rope_factors_long.weight" in shapes:
                what = f"rotates {rot} of each head's {head} dims" if rot != head else "carries LongRoPE factors"
                raise ModelSourceError(f"{ref.gguf_file}: this phi3 GGUF {what} (Phi-4-mini, Phi-3 128k), which "
                                       f"transformers {version} drops when it reads phi3 GGUF files (it would load "
                                       f"another network); {instead}")
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if arch == "gemma3" and factor != 1.0:  # Gemma 3 4B and up: linear scaling on the global layers
            raise ModelSourceError(f"{ref.gguf_file}: this gemma3 GGUF scales its rotary by {factor:g}, which "
                                   f"transformers {version} drops when it reads gemma3 GGUF files (it would load "
                                   f"another network); {instead}")
        return
    if ref.kind == "hf-folder":
        try:
            cfg = json.loads((Path(ref.location) / "config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelSourceError(f"cannot read {ref.location}/config.json: {e}") from None
        archs = cfg.get("architectures") or []
    elif ref.kind == "hub":  # config.json alone (a few kB) before any weight
        try:
            archs = _transformers().AutoConfig.from_pretrained(ref.location).architectures or []
        except (OSError, ValueError):
            return  # the model load below says what is wrong with the reference
    else:
        return
    if archs:
        arch_spec(archs[0])


def load_hf(ref: ModelRef, online: bool = False, dtype: str = "float32"):
    """(model, tokenizer) for a reference, with weights in `dtype` ("auto": the checkpoint's own)."""
    if not online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tf = _transformers()
    import torch

    check_architecture(ref)

    kw = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}
    try:
        tok = tf.AutoTokenizer.from_pretrained(ref.location, **kw)
        model = tf.AutoModelForCausalLM.from_pretrained(ref.location, dtype=dtype if dtype == "auto" else
                                                        getattr(torch, dtype), **kw)
    except OSError as e:
        hint = " (it looks like a hub id: pass --online to download it)" if ref.kind == "hub" and not online else ""
        raise ModelSourceError(f"cannot load model {ref.location}{hint}: {str(e).splitlines()[0]}") from None
    except ImportError as e:
        raise MissingDependencyError(str(e).split("'")[1] if "'" in str(e) else "gguf", "loading this model",
                                     "pip install 'edgechat[export]'") from None
    model.eval()
    return model, tok


# the end-of-turn tokens llama.cpp stops on besides EOS (its vocabulary loader's end-of-generation list)
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|end_of_text|>")


def eos_ids(model, tok) -> list[int]:
    """EOS ids from the generation config and the tokenizer (some GGUFs disagree; keep all), and each
    end-of-turn token the chat template writes: a GGUF records one EOS (Gemma 3's <eos>), and a template that
    closes turns with another token (<end_of_turn>) would otherwise run past it (llama.cpp stops on both)."""
    ids: list[int] = []
    for src in (getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id, tok.eos_token_id):
        for i in ([src] if isinstance(src, int) else (src or [])):
            if i is not None and i not in ids:
                ids.append(int(i))
    vocab = tok.get_vocab()
    for text in END_OF_TURN:
        if text in (tok.chat_template or "") and text in vocab and vocab[text] not in ids:
            ids.append(int(vocab[text]))
    return ids


def read_chat_template(path: str | Path) -> str:
    """A Jinja chat template file's text (edge-export build --chat-template), checked to parse as the runtime
    renders it (edge.decode.tokenizer's sandbox)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"--chat-template {path}: cannot read it ({e})") from None
    if not text.strip():
        raise ModelSourceError(f"--chat-template {path} is empty: give a Jinja chat template (e.g. a ChatML one)")
    from edge.decode.tokenizer import _template_env

    env, jinja2 = _template_env()
    try:
        env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelSourceError(f"--chat-template {path} does not parse as a Jinja template: line {e.lineno}: "
                               f"{e.message}") from None
    return text


def run(ref: ModelRef, dst: Path, online: bool = False, chat_template: str | None = None) -> dict:
    """Copy the model into a Hugging Face folder in its own dtype (bf16 stays bf16: half the memory and
    disk of fp32; later stages upcast as they need). A GGUF is dequantized by transformers to fp32.
    `chat_template`: the template the bundle records instead of the model's own (a base model has none)."""
    model, tok = load_hf(ref, online, dtype="float32" if ref.gguf_file else "auto")
    if chat_template is not None:
        tok.chat_template = chat_template
    if not tok.chat_template:
        raise ModelSourceError(
            f"{ref.name} has no chat template (a base model?): the build prompts it with chats (calibration, "
            "evaluation, golden prompts), so give it one with --chat-template FILE (a Jinja chat template, e.g. "
            "ChatML), or build its -Instruct/-Chat checkpoint")
    eos = eos_ids(model, tok)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    n = sum(p.numel() for p in model.parameters())
    del model
    metrics: dict = {"num_parameters": n}
    if ref.gguf_file:  # the converted tokenizer must split text as the GGUF's own does
        from export.gguf_tokenizer import check_and_fix

        metrics["tokenizer_check"] = check_and_fix(dst / "tokenizer.json", Path(ref.location) / ref.gguf_file)
    (dst / META).write_text(json.dumps({
        "name": ref.name, "source": f"{ref.kind}:{ref.location}" + (f"/{ref.gguf_file}" if ref.gguf_file else ""),
        "eos_token_ids": eos, "num_parameters": n,
    }, indent=2))
    return metrics


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config and our source record: everything but weights and config."""
    import shutil

    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config.json")) and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)


def model_dims(hf_dir: Path, max_context: int | None = None) -> ModelDims:
    """Dims of the loaded model as the bundle records them (context capped, exact parameter count)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    dims = dims_from_hf_config(cfg)
    src = json.loads((hf_dir / META).read_text())
    ctx = min(max_context, dims.max_context) if max_context else dims.max_context
    return type(dims)(**{**dims.__dict__, "max_context": ctx, "num_parameters": int(src["num_parameters"])})


def tokenizer_spec(hf_dir: Path) -> TokenizerSpec:
    """The tokenizer, chat template and special tokens of the loaded model, as the bundle ships them.

    Every stage that prompts the model (calibration, evaluation, packaging) uses this one spec.
    """
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = tcfg.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text()
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    by_content = {t["content"]: t["id"] for t in tok_json.get("added_tokens", [])}
    cfg = json.loads((hf_dir / "config.json").read_text())
    src = json.loads((hf_dir / META).read_text())

    def tok_str(key: str) -> str | None:
        v = tcfg.get(key)
        return v.get("content") if isinstance(v, dict) else v

    bos, eos = tok_str("bos_token"), tok_str("eos_token")
    return TokenizerSpec(
        file="tokenizer.json", chat_template=template, eos_token_ids=src["eos_token_ids"],
        bos_token_id=by_content.get(bos), pad_token_id=cfg.get("pad_token_id"), bos_token=bos, eos_token=eos,
        add_bos=bool(tcfg.get("add_bos_token")) and by_content.get(bos) is not None,
    )


def chat_tokenizer(hf_dir: Path):
    from edge.decode.tokenizer import ChatTokenizer

    return ChatTokenizer(hf_dir / "tokenizer.json", tokenizer_spec(hf_dir))
