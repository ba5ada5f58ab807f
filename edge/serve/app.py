"""Run the server: bind, print where it is, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import TYPE_CHECKING

from edge.errors import EdgeChatError
from edge.decode.generate import Generator

if TYPE_CHECKING:
    from edge.serve.limits import ConnectionLimits

log = logging.getLogger("edgechat")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket (as uvicorn would: SO_REUSEADDR); a port in use is one clear EdgeChatError.
    Done before the model loads, and the socket is then handed to uvicorn, so nothing can take it between."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise EdgeChatError(f"cannot listen on {host}: {e.strerror}; check --host") from None
    family, _, proto, _, addr = infos[0]
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP. Without it a
    # stream's small writes wait for the client's delayed ACK (Nagle): 40 ms before the first chunk of every
    # answer, and stalls between tokens (docs/speed.md, "The serving path's cost per token"). The listening
    # socket's TCP_NODELAY is inherited by every connection it accepts, whoever sets up the transport.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise EdgeChatError(f"port {port} on {host} is already in use (another edge-chat serve?): stop that "
                                "server or choose another port with --port") from None
        raise EdgeChatError(f"cannot listen on {host}:{port} ({e.strerror}): check --host and --port") from None
    sock.set_inheritable(True)
    return sock


def serve(gen: Generator, host: str = "127.0.0.1", port: int = 7860, max_users: int = 8, max_queue: int | None = None,
          auth: tuple[str, str] | None = None, ui: bool = True, prompt_cache_mb: float | None = None,
          sock: socket.socket | None = None, request_timeout_s: float | None = None, lenient: bool = False,
          limits: "ConnectionLimits | None" = None, reasoning_budget: int | None = None,
          context_overflow: str = "shift", prefill_batch_tokens: int | None = None) -> int:
    import uvicorn

    from edge.serve.limits import ConnectionLimits, timed_h11_protocol
    from edge.serve.service import Service, create_app

    limits = limits or ConnectionLimits()
    sock = sock if sock is not None else bind_socket(host, port)
    service = Service(gen, max_users=max_users, max_queue=max_queue, prompt_cache_mb=prompt_cache_mb,
                      request_timeout_s=request_timeout_s, lenient=lenient, limits=limits,
                      reasoning_budget=reasoning_budget, context_overflow=context_overflow,
                      prefill_batch_tokens=prefill_batch_tokens)
    service.scheduler.start()
    app = create_app(service, auth=auth, ui=ui)
    shown = f"[{host}]" if ":" in host else host

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                url = f"http://{shown}:{port}"
                print(f"EdgeChat: {service.model_id} ({service.precision}, {service.backend}), up to {max_users} users",
                      flush=True)
                print(f"  chat page   {url}/" if ui else "  chat page   off (--no-ui)", flush=True)
                print(f"  OpenAI API  {url}/v1   (health {url}/health, metrics {url}/metrics)", flush=True)
                print(f"  Anthropic   {url}/v1/messages   (base_url {url})", flush=True)
                b = gen.bundle
                if b is not None:
                    print(f"  bundle      {len(b.manifest.files)} files checked, {len(b.hashed)} hashed now (SHA-256)",
                          flush=True)
                if gen.drafter is not None:
                    print(f"  draft       {gen.draft_name} drafts while one sampled answer (no seed) decodes, where it pays "
                          f"({gen.draft_source})", flush=True)
                if gen.speculative or gen.drafter is not None:
                    print("  speculation off for greedy and seeded answers: they equal the plain answer", flush=True)
                if not service.invariance.guaranteed:
                    print(f"  note        batched answers may differ from the same request alone: "
                          f"{service.invariance.why}", flush=True)
                print("  Ctrl-C to stop", flush=True)

        def handle_exit(self, sig, frame) -> None:
            service.scheduler.stop(timeout=0)  # end in-flight streams now, so shutdown does not wait for them
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a clean stop exits 0 (uvicorn would re-raise the signal)

    # uvicorn's connection cap (503 beyond it); the header timeout is our h11 subclass (edge.serve.limits)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            ws="none", lifespan="on", http=timed_h11_protocol(limits),
                            limit_concurrency=limits.max_connections)
    server = Server(config)
    server.run(sockets=[sock])
    service.scheduler.stop()
    if not server.started:
        print(f"error: the server on {host}:{port} did not start (see above)", file=sys.stderr)
        return 2
    print("EdgeChat: stopped", flush=True)
    return 0
