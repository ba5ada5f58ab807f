"""Run the server: bind, print where it is, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import sys

from edge.runtime import Generator

log = logging.getLogger("edgechat")


def serve(gen: Generator, host: str = "127.0.0.1", port: int = 7860, max_users: int = 8, max_queue: int | None = None,
          auth: tuple[str, str] | None = None, ui: bool = True, prompt_cache_mb: float | None = None) -> int:
    import uvicorn

    from edge.server import Service, create_app

    service = Service(gen, max_users=max_users, max_queue=max_queue, prompt_cache_mb=prompt_cache_mb)
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
                print("  Ctrl-C to stop", flush=True)

        def handle_exit(self, sig, frame) -> None:
            service.scheduler.stop(timeout=0)  # end in-flight streams now, so shutdown does not wait for them
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a clean stop exits 0 (uvicorn would re-raise the signal)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            ws="none", lifespan="on")
    server = Server(config)
    server.run()
    service.scheduler.stop()
    if not server.started:
        print(f"error: could not listen on {host}:{port} (in use? try --port)", file=sys.stderr)
        return 2
    print("EdgeChat: stopped", flush=True)
    return 0
