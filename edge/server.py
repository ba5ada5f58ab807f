"""`edge-chat serve`: one process, one port — the Gradio page, an OpenAI-compatible API, /health and /metrics.

All requests, from the page and the API alike, go through one `Scheduler`, so
they share batched decode steps. Handlers never block on the model: the
scheduler thread hands each request's events to its own asyncio queue.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets
import time
import uuid
from typing import Any, AsyncIterator

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported anywhere

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from edge.batching import QueueFullError, Request, Scheduler
from edge.errors import ContextOverflowError, EdgeChatError
from edge.metrics import Metrics
from edge.runtime import Generator, StreamEvent
from edge.sampling import SamplingConfig

log = logging.getLogger("edgechat")
MAX_BODY = 4 * 1024 * 1024


class APIError(Exception):
    """An OpenAI-style error response: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Service:
    """What the routes and the page share: generator, scheduler, metrics, identity."""

    def __init__(self, gen: Generator, max_users: int = 8, max_queue: int | None = None,
                 prompt_cache_mb: float | None = None) -> None:
        self.gen = gen
        self.metrics = Metrics()
        self.scheduler = Scheduler(gen, max_batch=max_users, max_queue=4 * max_users if max_queue is None else max_queue,
                                   metrics=self.metrics,
                                   **({} if prompt_cache_mb is None else {"prompt_cache_mb": prompt_cache_mb}))
        m = gen.bundle.manifest if gen.bundle is not None else None
        self.model_id = m.model_name.split("/")[-1] if m else "edgechat"
        engine = getattr(gen.decoder, "engine", None)
        self.precision = engine.fingerprint.precision if engine is not None else "?"
        p0 = gen.decoder.providers[0]
        self.backend = "TensorRT" if p0 == "TensorRT" else f"ONNX Runtime {p0.replace('ExecutionProvider', '')}"
        self.started = time.time()

    def sampling(self, max_tokens: int | None, prompt_len: int, **kw) -> SamplingConfig:
        room = self.gen.max_context - prompt_len
        if room <= 1:
            raise ContextOverflowError(
                f"the messages take {prompt_len} tokens but this model's context is {self.gen.max_context}: "
                "shorten them or drop old turns")
        if max_tokens is not None and max_tokens > room:
            raise ContextOverflowError(
                f"this model's context is {self.gen.max_context} tokens; the messages take {prompt_len} and "
                f"max_tokens asks for {max_tokens}: lower max_tokens to {room} or shorten the messages")
        default = self.gen.sampling().max_new_tokens
        return self.gen.sampling(max_new_tokens=max_tokens or min(default, room - 1) or 1, **kw)

    async def generate(self, prompt_ids: list[int], cfg: SamplingConfig) -> tuple[Request, AsyncIterator[StreamEvent]]:
        """Submit to the scheduler; returns the request and an async iterator over its events."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamEvent] = asyncio.Queue()
        req = self.scheduler.submit(prompt_ids, cfg, on_event=lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))

        async def events() -> AsyncIterator[StreamEvent]:
            try:
                while True:
                    ev = await q.get()
                    yield ev
                    if ev.finish_reason:
                        return
            finally:  # the consumer left (client gone, stop pressed): free the slot now
                req.cancel()

        return req, events()


# -- request parsing -----------------------------------------------------------------------------------

def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(400, f"{where}: only text content parts are supported", param="messages")
            parts.append(p["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise APIError(400, f"{where}.content must be a string or a list of text parts", param="messages")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role '{m['role']}' is not supported (system, user, assistant)",
                           param="messages")
        out.append({"role": role, "content": _text(m.get("content"), f"messages[{i}]")})
    return out


def _number(body: dict, key: str, kind: type, lo: float | None = None, hi: float | None = None):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise APIError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {v}", param=key)
    return kind(v)


def parse_sampling(body: dict) -> dict:
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a non-empty string or a list of up to 4", param="stop")
    n = _number(body, "n", int, 1, 1)
    del n  # only n=1 is supported; _number refuses anything else with a clear message
    max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
    return {"max_tokens": max_tokens, "temperature": _number(body, "temperature", float, 0, 2),
            "top_p": _number(body, "top_p", float, 0.0001, 1), "seed": _number(body, "seed", int),
            "stop": tuple(stop) if stop else None, "ignore_eos": bool(body.get("ignore_eos", False)) or None}


# -- the app -------------------------------------------------------------------------------------------

def create_app(service: Service, auth: tuple[str, str] | None = None, ui: bool = True) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        service.scheduler.stop()

    app = FastAPI(title="EdgeChat", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    if auth is not None:
        app.add_middleware(CheckAuth, auth=auth)

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, e: APIError):
        return e.response()

    @app.get("/health")
    async def health():
        s = service.scheduler
        body = {"status": "ok" if s.alive else "down", "model": service.model_id, "precision": service.precision,
                "backend": service.backend, "active": s.active, "queued": s.queue_depth, "max_users": s.max_batch,
                "uptime_s": round(time.time() - service.started, 1)}
        if s.error:
            body["error"] = s.error
        return JSONResponse(body, status_code=200 if s.alive else 503)

    @app.get("/metrics")
    async def metrics():
        s = service.scheduler
        return PlainTextResponse(service.metrics.render(s.active, s.queue_depth, s.max_batch),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        if model_id != service.model_id:
            raise APIError(404, f"model '{model_id}' is not served here; this server has '{service.model_id}'",
                           code="model_not_found", param="model")
        return _model_card(service)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        raw = await request.body()
        if len(raw) > MAX_BODY:
            service.metrics.reject("bad_request")
            raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            service.metrics.reject("bad_request")
            raise APIError(400, f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            service.metrics.reject("bad_request")
            raise APIError(400, "the body must be a JSON object")
        try:
            messages = parse_messages(body)
            params = parse_sampling(body)
            prompt = service.gen.tokenizer.encode_chat(messages)
            max_tokens = params.pop("max_tokens")
            if not service.scheduler.alive:
                raise APIError(503, f"the model is not running ({service.scheduler.error or 'stopped'})",
                               type_="server_error", headers={"Retry-After": "30"})
            cfg = service.sampling(max_tokens, len(prompt), **params)
            req, events = await service.generate(prompt, cfg)
        except APIError:
            service.metrics.reject("bad_request")
            raise
        except ContextOverflowError as e:
            service.metrics.reject("context")
            raise APIError(400, str(e), code="context_length_exceeded", param="messages") from None
        except QueueFullError as e:
            service.metrics.reject("queue_full")
            raise APIError(429, str(e), code="rate_limit_exceeded", type_="rate_limit_error",
                           headers={"Retry-After": str(int(e.retry_after_s))}) from None
        except EdgeChatError as e:
            service.metrics.reject("bad_request")
            raise APIError(400, str(e)) from None
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(service, cid, created, events, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, last = [], None
        async for ev in events:
            parts.append(ev.text)
            last = ev
        assert last is not None
        if last.finish_reason == "error":
            raise APIError(500, f"generation failed: {last.stats.get('error')}", type_="server_error")
        return {"id": cid, "object": "chat.completion", "created": created, "model": service.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": _finish(last.finish_reason), "logprobs": None}],
                "usage": _usage(last), "system_fingerprint": f"edgechat-{service.precision}"}

    if ui:
        import gradio as gr

        from edge.webui import build_ui, theme

        app = gr.mount_gradio_app(app, build_ui(service), path="/", auth=auth, theme=theme(), footer_links=[],
                                  ssr_mode=False, mcp_server=False, pwa=False, enable_monitoring=False)
    return app


class CheckAuth:
    """API credentials, checked before a request reaches its route. A plain ASGI middleware: it never
    touches the response, where Starlette's `@app.middleware("http")` would pipe every streamed chunk
    through an extra task (twice the server's CPU per token chunk, measured)."""

    def __init__(self, app, auth: tuple[str, str]) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            if not _authorized(header, self.auth):
                await APIError(401, "missing or wrong credentials: send 'Authorization: Bearer <password>' "
                                    "(the password given to --auth) or HTTP Basic user:password",
                               type_="authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _authorized(header: str, auth: tuple[str, str]) -> bool:
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return secrets.compare_digest(value.strip(), auth[1]) or secrets.compare_digest(value.strip(), ":".join(auth))
    if scheme.lower() == "basic":
        try:
            user, _, pw = base64.b64decode(value.strip()).decode().partition(":")
        except Exception:
            return False
        return secrets.compare_digest(user, auth[0]) and secrets.compare_digest(pw, auth[1])
    return False


def _model_card(service: Service) -> dict:
    return {"id": service.model_id, "object": "model", "created": int(service.started), "owned_by": "edgechat",
            "precision": service.precision, "backend": service.backend, "context_length": service.gen.max_context}


def _finish(reason: str | None) -> str:
    return {"cancelled": "stop", None: "stop"}.get(reason, reason)


def _usage(last: StreamEvent) -> dict:
    p, c = last.stats.get("prompt_tokens", 0), last.stats.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": last.stats.get("cached_prompt_tokens", 0)}}


async def _sse(service: Service, cid: str, created: int, events: AsyncIterator[StreamEvent],
               include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True) -> str:
        body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                "model": service.model_id, "system_fingerprint": f"edgechat-{service.precision}",
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
                                if choices else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for ev in events:
            if ev.text:
                yield chunk({"content": ev.text})
            if ev.finish_reason:
                if ev.finish_reason == "error":
                    err = {"error": {"message": f"generation failed: {ev.stats.get('error')}", "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                yield chunk({}, _finish(ev.finish_reason))
                if include_usage:
                    yield chunk({}, usage=_usage(ev), choices=False)
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]
