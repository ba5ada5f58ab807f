"""`edge-chat serve`: one process, one port — the Gradio page, an OpenAI-compatible API, Anthropic's Messages
API, /health and /metrics.

All requests, from the page and the API alike, go through one `Scheduler`, so
they share batched decode steps. Handlers never block on the model: the
scheduler thread hands each request's events to its own asyncio queue.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, AsyncIterator

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported anywhere

from fastapi import FastAPI, Request as HTTPRequest
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from edge.serve import anthropic_schema, anthropic_writer
from edge.serve import openai_answers as api_answers
from edge.serve import openai_schema as api_schema
from edge.serve import openai_writer as writer
from edge.decode.scheduler import JobGone, QueueFullError, Request, Scheduler
from edge.errors import ContextOverflowError, EdgeChatError
from edge.decode.grammar import GrammarError
from edge.decode.logits import RowLogits
from edge.serve.guards import APIError, APIPaths, CheckAuth, ClientGone
from edge.serve.limits import BodyRefused, ConnectionLimits, read_body
from edge.serve.metrics import Metrics
from edge.decode.generate import Generator
from edge.decode.text_stream import StreamEvent
from edge.decode.sampling import SamplingConfig

log = logging.getLogger("edgechat")


class Service:
    """What the routes and the page share: generator, scheduler, metrics, identity."""

    def __init__(self, gen: Generator, max_users: int = 8, max_queue: int | None = None,
                 prompt_cache_mb: float | None = None, request_timeout_s: float | None = None,
                 lenient: bool = False, limits: ConnectionLimits | None = None,
                 reasoning_budget: int | None = None, context_overflow: str = "shift",
                 prefill_batch_tokens: int | None = None) -> None:
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise EdgeChatError(f"--request-timeout must be > 0 seconds, got {request_timeout_s}")
        if context_overflow not in ("shift", "error"):
            raise EdgeChatError(f"--context-overflow must be shift or error, got {context_overflow!r}")
        # a chat past the context: drop its oldest turns (edge.decode.conversation) or refuse it (400)
        self.context_overflow = context_overflow
        self.gen = gen
        self.reasoning_budget = reasoning_budget  # --reasoning-budget: a request's default (edge.decode.thinking)
        self.metrics = Metrics()
        self.request_timeout_s = request_timeout_s
        self.scheduler = Scheduler(gen, max_batch=max_users, max_queue=4 * max_users if max_queue is None else max_queue,
                                   metrics=self.metrics,
                                   **({} if prompt_cache_mb is None else {"prompt_cache_mb": prompt_cache_mb}))
        if prefill_batch_tokens is not None:  # --prefill-batch-tokens (edge.decode.requests.Admission)
            if prefill_batch_tokens < 0:
                raise EdgeChatError(f"--prefill-batch-tokens must be >= 0 (0: no limit), got {prefill_batch_tokens}")
            self.scheduler.admission = dataclasses.replace(self.scheduler.admission,
                                                           prefill_batch_tokens=prefill_batch_tokens)
        # speculative steps only while one answer is decoding (edge.decode.speculative)
        self.scheduler.speculator = gen.make_speculator()
        # served greedy answers equal the plain answer: only unseeded sampled answers speculate (see Scheduler._draftable)
        self.scheduler.speculate_greedy = False
        m = gen.bundle.manifest if gen.bundle is not None else None
        self.model_id = m.model_name.split("/")[-1] if m else "edgechat"
        engine = getattr(gen.decoder, "engine", None)
        self.precision = engine.fingerprint.precision if engine is not None else "?"
        p0 = gen.decoder.providers[0]
        self.backend = "TensorRT" if p0 == "TensorRT" else f"ONNX Runtime {p0.replace('ExecutionProvider', '')}"
        from edge.backends.determinism import batch_invariance, float_activations

        # what /v1/models promises about batched answers
        self.invariance = batch_invariance(self.precision, p0, float_acts=float_activations(m, self.precision))
        self.started = time.time()
        self.limits = limits or ConnectionLimits()
        self.lenient = lenient  # --lenient: fields this server does not support are ignored, not a 400
        self._hand: Handoff | None = None
        threading.Thread(target=self._warm_grammar, name="edgechat-grammar-warmup", daemon=True).start()

    def _warm_grammar(self) -> None:
        """Build the grammar engine's view of the vocabulary now (about a second on 49k tokens), not on the
        first response_format request."""
        try:
            from edge.decode.grammar import GrammarVocab

            api_answers.token_table(self.gen.tokenizer, self.gen.decoder.dims.vocab_size)  # for logprobs, length bounds
            GrammarVocab.for_tokenizer(self.gen.tokenizer, self.gen.decoder.dims.vocab_size)
        except Exception as e:  # llguidance missing: constrained requests get the MissingDependencyError then
            log.info("grammar engine not ready: %s", e)

    async def on_scheduler(self, fn):
        """Run `fn()` where the decoder may be called: on the scheduler's thread, between its steps."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def submit_rows(self, rows) -> tuple[list[Request], asyncio.Queue]:
        """Every row of a request to the scheduler, all or none (n answers count as n queue places); their
        (row, event) pairs arrive on one queue."""
        cap = self.scheduler.max_rows_per_request
        if len(rows.cfgs) > cap:
            raise api_schema.BadRequest(f"this request asks for {len(rows.cfgs)} answers (n x prompts); this server "
                                        f"takes at most {cap} per request (--max-users, --max-queue): ask for fewer",
                                        param="n")
        hand = self._handoff()
        q: asyncio.Queue = asyncio.Queue()
        reqs = self.scheduler.submit_group(
            [(rows.prompts[p], cfg, lg) for p, cfg, lg in zip(rows.prompt_of, rows.cfgs, rows.logits)],
            on_event=lambda i, ev: hand.put(q, (i, ev)), timeout_s=self.request_timeout_s)
        return reqs, q

    def _handoff(self) -> "Handoff":
        """The hand-off to the running event loop (one per loop: tests run several)."""
        loop = asyncio.get_running_loop()
        if self._hand is None or self._hand.loop is not loop:
            self._hand = Handoff(loop)
        return self._hand

    async def run_steps(self, steps, request: HTTPRequest):
        """A long job (prompt scoring) on the scheduler thread a bounded step at a time between decode steps,
        under --request-timeout and stopped when the client hangs up: 504 / ClientGone."""
        deadline = None if self.request_timeout_s is None else time.perf_counter() + self.request_timeout_s
        left = threading.Event()

        def gone() -> str | None:
            if left.is_set():
                return "cancelled"
            return "timeout" if deadline is not None and time.perf_counter() >= deadline else None

        watch = asyncio.ensure_future(_client_gone(request))
        watch.add_done_callback(lambda t: None if t.cancelled() else left.set())
        try:
            return await asyncio.wrap_future(self.scheduler.call_steps(steps, gone))
        except JobGone as e:
            if e.why == "timeout":
                raise APIError(504, writer.timeout_message(self), type_="timeout_error", code="request_timeout") \
                    from None
            raise ClientGone() from None
        finally:
            watch.cancel()

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

    async def submit(self, prompt_ids: list[int], cfg: SamplingConfig,
                     logits: RowLogits | None = None) -> tuple[Request, asyncio.Queue]:
        """Hand a request to the scheduler; its events arrive on the returned queue (on this event loop)."""
        hand = self._handoff()
        q: asyncio.Queue[StreamEvent] = asyncio.Queue()
        req = self.scheduler.submit(prompt_ids, cfg, on_event=lambda ev: hand.put(q, ev),
                                    timeout_s=self.request_timeout_s, logits=logits)
        return req, q

    async def generate(self, prompt_ids: list[int], cfg: SamplingConfig,
                       logits: RowLogits | None = None) -> tuple[Request, AsyncIterator[StreamEvent]]:
        """Submit to the scheduler; returns the request and an async iterator over its events. Leaving the
        iterator early (client gone, Stop pressed) cancels the request, which frees its slot. `logits`: the
        page's JSON mode or tools (edge.decode.logits)."""
        req, q = await self.submit(prompt_ids, cfg, logits)
        return req, _events(req, q)


class Handoff:
    """Events from the scheduler's thread to the event loop's queues: one loop wake-up carries every event that
    arrived before the loop got to it (all rows of a decode step), not one wake-up (a self-pipe write and a
    select return) per event. An event is never held back: the first one of a batch wakes the loop at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._armed = False  # a drain is scheduled on the loop and has not run yet

    def put(self, q: asyncio.Queue, item: Any) -> None:
        """Called on the scheduler's thread. Raises when the loop is closed (the request is then cancelled)."""
        with self._lock:
            self._items.append((q, item))
            if self._armed:
                return
            self._armed = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except BaseException:
            with self._lock:
                self._armed = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._armed = False
        for q, item in items:
            q.put_nowait(item)


async def _events(req: Request, q: asyncio.Queue) -> AsyncIterator[StreamEvent]:
    try:
        while True:
            ev = await q.get()
            yield ev
            if ev.finish_reason:
                return
    finally:  # the consumer left (client gone, stop pressed): free the slot now
        req.cancel()


async def _client_gone(request: HTTPRequest) -> None:
    """Returns when the client hangs up (the body has been read, so the next ASGI message is the disconnect)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


# -- the app -------------------------------------------------------------------------------------------

# every method a client may send to an API path: the ones a route does not take are a 405 there (with Allow),
# never a fall-through to the page mounted at /
OTHER_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "CONNECT"]
API_ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/messages": "POST",
              "/v1/messages/count_tokens": "POST", "/v1/models": "GET", "/health": "GET", "/metrics": "GET"}
ERRORS = {400: "bad input (names the field)", 401: "missing or wrong credentials", 404: "no such model or path",
          405: "wrong method", 408: "body not sent in time (--body-timeout)", 413: "body over 4 MiB", 415: "compressed body (Content-Encoding)", 429: "queue full (Retry-After)", 500: "generation failed",
          503: "the model is not running", 504: "over --request-timeout"}


def create_app(service: Service, auth: tuple[str, str] | None = None, ui: bool = True) -> FastAPI:
    from contextlib import asynccontextmanager

    from fastapi.openapi.utils import get_openapi
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        service.scheduler.stop()

    app = FastAPI(title="EdgeChat", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  lifespan=lifespan)
    metrics = service.metrics
    if auth is not None:
        app.add_middleware(CheckAuth, auth=auth, metrics=metrics)
    app.add_middleware(APIPaths, metrics=metrics)  # outermost: an API path never reaches the page, however spelled

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, e: APIError):
        return e.response(metrics, request.url.path)

    @app.exception_handler(ClientGone)
    async def client_gone(request: HTTPRequest, e: ClientGone):
        log.info("%s %s: the client hung up before the request was read", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code,
                        headers=dict(e.headers or {})).response(metrics, request.url.path)

    @app.exception_handler(Exception)
    async def server_error(request: HTTPRequest, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error ({type(e).__name__}): the server logged it; the request was not served",
                        type_="server_error").response(metrics, request.url.path)

    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    responses: dict = {s: {"description": d, "content": error_body} for s, d in ERRORS.items()}

    @app.api_route("/health", methods=["GET", "HEAD"], responses={503: responses[503]})
    async def health():
        s = service.scheduler
        body = {"status": "ok" if s.alive else "down", "model": service.model_id, "precision": service.precision,
                "backend": service.backend, "active": s.active, "queued": s.queue_depth, "max_users": s.max_batch,
                "uptime_s": round(time.time() - service.started, 1), "scheduler_restarts": s.restarts}
        if s.error:
            body["last_error"] = s.error
        return JSONResponse(body, status_code=200 if s.alive else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=PlainTextResponse,
                   responses={401: responses[401]})
    async def metrics_text():
        s = service.scheduler
        return PlainTextResponse(metrics.render(s.active, s.queue_depth, s.max_batch, s.restarts),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses={401: responses[401]})
    async def models():
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{model_id}", responses={s: responses[s] for s in (401, 404)})
    async def model(model_id: str):
        if model_id != service.model_id:
            raise APIError(404, f"model '{model_id}' is not served here; this server has '{service.model_id}'",
                           code="model_not_found", param="model")
        return _model_card(service)

    body_schema, components = api_schema.openapi_schemas()

    def body(schema: dict) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    def answered(what: str, errors: dict, statuses: tuple[int, ...]) -> dict:
        return {200: {"description": f"{what} (JSON), or server-sent events with stream: true",
                      "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                **{s: errors[s] for s in statuses}}

    @app.post("/v1/chat/completions", openapi_extra=body(body_schema),
              responses=answered("the answer", responses, (400, 401, 413, 429, 500, 503, 504)))
    async def chat_completions(request: HTTPRequest):
        return await _chat(service, request)

    @app.post("/v1/completions", openapi_extra=body({"$ref": "#/components/schemas/CompletionRequest"}),
              responses=answered("the completion", responses, (400, 401, 413, 429, 500, 503, 504)))
    async def completions(request: HTTPRequest):
        return await _completions(service, request)

    anthropic_errors = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}
    anthropic_responses = {s: {"description": d, "content": anthropic_errors} for s, d in ERRORS.items() if s != 429}
    anthropic_responses[529] = {"description": "queue full (Retry-After): Anthropic's overloaded_error",
                                "content": anthropic_errors}

    @app.post("/v1/messages", openapi_extra=body({"$ref": "#/components/schemas/MessagesRequest"}),
              responses=answered("the message", anthropic_responses, (400, 401, 413, 500, 503, 504, 529)))
    async def messages(request: HTTPRequest):
        return await _messages(service, request)

    @app.post("/v1/messages/count_tokens", openapi_extra=body({"$ref": "#/components/schemas/CountTokensRequest"}),
              responses={200: {"description": "{\"input_tokens\": N}: the prompt's tokens, nothing generated"},
                         **{s: anthropic_responses[s] for s in (400, 401, 413)}})
    async def count_tokens(request: HTTPRequest):
        return await _count_tokens(service, request)

    @app.api_route("/v1/{rest:path}", methods=OTHER_METHODS,
                   include_in_schema=False)
    async def unknown(request: HTTPRequest, rest: str):
        return _no_route(request)

    for path in ("/health", "/metrics"):
        app.add_api_route(path, _no_route, methods=[m for m in OTHER_METHODS if m not in ("GET", "HEAD")],
                          include_in_schema=False)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title="EdgeChat", version="1", description="OpenAI-compatible chat API and Anthropic's Messages API",
                                 routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            schema["components"]["schemas"].update(anthropic_schema.openapi_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    if ui:
        import gradio as gr

        from edge.serve.webui import CSS, build_ui, theme

        app = gr.mount_gradio_app(app, build_ui(service), path="/", auth=auth, theme=theme(), css=CSS, footer_links=[],
                                  ssr_mode=False, mcp_server=False, pwa=False, enable_monitoring=False)
    return app


def _no_route(request: HTTPRequest) -> JSONResponse:
    """An API path this server does not have (404) or a method it does not take there (405)."""
    path = request.url.path.rstrip("/") or "/"
    method = API_ROUTES.get(path) or ("GET" if path.startswith("/v1/models/") and path.count("/") == 3 else None)
    if method is not None:
        raise APIError(405, f"{request.method} {path} is not supported: use {method}", code="method_not_allowed",
                       headers={"Allow": method})
    raise APIError(404, f"no such API path: {request.method} {path} (this server has POST /v1/chat/completions, "
                        "POST /v1/completions, POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models, "
                        "/health, /metrics)", code="not_found")


async def _admit(service: Service, request: HTTPRequest, parse, plan,
                 queue: bool = True) -> tuple[Any, Any, list[Request], asyncio.Queue | None]:
    """Read, validate and plan a request, then queue its rows (unless `queue` is False: a token count): every
    refusal is an APIError (400, 413, 429, 503) before anything reaches the model."""
    metrics = service.metrics
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        metrics.reject("bad_request")
        raise APIError(415, f"Content-Encoding '{encoding}' is not supported: send the JSON body uncompressed",
                       code="unsupported_media_type")
    try:
        raw = await read_body(request, service.limits)
    except ClientDisconnect:  # hung up before the body was whole: nobody to answer, nothing went wrong here
        metrics.reject("client_gone")
        raise ClientGone() from None
    except BodyRefused as e:
        metrics.reject("bad_request")
        raise APIError(e.status, e.message, headers={"Connection": "close"} if e.close else None) from None
    try:
        # pydantic over a 4 MB body takes a while: off the event loop
        body = await asyncio.to_thread(parse, raw, lenient=service.lenient) if len(raw) > 65536 else \
            parse(raw, lenient=service.lenient)
        rows = await plan(service, body)
        if not queue:
            return body, rows, [], None
        if not service.scheduler.alive:
            raise APIError(503, f"the model is not running ({service.scheduler.error or 'stopped'})",
                           type_="server_error", headers={"Retry-After": "30"})
        reqs, q = await service.submit_rows(rows)
    except api_schema.BadRequest as e:
        metrics.reject("bad_request")
        raise APIError(400, e.message, param=e.param) from None
    except GrammarError as e:  # a schema the grammar engine cannot compile: the message says why
        metrics.reject("bad_request")
        raise APIError(400, str(e), code="invalid_schema",
                       param="tools" if "tool" in str(e) else "response_format") from None
    except APIError:
        metrics.reject("bad_request")
        raise
    except ContextOverflowError as e:
        metrics.reject("context")
        raise APIError(400, str(e), code="context_length_exceeded",
                       param="prompt" if parse is api_schema.parse_completion_request else "messages") from None
    except QueueFullError as e:
        metrics.reject("queue_full")
        raise APIError(429, str(e), code="rate_limit_exceeded", type_="rate_limit_error",
                       headers={"Retry-After": str(int(e.retry_after_s))}) from None
    except EdgeChatError as e:
        metrics.reject("bad_request")
        raise APIError(400, str(e)) from None
    return body, rows, reqs, q


def _failed(service: Service, lasts: list) -> None:
    """A row that failed or ran out of time fails the whole (non-streamed) answer: 500 or 504."""
    for last in lasts:
        if last.finish_reason == "error":
            raise APIError(500, f"generation failed: {last.stats.get('error')}", type_="server_error")
    if any(last.finish_reason == "timeout" for last in lasts):
        raise APIError(504, writer.timeout_message(service), type_="timeout_error", code="request_timeout")


async def _chat(service: Service, request: HTTPRequest):
    """POST /v1/chat/completions: validate everything, then hand the request's rows to the scheduler."""
    body, rows, reqs, q = await _admit(service, request, api_schema.parse_chat_request, api_answers.chat_rows)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    table = api_answers.token_table(service.gen.tokenizer, service.gen.decoder.dims.vocab_size) \
        if body.logprobs else None
    n = len(reqs)

    async def streamed():
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return writer.chat_sse(service, cid, created, api_answers.merged_events(reqs, q, n), n, rows, table,
                               include_usage, len(rows.prompts[0]))

    got = await _answer_rows(request, reqs, q, streamed if body.stream else None)
    if isinstance(got, Response):
        return got
    texts, lps, lasts = got
    _failed(service, lasts)
    return writer.chat_completion(service, cid, created, texts, lasts, lps, rows, table)


async def _answer_rows(request: HTTPRequest, reqs: list[Request], q: asyncio.Queue, streamed, whole=None):
    """A request's rows, once admitted, as the client gets them: `streamed()` (a coroutine making the body's
    server-sent events; None: a whole answer) -> the streaming response; else (texts, logprobs, lasts) of every
    row (`whole()` when given makes them), or a 499 when the client hung up. Whatever goes wrong after admission,
    the slots are freed at once."""
    try:
        if streamed is not None:
            return StreamingResponse(await streamed(), media_type="text/event-stream",
                                     background=BackgroundTask(_cancel_all, reqs),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        got = await (whole() if whole is not None else _collect(request, q, len(reqs)))
    except BaseException:
        _cancel_all(reqs)
        raise
    if got is None:  # the client hung up: nobody to answer
        _cancel_all(reqs)
        return Response(status_code=499)
    return got


async def _completions(service: Service, request: HTTPRequest):
    """POST /v1/completions: prompts continued as they are (no chat template); echo and logprobs as OpenAI's."""
    body, rows, reqs, q = await _admit(service, request, api_schema.parse_completion_request,
                                       _plan_completion)
    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    gen = service.gen
    table = api_answers.token_table(gen.tokenizer, gen.decoder.dims.vocab_size)
    scored: list = []

    async def score() -> None:  # echo + logprobs: the prompts' own logprobs first (on the scheduler, stepped)
        if rows.score_top is not None:
            scored[:] = await service.run_steps(api_answers.score_steps(gen, rows.prompts, rows.score_top), request)

    async def streamed():
        await score()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return writer.completion_sse(service, cid, created, api_answers.merged_events(reqs, q, len(reqs)), rows,
                                     table, scored, body.logprobs, include_usage, body.n or 1)

    async def whole():
        await score()
        return await _collect(request, q, len(reqs))

    got = await _answer_rows(request, reqs, q, streamed if body.stream else None, whole)
    if isinstance(got, Response):
        return got
    texts, lps, lasts = got
    _failed(service, lasts)
    return writer.text_completion(service, cid, created, texts, lasts, lps, rows, table, scored, body.logprobs,
                                  body.n or 1)


async def _messages(service: Service, request: HTTPRequest):
    """POST /v1/messages: Anthropic's request, translated into the chat request the OpenAI route serves (same
    rows, grammar, conversation path, scheduler), answered in Anthropic's shapes."""
    body, rows, reqs, q = await _admit(service, request, anthropic_schema.parse_messages_request, _plan_messages)
    mid = anthropic_writer.message_id()
    prompt_tokens = len(rows.prompts[0])
    display = body.thinking_display(service.gen.tokenizer.thinking is not None)

    async def streamed():
        return anthropic_writer.messages_sse(service, mid, api_answers.merged_events(reqs, q, 1), rows, prompt_tokens,
                                             display)

    got = await _answer_rows(request, reqs, q, streamed if body.stream else None)
    if isinstance(got, Response):
        return got
    texts, _, lasts = got
    _failed(service, lasts)
    return anthropic_writer.message(service, mid, texts[0], lasts[0], rows, prompt_tokens, display)


def _anthropic_chat(service: Service, body: anthropic_schema.CountTokensRequest):
    """The chat request /v1/messages runs: Anthropic's thinking is off unless asked for (anthropic_schema)."""
    return body.chat(service.gen.tokenizer.thinking is not None)


async def _plan_messages(service: Service, body: anthropic_schema.MessagesRequest):
    chat, answer_start = _anthropic_chat(service, body)
    return await api_answers.chat_rows(service, chat, answer_start=answer_start)


async def _count_tokens(service: Service, request: HTTPRequest):
    """POST /v1/messages/count_tokens: the prompt /v1/messages would run, counted (tools included); a prompt
    longer than the context is counted too (that is what a client asks it for)."""
    async def plan(service: Service, body: anthropic_schema.CountTokensRequest):
        chat, answer_start = _anthropic_chat(service, body)
        return (await api_answers.chat_prompt(service, chat, answer_start)).ids

    _, ids, _, _ = await _admit(service, request, anthropic_schema.parse_count_tokens_request, plan, queue=False)
    return anthropic_writer.token_count(len(ids))


async def _plan_completion(service: Service, body):
    return await asyncio.to_thread(api_answers.completion_rows, service, body)


def _cancel_all(reqs: list[Request]) -> None:
    for r in reqs:
        r.cancel()


async def _collect(request: HTTPRequest, q: asyncio.Queue, n: int):
    """The events of a non-streamed answer's n rows until each has finished: (texts, logprobs, last events),
    or None as soon as the client hangs up."""
    gone = asyncio.ensure_future(_client_gone(request))
    parts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    lasts: list[Any] = [None] * n
    left = n
    try:
        while left:
            nxt = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                return None
            i, ev = nxt.result()
            parts[i].append(ev.text)
            lps[i].extend(getattr(ev, "logprobs", None) or [])
            if ev.finish_reason:
                lasts[i] = ev
                left -= 1
        return ["".join(p) for p in parts], lps, lasts
    finally:
        gone.cancel()


def _model_card(service: Service) -> dict:
    return {"id": service.model_id, "object": "model", "created": int(service.started), "owned_by": "edgechat",
            "precision": service.precision, "backend": service.backend, "context_length": service.gen.max_context,
            "determinism": service.invariance.card()}
