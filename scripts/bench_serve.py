#!/usr/bin/env python
"""Serving throughput with many users, in one run: total tokens/s and TTFT at 1, 4, 8, 16 concurrent
streaming clients against one `edge-chat serve` process (started here on a free loopback port).

Each client sends --requests chat completions one after another (128 tokens each, EOS ignored so every
answer has the same length; greedy unless --temperature, then seeded per request); different clients ask different questions. TTFT is measured at the
client (request sent -> first content chunk), so queueing and prefill are in it. `--prompt-cache-mb 64,0`
runs one server per size, with and without the prompt cache, in the same run. Prints a table and writes JSON.

`--rounds N` interleaves, per level and round: the server, the raw decoder (the same engine, prompts and threads
without a server: `users` rows prefilled together, then batched greedy steps) and, with `--llama-server GGUF`,
llama.cpp's server; the "server/raw" column is what the serving path costs (issue 46). `--variant NAME=ARGS` adds
our server started with other `edge-chat serve` arguments as one more side in the same rounds (its tok/s per round
as a ratio to the plain server's, and its TTFT).

  .venv/bin/python scripts/bench_serve.py smollm2.bundle --engine int8-dynamic --prompt-cache-mb 64,0
  .venv/bin/python scripts/bench_serve.py smollm2.bundle --engine int8-dynamic --threads 2 --users 1,8,16 \
      --rounds 3 --prompt-cache-mb 0 [--llama-server q8_0.gguf] [--variant together='--prefill-batch-tokens 0']
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of Japan?", "Tell me a fun fact about octopuses.", "How do I make a cup of tea?",
             "Why is the sky blue?", "Write a short poem about the sea.", "What should I see in Kyoto?",
             "Explain what a neural network is.", "Give me three tips for sleeping better."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: str, engine: str | None, max_users: int, threads: int | None,
                 prompt_cache_mb: float | None = None, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "edge.cli", "serve", bundle, "--port", str(port), "--max-users", str(max_users),
           "--max-queue", str(4 * max_users), "--no-ui", *extra]
    cmd += ["--prompt-cache-mb", str(prompt_cache_mb)] if prompt_cache_mb is not None else []
    cmd += ["--engine", engine] if engine else []
    cmd += ["--threads", str(threads)] if threads else []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server exited:\n{proc.stdout.read()}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("server did not start in 120 s")


def one_request(url: str, question: str, max_tokens: int, sampling: dict | None = None, client=None) -> dict:
    """One streamed answer; `client`: the user's httpx.Client (a kept connection, as a chat client keeps one:
    making a client per request put its SSL-context setup, ~10-30 ms, into the TTFT measured here)."""
    import httpx

    if client is None:
        with httpx.Client(timeout=600) as c:
            return one_request(url, question, max_tokens, sampling, c)

    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}} | (sampling or {})
    t0 = time.perf_counter()
    first = second = None
    tokens = cached = chunks = 0
    request = client.build_request("POST", url + "/v1/chat/completions", json=body)
    try:
        r = client.send(request, stream=True)
    except httpx.RemoteProtocolError:  # llama-server may close a kept connection between requests: send it again
        t0 = time.perf_counter()
        r = client.send(request, stream=True)
    try:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                chunks += 1
                now = time.perf_counter()
                second = second or (now if first else None)
                first = first or now
    finally:
        r.close()
    t1 = time.perf_counter()
    return {"ttft_s": (first or t1) - t0, "second_s": (second or t1) - t0, "total_s": t1 - t0,
            "tokens": tokens or chunks, "cached": cached}


def start_llama_server(gguf: str, slots: int, threads: int | None, ctx_per_slot: int = 512,
                       poll: int | None = None) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own server (scripts/peers-setup.sh builds it): `slots` parallel sequences with continuous
    batching, the same threads as ours, on a free loopback port; `poll` 0: its workers sleep instead of spinning."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from peers import LLAMA_BIN

    port = free_port()
    cmd = [str(LLAMA_BIN / "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "-cb", "-t", str(threads or os.cpu_count()), "-tb", str(threads or os.cpu_count())]
    cmd += ["--poll", str(poll)] if poll is not None else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"llama-server exited (code {proc.returncode}): {' '.join(cmd)}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("llama-server did not start in 120 s")


class RawDecoder:
    """The decoder alone on the prompts the server's clients send (same engine and threads, in its own process,
    the session options of scripts/bench_decode.py), measured the way run_level measures the server: `users`
    rows prefilled together, then batched greedy steps until each has `max_tokens`, `requests` times over;
    total tok/s = every token / the whole time, prefills included. What the server adds is the gap between
    this and the server's rate. A process started with the servers (and in turn with them, --fresh-processes)
    that loads the engine once and measures on each `run`; its answers are the stdout lines that start with
    RAW_REPLY, its stderr goes to a file shown if it fails."""

    def __init__(self, bundle: str, engine: str | None, threads: int | None, timeout: float = 1200) -> None:
        import tempfile

        spec = {"bundle": bundle, "engine": engine, "threads": threads}
        self.timeout = timeout
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-raw-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, __file__, bundle, "--_raw", json.dumps(spec)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._reply("ready")

    def _reply(self, what: str):
        """The child's next RAW_REPLY line (other output skipped), or exit with its log's tail."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + self.timeout
        try:
            while time.monotonic() < end:
                if not sel.select(timeout=max(0.0, end - time.monotonic())):
                    break
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(RAW_REPLY):
                    return json.loads(line[len(RAW_REPLY):])
        finally:
            sel.close()
        self.terminate()
        self.wait(30)
        self.log.seek(0)
        sys.exit(f"the raw decoder process gave no {what} in {self.timeout:.0f} s (or ended); its log "
                 f"({self.log.name}) ends:\n{self.log.read()[-3000:]}")

    def run(self, users: int, max_tokens: int, requests: int = 1) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"users": users, "max_tokens": max_tokens, "requests": requests}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it ended: _reply says so, with its log
        return self._reply("measurement")

    def terminate(self) -> None:
        self.proc.terminate()

    def wait(self, timeout: float) -> None:
        self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()


RAW_REPLY = "RAW_REPLY "


def _raw_child(spec: dict) -> None:
    """RawDecoder's process: load, say "ready", then measure one JSON line of {users, max_tokens, requests} each."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from edge.bundle import Bundle
    from edge.decode.cache import batch_cache
    from edge.decode.conversation import prompt
    from edge.decode.generate import Generator

    gen = Generator.from_bundle(Bundle.open(spec["bundle"]), engine=spec["engine"], threads=spec["threads"])
    print(RAW_REPLY + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        n, new = ask["users"], ask["max_tokens"]

        def prompts(k: int) -> list[list[int]]:  # run_level's questions: client i's k-th request
            return [prompt(gen.tokenizer, [{"role": "user", "content": QUESTIONS[(i + k) % len(QUESTIONS)]
                                            + f" (user {i})"}]).ids for i in range(n)]

        def once(ps: list[list[int]]) -> tuple[float, float, float]:
            cache = batch_cache(gen.decoder, n)
            t0 = time.perf_counter()
            toks = cache.prefill_rows(ps).argmax(-1).tolist()  # together, as the server admits users who arrive at once
            first = t1 = time.perf_counter()
            first -= t0  # every row's first token is known after this one call
            for _ in range(new - 1):
                toks = np.asarray(cache.step(toks)).argmax(-1).tolist()
            t2 = time.perf_counter()
            return first, t1 - t0, t2 - t1

        once(prompts(0))  # warm-up: first-call allocations of this batch size
        runs = [once(prompts(k)) for k in range(ask.get("requests", 1))]
        wall = sum(p + s for _, p, s in runs)
        steps = sum(s for _, _, s in runs)
        got = {"users": n, "prefill_ms": 1000 * statistics.median(f for f, _, _ in runs),
               "total_tok_s": n * new * len(runs) / wall, "step_tok_s": n * (new - 1) * len(runs) / steps,
               "step_ms": 1000 * steps / ((new - 1) * len(runs))}
        print(RAW_REPLY + json.dumps(got), flush=True)


def run_level(url: str, users: int, requests: int, max_tokens: int, sampling: dict | None = None) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    started: list[float] = []
    go = threading.Barrier(users, action=lambda: started.append(time.perf_counter()))  # the clock starts here

    def client(i: int) -> None:
        import httpx

        with httpx.Client(timeout=600) as c:
            c.get(url + "/health")  # connected before the clock starts, as a chat client is
            go.wait()
            for k in range(requests):
                seeded = sampling and sampling | {"seed": 1000 * i + k}
                r = one_request(url, QUESTIONS[(i + k) % len(QUESTIONS)] + f" (user {i})", max_tokens, seeded, c)
                with lock:
                    results.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started[0]
    ttfts = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    per_user = [r["tokens"] / r["total_s"] for r in results]
    return {"users": users, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "total_tok_s": tokens / wall, "per_user_tok_s": statistics.median(per_user),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            # the second streamed chunk: whether the rest of the answer follows the first token or waits
            "second_chunk_p50_ms": 1000 * statistics.median(r["second_s"] for r in results),
            "cached_prompt_tokens": sum(r["cached"] for r in results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--engine", help="engine to serve (default: the server's choice)")
    ap.add_argument("--users", default="1,4,8,16", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, help="server intra-op threads (default: all cores)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples, seeded per request")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--prompt-cache-mb", default=None,
                    help="server prompt cache size(s), comma-separated: one server each, compared in one table "
                         "(e.g. 64,0; default: the server's default)")
    ap.add_argument("--llama-server", metavar="GGUF", help="also serve this GGUF with llama.cpp's llama-server "
                    "(-np = the most users, continuous batching, same threads), interleaved with ours level by level")
    ap.add_argument("--rounds", type=int, help="interleaved rounds: per level, the server, the raw decoder (same "
                    "engine, prompts and threads) and, with --llama-server, llama-server, in turn; per-round ratios")
    ap.add_argument("--llama-poll", type=int, help="llama-server --poll (0: workers sleep instead of spinning, as our "
                    "server's do; fairer on a loaded machine; default: llama.cpp's own)")
    ap.add_argument("--no-draft", action="store_true", help="serve without the bundle's own draft model (edge-chat "
                    "serve --no-draft; by default a bundle built with --draft drafts while one answer decodes)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="with --rounds: also serve with these extra `edge-chat serve` arguments, as its own side in the "
                         "same rounds (e.g. together='--prefill-batch-tokens 0'); repeatable")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="with --rounds: start every process (servers, raw decoder, llama-server) anew for each round, "
                         "started and measured in an order rotated by round (identical servers on this 2-core VM ran "
                         "7-13%% apart for their whole life, so one process per side is one draw; docs/speed.md)")
    ap.add_argument("--json", default="bench-results/serve.json")
    ap.add_argument("--_raw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._raw:
        _raw_child(json.loads(args._raw))
        return 0
    try:
        bad = [x for x in args.users.split(",") if int(x) < 1]
    except ValueError:
        bad = [args.users]
    if bad or args.requests < 1 or args.max_tokens < 1:
        ap.error(f"--users takes user counts >= 1 (got {args.users}), --requests and --max-tokens >= 1")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    variants = []
    for spec in args.variant:
        name, _, extra = spec.partition("=")
        taken = {"edgechat", "raw decoder", "llama-server"} | {n for n, _ in variants}
        if not name or not extra.strip() or name in taken:
            ap.error(f"--variant takes NAME=ARGS with a new name (not {', '.join(sorted(taken))}) and some serve "
                     f"arguments, got {spec!r}")
        variants.append((name, tuple(shlex.split(extra))))
    args.variants = variants
    if variants and not args.rounds:
        ap.error("--variant compares in interleaved rounds: give --rounds")
    if args.llama_server or args.rounds:
        return versus(args)
    levels = [int(x) for x in args.users.split(",")]
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else None
    caches = [float(x) for x in args.prompt_cache_mb.split(",")] if args.prompt_cache_mb else [None]
    rows = []
    for mb in caches:
        proc, url = start_server(args.bundle, args.engine, max(levels), args.threads, mb,
                                 extra=("--no-draft",) if args.no_draft else ())
        try:
            health = json.loads(urllib.request.urlopen(url + "/health").read())
            one_request(url, "Hello!", 8)  # warm-up
            base = None
            for n in levels:
                print(f"... {n} users" + ("" if mb is None else f", prompt cache {mb:g} MB"), file=sys.stderr, flush=True)
                r = run_level(url, n, args.requests, args.max_tokens, sampling) | {"prompt_cache_mb": mb}
                base = r["total_tok_s"] if n == 1 else base
                r["speedup_vs_1"] = r["total_tok_s"] / base if base else None
                rows.append(r)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\n{health['model']} [{health['precision']}, {health['backend']}], {args.max_tokens} tokens/answer, "
          f"{args.requests} answers/user, " + (f"sampled T={args.temperature} top-p {args.top_p}, " if sampling else "greedy, ")
          + f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
    print(f"{'cache MB':>8} {'users':>5} {'total tok/s':>12} {'x 1 user':>9} {'per user':>9} {'TTFT p50':>9} {'TTFT p95':>9}"
          f" {'cached tok/req':>14}")
    for r in rows:
        sp = f"{r['speedup_vs_1']:.2f}x" if r["speedup_vs_1"] else "-"
        mb = "default" if r["prompt_cache_mb"] is None else f"{r['prompt_cache_mb']:g}"
        print(f"{mb:>8} {r['users']:>5} {r['total_tok_s']:>12.1f} {sp:>9} {r['per_user_tok_s']:>9.1f} "
              f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p95_ms']:>7.0f}ms {r['cached_prompt_tokens'] / r['requests']:>14.1f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"server": health, "max_tokens": args.max_tokens, "sampling": sampling or "greedy", "rows": rows,
                               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}, indent=2))
    print(f"wrote {out}")
    return 0


def versus(args) -> int:
    """Per level and round, in turn: our server, the raw decoder (the same engine, prompts and threads, no
    server), and llama-server when --llama-server is given (all servers up at once, each idle while another is
    measured; `--fresh-processes`: started anew for each round). Medians, spreads and per-round ratios:
    "server / raw decoder" is what the serving path costs."""
    levels = [int(x) for x in args.users.split(",")]
    rounds = args.rounds or 1
    if args.prompt_cache_mb and "," in args.prompt_cache_mb:
        sys.exit("--rounds / --llama-server take one --prompt-cache-mb (0: every prompt prefilled, as the raw "
                 "decoder does)")
    mb = float(args.prompt_cache_mb) if args.prompt_cache_mb else None

    def start_all(r: int = 0) -> list[tuple[str, object, str | None]]:
        """(name, process, url) of every side in measuring order, servers up and warmed. Started in an order
        rotated by round `r` (--fresh-processes): a process started earlier ran slower here for its whole life
        (docs/speed.md), so each side takes each place in turn."""
        base = ("--no-draft",) if args.no_draft else ()
        makers = [(name, lambda extra=extra: start_server(args.bundle, args.engine, max(levels), args.threads, mb,
                                                          extra=base + extra))
                  for name, extra in [("edgechat", ())] + args.variants]
        makers.append(("raw decoder", lambda: (RawDecoder(args.bundle, args.engine, args.threads), None)))
        if args.llama_server:
            makers.append(("llama-server", lambda: start_llama_server(args.llama_server, max(levels), args.threads,
                                                                      poll=args.llama_poll)))
        k = r % len(makers)
        started: dict[str, tuple] = {}
        try:
            for name, make in makers[k:] + makers[:k]:
                started[name] = make()
            for proc, u in started.values():
                if u:
                    one_request(u, "Hello!", 8)  # warm-up
        except BaseException:
            stop_all([(name, *v) for name, v in started.items()])
            raise
        return [(name, *started[name]) for name, _ in makers]

    def stop_all(started) -> None:
        """Every process told to stop first, then each waited for (killed if it does not stop in 30 s)."""
        procs = [p for _, p, _ in started if p is not None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)

    sides = start_all()
    url, lurl = sides[0][2], next((u for name, _, u in sides if name == "llama-server"), None)
    health = json.loads(urllib.request.urlopen(url + "/health").read())
    rows: dict = {}
    try:
        for n in levels:
            for r in range(rounds):
                if args.fresh_processes and (n, r) != (levels[0], 0):  # each round on new processes (see --help)
                    stop_all(sides)
                    sides = start_all(r)
                k = r % len(sides) if args.fresh_processes else 0  # the measuring order rotates with the start order
                for name, proc, u in sides[k:] + sides[:k]:
                    load = os.getloadavg()[0]
                    print(f"... {n} users, round {r + 1}, {name} (load {load:.1f})", file=sys.stderr, flush=True)
                    got = run_level(u, n, args.requests, args.max_tokens) if u else \
                        proc.run(n, args.max_tokens, args.requests)
                    rows.setdefault(n, {}).setdefault(name, []).append(got | {"load_avg_1m": load})
    finally:
        stop_all(sides)
    names = [name for name, _, _ in sides]
    print(f"\n{health['model']} [{health['precision']}, {health['backend']}]" +
          (f" vs llama-server ({Path(args.llama_server).name})" if lurl else "") +
          f", {args.max_tokens} tokens/answer, {args.requests} answers/user, greedy, EOS ignored, {rounds} rounds "
          f"interleaved, {args.threads or os.cpu_count()} threads, {os.cpu_count()} CPUs, load average now "
          f"{os.getloadavg()[0]:.1f}; our prompt cache " + ("default" if mb is None else f"{mb:g} MB") +
          " (cached prompt tokens per request below). Total tok/s: median (min-max); ratios per round, then the median.")
    print(f"{'users':>5} " + " ".join(f"{k + ' tok/s':>24}" for k in names) + f" {'server/raw':>17}"
          + (f" {'ours/llama':>17}" if lurl else "") + f" {'TTFT p50 ours':>14} {'raw prefill':>12}"
          + (f" {'llama TTFT':>11}" if lurl else ""))
    summary = {}
    for n, by in rows.items():
        tok = {k: [x["total_tok_s"] for x in v] for k, v in by.items()}
        raw = [a / b for a, b in zip(tok["edgechat"], tok["raw decoder"])]
        vs = [a / b for a, b in zip(tok["edgechat"], tok["llama-server"])] if lurl else []
        ttft = statistics.median(x["ttft_p50_ms"] for x in by["edgechat"])
        prefill = statistics.median(x["prefill_ms"] for x in by["raw decoder"])
        summary[n] = {"tok_s": {k: statistics.median(v) for k, v in tok.items()}, "server_over_raw": raw,
                      "server_over_raw_median": statistics.median(raw), "ttft_p50_ms": ttft,
                      "raw_prefill_ms": prefill,
                      "raw_step_ms": statistics.median(x["step_ms"] for x in by["raw decoder"])}
        for name, _ in args.variants:  # each variant against the server as it is, per round
            summary[n][name] = {"over_edgechat": [a / b for a, b in zip(tok[name], tok["edgechat"])],
                                "ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in by[name]),
                                "second_chunk_p50_ms": statistics.median(x["second_chunk_p50_ms"] for x in by[name]),
                                "ttft_p95_ms": statistics.median(x["ttft_p95_ms"] for x in by[name])}
        summary[n]["ttft_p95_ms"] = statistics.median(x["ttft_p95_ms"] for x in by["edgechat"])
        summary[n]["second_chunk_p50_ms"] = {k: statistics.median(x["second_chunk_p50_ms"] for x in v)
                                             for k, v in by.items() if k != "raw decoder"}
        if lurl:
            summary[n] |= {"ours_over_llama": vs, "ours_over_llama_median": statistics.median(vs),
                           "llama_ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in by["llama-server"])}

        def cell(v: list[float], unit: str = "") -> str:
            return f"{statistics.median(v):.2f}{unit} ({min(v):.2f}-{max(v):.2f})"

        print(f"{n:>5} " + " ".join(f"{cell(tok[k]):>24}" for k in names) + f" {cell(raw, 'x'):>17}"
              + (f" {cell(vs, 'x'):>17}" if lurl else "") + f" {ttft:>12.0f}ms {prefill:>10.0f}ms"
              + (f" {summary[n]['llama_ttft_p50_ms']:>9.0f}ms" if lurl else "")
              + f"  cached {statistics.median(x['cached_prompt_tokens'] / x['requests'] for x in by['edgechat']):.0f}")
        print(f"{'':>5} second chunk p50: "
              + ", ".join(f"{k} {v:.0f} ms" for k, v in summary[n]["second_chunk_p50_ms"].items()))
        for name, _ in args.variants:
            v = summary[n][name]
            print(f"{'':>5} {name}: tok/s {cell(v['over_edgechat'], 'x')} of edgechat's, TTFT p50 {v['ttft_p50_ms']:.0f} ms "
                  f"(edgechat {ttft:.0f}), p95 {v['ttft_p95_ms']:.0f} ms (edgechat {summary[n]['ttft_p95_ms']:.0f})")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"script": "scripts/bench_serve.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "server": health, "engine": args.engine, "llama_poll": args.llama_poll,
                               "gguf": args.llama_server, "threads": args.threads, "max_tokens": args.max_tokens,
                               "requests": args.requests, "rounds": rounds,
                               "variants": {name: list(extra) for name, extra in args.variants},
                               "fresh_processes": args.fresh_processes, "prompt_cache_mb": mb, "rows": rows, "summary": summary,
                               "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                                           "platform": platform.platform(), "load_avg_at_end": os.getloadavg()}},
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
