"""The server's HTTP guards, before a request reaches its route: the error object every refusal uses
(`APIError`: OpenAI's shape, Anthropic's on /v1/messages), API paths spelled another way (`APIPaths`),
credentials (`CheckAuth`). Plain ASGI middlewares: they never touch a response they let through."""

from __future__ import annotations

import base64
import re
import secrets

from fastapi.responses import JSONResponse

from edge.serve import anthropic_writer
from edge.serve.metrics import Metrics


def anthropic_path(path: str) -> bool:
    """Whether a path is Anthropic's Messages API, whose every answer (errors included) is in Anthropic's shape."""
    p = re.sub("/{2,}", "/", path).lower().rstrip("/")
    return p == "/v1/messages" or p.startswith("/v1/messages/")


class APIError(Exception):
    """An error response: OpenAI's {"error": {"message", "type", "param", "code"}}, or on an Anthropic path
    Anthropic's {"type": "error", "error": {"type", "message"}} (edge.serve.anthropic_writer)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_
        self.headers = headers or {}

    def response(self, metrics: Metrics | None = None, path: str = "") -> JSONResponse:
        """The JSON response to a request for `path`; every error response of the server goes through here, so
        /metrics counts it."""
        if anthropic_path(path):
            status, body = anthropic_writer.error(self.status, self.message)
        else:
            status = self.status
            body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        if metrics is not None:
            metrics.http_error(status)
        return JSONResponse(body, status_code=status, headers=self.headers)


class ClientGone(Exception):
    """The client hung up before its request could be read or answered: answered 499 (nobody reads it), not
    logged as an error and not counted as a 5xx."""


class APIPaths:
    """API paths spelled another way (`//v1/models`, `/V1/models`, `/health/`, `/v1`) are a 404 error object
    naming the path to use, instead of falling through to the Gradio page mounted at / (whose 404 is
    `{"detail": ...}`, and which would also bypass the API's own auth check)."""

    def __init__(self, app, metrics: Metrics | None = None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope.get("path", "")
            canon = re.sub("/{2,}", "/", path)
            low = canon.lower()
            api = low == "/v1" or low.startswith("/v1/") or low.rstrip("/") in ("/health", "/metrics")
            exact = path.startswith("/v1/") or path in ("/health", "/metrics")
            if api and not exact:
                want = "/v1/" + canon[4:] if low.startswith("/v1/") else low.rstrip("/")
                hint = f": use {want}" if want not in ("/v1", "/v1/") else ""
                await APIError(404, f"no such API path: {scope.get('method', '')} {path}{hint}",
                               code="not_found").response(self.metrics, path)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CheckAuth:
    """API credentials, checked before a request reaches its route. A plain ASGI middleware: it never
    touches the response, where Starlette's `@app.middleware("http")` would pipe every streamed chunk
    through an extra task (twice the server's CPU per token chunk, measured)."""

    def __init__(self, app, auth: tuple[str, str], metrics: Metrics | None = None) -> None:
        self.app, self.auth, self.metrics = app, auth, metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"").decode("latin-1")
            key = headers.get(b"x-api-key")  # Anthropic's clients send the key here
            if not (_authorized(header, self.auth) or
                    (key is not None and _same_key(key.decode("latin-1"), self.auth))):
                await APIError(401, "missing or wrong credentials: send 'Authorization: Bearer <password>' or "
                                    "'x-api-key: <password>' (the password given to --auth) or HTTP Basic "
                                    "user:password", type_="authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}).response(self.metrics, path)(scope, receive,
                                                                                                    send)
                return
        await self.app(scope, receive, send)


def _same(a: str, b: str) -> bool:
    """Compared as UTF-8 bytes: `secrets.compare_digest` refuses non-ASCII str (a TypeError, i.e. a 500, for
    any client that sends a non-ASCII password or user)."""
    return secrets.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def _same_key(value: str, auth: tuple[str, str]) -> bool:
    """A bearer token or an x-api-key: the password, or user:password."""
    return _same(value.strip(), auth[1]) or _same(value.strip(), ":".join(auth))


def _authorized(header: str, auth: tuple[str, str]) -> bool:
    """An Authorization header: Bearer (as `_same_key`) or HTTP Basic user:password."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return _same_key(value, auth)
    if scheme.lower() == "basic":
        try:
            user, _, pw = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
        except ValueError:  # not base64, or not UTF-8 (UnicodeDecodeError is a ValueError)
            return False
        return _same(user, auth[0]) and _same(pw, auth[1])
    return False
