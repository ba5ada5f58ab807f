"""`edge-chat`: the device-side runtime. Needs only edge's own dependencies (no torch)."""

from __future__ import annotations

import argparse
import logging
import sys

from edge.args import Bounded, Parser, guarded
from edge.errors import EdgeChatError
from edge.engine_command import add_engine_flags, build_engine_command


def _verify_mode(args: argparse.Namespace) -> str:
    """--verify: hash every file; --no-verify: sizes only; default: hash what changed since the last verified
    load (edge.bundle's verified stamp), so a corrupt bundle is never loaded and a restart stays fast."""
    if getattr(args, "verify", False) and getattr(args, "no_verify", False):
        raise EdgeChatError("--verify and --no-verify contradict each other: give one")
    return "full" if getattr(args, "verify", False) else "size" if getattr(args, "no_verify", False) else "stamp"


def _gen(args: argparse.Namespace, spin: bool = True):
    from edge.bundle import Bundle
    from edge.decode.cache import can_verify
    from edge.decode.generate import Generator

    draft = _draft_bundle(args)  # before the target loads: a bad --draft fails in a second
    bundle = Bundle.open(args.bundle, verify=_verify_mode(args))
    if bundle.hashed:
        logging.getLogger("edgechat").info("verified %d of %d bundle files by SHA-256 (the others: unchanged since "
                                           "their last verification)", len(bundle.hashed), len(bundle.manifest.files))
    gen = Generator.from_bundle(bundle, engine=args.engine, threads=args.threads, spin=spin)
    gen.tokenizer.allow_special_in_content = getattr(args, "allow_special_in_content", False)
    gen.speculative = getattr(args, "speculative", False)
    log = logging.getLogger("edgechat")
    draft_engine = getattr(args, "draft_engine", None)
    verifies = can_verify(gen.decoder)  # the scheduler's cache for this engine checks drafts (edge.decode.cache)
    engine = getattr(gen.decoder, "engine", None)
    engine_name = engine.name if engine is not None else gen.decoder.name
    # commands without --no-draft (golden re-checks) never draft
    if draft is None and bundle.manifest.draft and not getattr(args, "no_draft", True):
        if verifies:  # the bundle's own draft (edge-export build --draft): on by default
            return _own_draft(gen, bundle, args.threads)
        log.info("the bundle's draft model is not used: engine %s cannot verify drafts here (a fused graph on "
                 "CPU can: int8-dynamic or int4-weight)", engine_name)
    if draft is not None:
        if not verifies:
            raise EdgeChatError(f"--draft: engine {engine_name} cannot verify drafts here (speculative steps "
                                "run on a fused graph on CPU: int8-dynamic or int4-weight); drop --draft")
        # the draft's idle threads sleep: spinning, they would take the cores from the target's call
        dgen = Generator.from_bundle(draft, engine=draft_engine, threads=args.threads, spin=False)
        if draft.root.resolve() == bundle.root.resolve() and dgen.decoder.name == gen.decoder.name:
            raise EdgeChatError(f"--draft: the draft is the target itself ({gen.decoder.name}): it would agree "
                                "always and cost a second step per token; give a smaller model or --draft-engine")
        gen.use_draft(dgen)
        log.info("drafting with %s (%s)", args.draft, gen.draft_name)
    return gen


def _own_draft(gen, bundle, threads: int | None):
    """Draft with the model the bundle ships; one that does not load is a warning, not a failed start (the
    user did not ask for it: the target answers without it)."""
    from edge.decode.generate import Generator

    log = logging.getLogger("edgechat")
    acc = bundle.manifest.draft.get("acceptance", {}).get("acceptance")
    source = "the bundle's own; --no-draft turns it off" + (
        f"; acceptance {acc:.2f} measured at build" if isinstance(acc, (int, float)) else "")
    try:
        dgen = Generator.from_bundle(bundle.draft_bundle(), engine=bundle.manifest.draft["engine"], threads=threads,
                                     spin=False)
        gen.use_draft(dgen, source)
    except EdgeChatError as e:
        log.warning("the bundle's draft model is not used: %s (the model answers without it, only without "
                    "drafting; --no-draft hides this warning)", e)
        return gen
    log.info("drafting with the bundle's draft (%s)", gen.draft_name)
    return gen


def _draft_bundle(args: argparse.Namespace):
    from edge.bundle import Bundle

    if getattr(args, "draft", None) is not None and getattr(args, "no_draft", False):
        raise EdgeChatError("--draft and --no-draft contradict each other: give one")
    if getattr(args, "draft", None) is None:
        if getattr(args, "draft_engine", None) is not None:
            raise EdgeChatError("--draft-engine names an engine of the --draft bundle: give --draft too")
        return None
    try:
        draft = Bundle.open(args.draft, verify=_verify_mode(args))
    except EdgeChatError as e:
        raise EdgeChatError(f"--draft: {e}") from None
    if args.draft_engine is not None:
        try:
            draft.manifest.engine(args.draft_engine)
        except EdgeChatError as e:
            raise EdgeChatError(f"--draft-engine: the draft {e}") from None
    return draft


def _cfg(gen, args: argparse.Namespace):
    return gen.sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed,
                        stop=tuple(args.stop) if args.stop else None)


DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def _show_thinking(args: argparse.Namespace) -> bool:
    """A thinking model's think block is shown on a terminal (dimmed) and hidden when the output is piped (a
    script gets the answer alone); --show-thinking / --hide-thinking decide instead."""
    if getattr(args, "show_thinking", False) and getattr(args, "hide_thinking", False):
        raise EdgeChatError("--show-thinking and --hide-thinking contradict each other: give one")
    if getattr(args, "show_thinking", False) or getattr(args, "hide_thinking", False):
        return bool(getattr(args, "show_thinking", False))
    return sys.stdout.isatty()


def _print_stream(events, show_stats: bool, chat=None, show_thinking: bool = True) -> None:
    """An answer streamed to stdout. With `chat` (edge.decode.chat.Chat) a thinking model's reasoning goes dimmed
    before the answer on a terminal, between <think> tags when piped, or nowhere (`show_thinking` off)."""
    from edge.decode.thinking import Splitter

    tty = sys.stdout.isatty()
    thought = answered = False
    split = None
    for ev in events:
        if chat is not None and split is None:  # the prompt is written once the first event is here
            split = Splitter(chat.gen.tokenizer.thinking, chat.opened)
        reasoning, text = split.push(ev.text) if split is not None else ("", ev.text)
        if ev.finish_reason and split is not None:
            more = split.finish()
            reasoning, text = reasoning + more[0], text + more[1]
        if reasoning and show_thinking:
            opening = "" if thought else ("" if tty else "<think>\n")
            sys.stdout.write(f"{DIM}{reasoning}{PLAIN}" if tty else opening + reasoning)
            thought = True
        if text:
            if thought and not answered:
                sys.stdout.write("\n\n" if tty else "\n</think>\n\n")
            answered = True
            sys.stdout.write(text)
        if reasoning or text:
            sys.stdout.flush()
        if ev.finish_reason:
            if thought and not answered and not tty:
                sys.stdout.write("\n</think>")
            sys.stdout.write("\n")
            if show_stats:
                s = ev.stats
                print(f"[{s['completion_tokens']} tokens, TTFT {s['ttft_s'] * 1000:.0f} ms, "
                      f"{s['decode_tok_s']:.1f} tok/s, finish: {ev.finish_reason}]", file=sys.stderr)


def _chat(gen, args: argparse.Namespace):
    from edge.decode.chat import Chat

    return Chat(gen, system=args.system, reasoning_budget=args.reasoning_budget)


def _run(args: argparse.Namespace) -> int:
    show = _show_thinking(args)
    if args.raw and args.system:
        raise EdgeChatError("--raw continues the prompt as text, without a chat template: a --system prompt has no "
                            "place there; drop one of them")
    gen = _gen(args)
    if args.raw:  # a base model (or any model) continuing text, as /v1/completions does
        ids = gen.tokenizer.encode_text(args.prompt)
        if not ids:
            raise EdgeChatError("the prompt is empty: give some text to continue")
        _print_stream(gen.stream(ids, _cfg(gen, args)), args.stats)
        return 0
    chat = _chat(gen, args)
    _print_stream(chat.ask(args.prompt, _cfg(gen, args)), args.stats, chat, show)
    return 0


class _PipeLines:
    """input() for a stdin that is not a terminal (a pipe, a script). A blocking read() only returns to Python
    when the Ctrl-C signal lands on the main thread; the kernel may hand it to another thread (ONNX Runtime's,
    tokenizers'), and the prompt would then wait for the next line before it noticed. Waiting in short
    select() slices lets the main thread run the SIGINT handler whichever thread took the signal."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.buf = b""

    def read(self, prompt: str) -> str:
        import os
        import select

        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self.buf:
            if not select.select([self.fd], [], [], 0.1)[0]:
                continue  # back in Python: a pending SIGINT raises KeyboardInterrupt here
            chunk = os.read(self.fd, 65536)
            if not chunk:
                if not self.buf:
                    raise EOFError
                line, self.buf = self.buf, b""
                return line.decode("utf-8", "replace")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8", "replace")


def _repl(args: argparse.Namespace) -> int:
    show = _show_thinking(args)
    gen = _gen(args)
    chat = _chat(gen, args)
    cfg = _cfg(gen, args)
    m = gen.bundle.manifest
    print(f"{m.model_name} [{gen.decoder.engine.name}, {gen.decoder.providers[0]}] — /reset clears history, "
          "/quit or Ctrl-D exits; Ctrl-C stops an answer (twice at the prompt: exits)", flush=True)
    interrupted = False  # Ctrl-C at the prompt once: a second one exits
    read_line = input if sys.stdin.isatty() else _PipeLines().read
    import signal

    # Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it started; a shell without
    # job control starts `cmd &` (and CI runners, nohup'ed scripts) with it ignored, and Ctrl-C then did nothing
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            line = read_line("you> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            if interrupted:
                print()
                return 0
            interrupted = True
            print("\n(Ctrl-C again to exit, or type a message)", flush=True)
            continue
        interrupted = False
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            chat = _chat(gen, args)
            continue
        if not line:
            continue
        answer = None
        try:
            sys.stdout.write("bot> ")
            answer = chat.ask(line, cfg)
            _print_stream(answer, args.stats, chat, show)
        except KeyboardInterrupt:  # stop this answer, keep the conversation (with what was said so far)
            if answer is not None:
                answer.close()
            print("\n[stopped]", flush=True)
        except EdgeChatError as e:
            print(f"\nerror: {e}", file=sys.stderr)


def _info(args: argparse.Namespace) -> int:
    from edge.bundle import Bundle
    b = Bundle.open(args.bundle, verify="full" if args.verify else "size")
    m = b.manifest
    d = m.model
    print(f"bundle   {b.root}  (id {m.bundle_id}, schema {m.schema_version}, created {m.created})")
    print(f"model    {m.model_name}: {d.architecture}, {d.num_parameters / 1e6:.1f}M params, {d.num_layers} layers, "
          f"{d.num_heads}/{d.num_kv_heads} heads, context {d.max_context}")
    from edge.decode.thinking import tags_in

    template = m.tokenizer.chat_template
    think = tags_in(template)
    print("chat     " + ("no chat template (a base model): /v1/completions and `edge-chat run --raw` only"
                         if not template.strip() else f"thinking model ({think[0]} ... {think[1]}: reasoning_content)"
                         if think else "chat template"))
    print("engines")
    for e in m.engines:
        fp = e.fingerprint
        q = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e.quality.items() if not isinstance(v, (dict, list)))
        kv = " int8-KV" if m.engine_io(e).get("kv_cache") == "int8" else ""
        print(f"  {e.name:14s} {fp.format}/{fp.precision}/{fp.variant}{kv} opset {fp.opset}  {q}")
    print("stages   " + " -> ".join(f"{s.name} ({s.seconds:.0f}s)" for s in m.stages))
    if m.draft:
        dr, acc = m.draft, m.draft.get("acceptance", {})
        print(f"draft    {dr['path']}/ {dr['engine']}: {dr.get('num_layers', '?')} layers, "
              f"{dr.get('num_parameters', 0) / 1e6:.1f}M params, {dr.get('bytes', 0) / 1e6:.1f} MB; acceptance "
              f"{acc.get('acceptance', float('nan')):.2f} at k={acc.get('k', '?')} against {dr.get('target_engine', '?')} "
              f"(measured at build); edge-chat drafts with it unless --no-draft")
    from edge.backends.choose import decide
    from edge.device.machine import detect

    here = detect()
    gpu = f"{here.gpu_name} (SM {here.gpu_sm})" if here.has_gpu else f"no GPU ({here.gpu_error or 'none found'})"
    jet = f", Jetson {here.module} / L4T {here.l4t} / JetPack {here.jetpack or '?'}" if here.jetson else ""
    print(f"machine  {here.arch}{jet}, {gpu}, TensorRT {here.tensorrt or 'not installed'}, "
          f"onnxruntime {here.onnxruntime or 'not installed'} ({', '.join(here.ort_providers) or '-'})"
          + (f", profile {here.profile}" if here.profile else ""))
    try:
        choice = decide(m, here)
        for line in choice.skipped:
            print(f"  skip   {line}")
        print(f"here     would run {choice.describe()}")
        from edge.backends.determinism import batch_invariance, float_activations

        provider = {"onnxruntime-cpu": "CPUExecutionProvider", "onnxruntime-cuda": "CUDAExecutionProvider",
                    "onnxruntime-tensorrt": "TensorrtExecutionProvider"}.get(choice.backend, "TensorRT")
        for e in m.engines:
            inv = batch_invariance(e.fingerprint.precision, provider,
                                   float_acts=float_activations(m, e.fingerprint.precision))
            print(f"  {e.name:14s} batched answers equal the answer alone here: "
                  f"{'yes' if inv.guaranteed else 'no'} ({inv.why})")
    except EdgeChatError as e:
        print(f"here     cannot run: {e}")
    return 0


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _serve(args: argparse.Namespace) -> int:
    auth = None
    if args.auth:
        user, sep, pw = args.auth.partition(":")
        if not sep or not user or not pw:
            raise EdgeChatError("--auth takes user:password (both non-empty)")
        auth = (user, pw)
    if args.host not in LOOPBACK and auth is None and not args.insecure:
        raise EdgeChatError(f"refusing to listen on {args.host} without --auth: anyone on the network could use "
                            "the model; add --auth user:password, or --insecure if this network is trusted")
    if not 1 <= args.port <= 65535:
        raise EdgeChatError(f"--port must be 1-65535, got {args.port}")
    from edge.serve.app import bind_socket, serve
    from edge.serve.limits import ConnectionLimits

    sock = bind_socket(args.host, args.port)  # before the model loads: a port in use fails in a second, not after
    try:
        gen = _gen(args, spin=False)
        return serve(gen, host=args.host, port=args.port, max_users=args.max_users, max_queue=args.max_queue,
                     auth=auth, ui=not args.no_ui, prompt_cache_mb=args.prompt_cache_mb, sock=sock,
                     request_timeout_s=args.request_timeout, lenient=args.lenient,
                     reasoning_budget=args.reasoning_budget, context_overflow=args.context_overflow,
                     prefill_batch_tokens=args.prefill_batch_tokens,
                     limits=ConnectionLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                             max_connections=args.max_connections))
    finally:
        sock.close()


def _golden(args: argparse.Namespace) -> int:
    """Re-ask the bundle's golden prompts with the backend that would serve here."""
    import json

    from edge.decode.golden import recheck

    gen = _gen(args)
    name = gen.decoder.engine.name if hasattr(gen.decoder, "engine") else None
    res = recheck(gen, gen.bundle.manifest, reference=name)  # this engine's own recorded answers, else fp32's
    res["engine"] = name or "?"
    if args.json:
        print(json.dumps(res))
        return 0
    for row in res["prompts"]:
        mark = "same" if row["same"] else "DIFFERENT"
        print(f"[{mark}] {row['prompt']}\n    here:     {row['answer']}\n    recorded: {row['reference']}")
    print(f"same as recorded: {res['same_as_reference']}, keywords passed: {res['golden_passed']} ({res['engine']})")
    return 0


def _build_engine(args: argparse.Namespace) -> int:
    profile = args.profile
    if profile == "auto":
        from edge.device.machine import detect

        here = detect()
        if not here.profile:
            raise EdgeChatError("cannot tell which device this is"
                                + (f" ({here.profile_error})" if here.profile_error else
                                   " (no /etc/nv_tegra_release and no known GPU)")
                                + ": pass --profile NAME")
        profile = here.profile
    return build_engine_command(args, profile)


def _add_gen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder written by edge-export build")
    p.add_argument("--engine", help="engine name from the manifest (default: fastest for this machine)")
    p.add_argument("--threads", type=Bounded(int, 1), help="intra-op threads (default: the physical cores here)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-new-tokens", type=Bounded(int, 1), help="answer length limit (default: the bundle's)")
    p.add_argument("--temperature", type=Bounded(float, 0), help="0 = greedy (default: the bundle's)")
    p.add_argument("--top-p", type=Bounded(float, 0, 1, above=True))
    p.add_argument("--top-k", type=Bounded(int, 0), help="0 = off")
    p.add_argument("--repetition-penalty", type=Bounded(float, 0.01), help="1: off; at least 0.01 (below, logits overflow)")
    p.add_argument("--seed", type=Bounded(int, 0), help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print tokens, TTFT and tok/s after each answer")
    p.add_argument("--show-thinking", action="store_true",
                   help="a thinking model's think block: print it (dimmed on a terminal, between <think> tags when "
                        "piped); by default it shows on a terminal and is hidden when the output is piped")
    p.add_argument("--hide-thinking", action="store_true", help="print the answer without its think block")
    _add_budget_flag(p)
    _add_speculative_flag(p)
    _add_load_flags(p)


def _add_budget_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reasoning-budget", type=Bounded(int, 0), metavar="TOKENS",
                   help="a thinking model thinks at most this many tokens, then its think block is closed "
                        "(default: no limit; 0: it answers at once)")


def _add_speculative_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", action="store_true",
                   help="prompt-lookup speculative decoding while one answer without a seed is decoding (helps when "
                        "answers repeat their input; see docs/speed.md for what it gains and costs)")
    p.add_argument("--draft", metavar="BUNDLE",
                   help="a smaller model's bundle with the same tokenizer drafts instead of prompt lookup (turns "
                        "--speculative on; int8-dynamic/int4-weight targets on CPU); see docs/speed.md for when it "
                        "pays and why quantized targets can differ from their plain greedy answer")
    p.add_argument("--draft-engine", help="engine of the --draft bundle (default: fastest for this machine)")
    p.add_argument("--no-draft", action="store_true",
                   help="do not draft with the model the bundle ships (edge-export build --draft); by default it "
                        "drafts while one answer without a seed decodes, and stops where drafting does not pay")


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", action="store_true", help="check every file's SHA-256 before loading, even files "
                                                         "verified before")
    p.add_argument("--no-verify", action="store_true",
                   help="check file sizes only (default: SHA-256 of every file not verified since it last changed)")
    p.add_argument("--allow-special-in-content", action="store_true",
                   help="tokenize control tokens typed in a message (e.g. <|im_end|>) as control tokens, as before; "
                        "by default they are ordinary text, so a message cannot forge a turn")


def make_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="edge-chat", description="Chat with an EdgeChat bundle on this device, offline.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="answer one prompt, streamed", description="Answer one prompt, streamed to the terminal.")
    _add_gen_flags(r)
    r.add_argument("prompt")
    r.add_argument("--raw", action="store_true",
                   help="continue the prompt as plain text, without the chat template (a base model's bundle, "
                        "which has none; as /v1/completions)")
    r.set_defaults(func=_run)
    q = sub.add_parser("repl", help="multi-turn chat in the terminal", description="Multi-turn chat; history is kept and trimmed to the context.")
    _add_gen_flags(q)
    q.set_defaults(func=_repl)
    s = sub.add_parser("serve", help="serve the chat page and an OpenAI-compatible API",
                       description="Serve a Gradio chat page at / and an OpenAI-compatible API at /v1 on one port, "
                                   "offline; concurrent users share batched decode steps.")
    s.add_argument("bundle", help="bundle folder written by edge-export build")
    s.add_argument("--engine", help="engine name from the manifest (default: fastest for this machine)")
    s.add_argument("--threads", type=Bounded(int, 1), help="intra-op threads (default: the physical cores here)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=7860)
    s.add_argument("--max-users", type=Bounded(int, 1), default=8, help="answers generated at once (batch rows, default 8)")
    _add_speculative_flag(s)
    s.add_argument("--max-queue", type=Bounded(int, 0), help="requests allowed to wait beyond that (default 4 x max-users); "
                                                  "more get HTTP 429 with Retry-After")
    s.add_argument("--auth", help="user:password for the page; API clients send 'Bearer <password>' (or, "
                                    "Anthropic's, 'x-api-key: <password>')")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without --auth")
    s.add_argument("--no-ui", action="store_true", help="API only, no Gradio page")
    s.add_argument("--prompt-cache-mb", type=Bounded(float, 0), default=None,
                   help="memory for the K/V of recent conversations, so a prompt that starts like one of them (the "
                        "system prompt, the chat so far) prefills only what is new (fused graphs; default 64, 0: off)")
    s.add_argument("--prefill-batch-tokens", type=Bounded(int, 0), metavar="N",
                   help="fused graphs: prompts that arrive together are prefilled in batched calls of at most N "
                        "tokens (rows x the longest prompt, up to its first 64 tokens; 0: all in one call). Default 64: "
                        "ONNX Runtime's CPU kernels cost about the same per token beyond it, and a larger call makes "
                        "every user in it wait for all the others' prompts")
    _add_budget_flag(s)
    s.add_argument("--context-overflow", choices=("shift", "error"), default="shift",
                   help="a chat longer than the context: shift drops its oldest turns (never the system prompt or the "
                        "last turn; the answer says how many) on /v1/chat/completions and /v1/messages; error answers "
                        "400 instead (/v1/completions prompts always do; the page always shifts). Default: shift")
    s.add_argument("--lenient", action="store_true",
                   help="ignore request fields this server does not support (default: a 400 that names them)")
    s.add_argument("--request-timeout", type=Bounded(float, 0, above=True), metavar="SECONDS",
                   help="end a request that has not finished this long after it arrived (its slot is freed; the "
                        "client gets HTTP 504 or an error event); default: no limit")
    s.add_argument("--header-timeout", type=Bounded(float, 0, above=True), default=10.0, metavar="SECONDS",
                   help="close a connection whose request headers are not whole this long after it opened or after "
                        "its last answer (slow clients; default 10)")
    s.add_argument("--body-timeout", type=Bounded(float, 0, above=True), default=30.0, metavar="SECONDS",
                   help="answer 408 to a request whose body is not whole this long after its headers (default 30)")
    s.add_argument("--max-connections", type=Bounded(int, 1), default=128, metavar="N",
                   help="open connections at most; beyond, HTTP 503 (the page holds a few per user; default 128)")
    _add_load_flags(s)
    s.set_defaults(func=_serve)
    e = sub.add_parser("build-engine", help="build a TensorRT engine for this device into the bundle",
                       description="Build a TensorRT engine on this device (Jetson engines must be built on the "
                                   "Jetson) from the bundle's ONNX graph; records its fingerprint and re-asks the "
                                   "golden prompts with it.")
    add_engine_flags(e)
    e.add_argument("--profile", default="auto", help="device profile, or auto (Jetson from /etc/nv_tegra_release "
                                                     "and the device-tree model; T4/L4 from the GPU name)")
    e.set_defaults(func=_build_engine)
    g = sub.add_parser("golden", help="re-ask the golden prompts and compare with the recorded answers")
    g.add_argument("bundle")
    g.add_argument("--engine", help="engine name from the manifest (default: what would run here)")
    g.add_argument("--threads", type=Bounded(int, 1))
    _add_load_flags(g)
    g.add_argument("--json", action="store_true", help="one JSON object on stdout")
    g.set_defaults(func=_golden)
    i = sub.add_parser("info", help="what a bundle holds and what would run here")
    i.add_argument("bundle")
    i.add_argument("--verify", action="store_true", help="check every file's SHA-256")
    i.set_defaults(func=_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    return guarded(args)


if __name__ == "__main__":
    sys.exit(main())
