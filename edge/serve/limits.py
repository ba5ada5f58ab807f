"""What one connection may hold of the server: how long its headers and body may take, how large its body may
be, how many connections may be open. uvicorn has the connection cap (`limit_concurrency`: a 503 beyond it)
but no read timeouts (its keep-alive timer runs only between requests), so the header timeout is a small
subclass of its h11 protocol and the body is read here, under a deadline and the size limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("edgechat")

MAX_BODY = 4 * 1024 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """The flags `edge-chat serve --header-timeout --body-timeout --max-connections`, with safe defaults."""

    header_timeout_s: float = 10.0  # request line + headers, from connect (or the last answer on a kept-alive one)
    body_timeout_s: float = 30.0  # the whole body, from the end of the headers (4 MiB at ~140 KB/s)
    max_connections: int = 128  # open connections (the page holds a few per user); beyond: 503
    max_body: int = MAX_BODY

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.max_connections >= 1
                and self.max_body >= 1):
            raise ValueError(f"connection limits must be positive, got {self}")


DRAIN_FACTOR = 4  # a body declared over the limit but under 4x it is read and dropped before the 413 (see read_body)


class BodyRefused(Exception):
    """A body that is refused while reading: 413 (too large, said up front or found while reading) or 408
    (not sent in time); `close`: the connection cannot be reused (its body was not read)."""

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.close = status, message, close


async def _drain(request, deadline: float) -> None:
    """Read and drop the rest of a body until it ends or `deadline` passes."""
    chunks = request.stream().__aiter__()
    while True:
        try:
            await asyncio.wait_for(chunks.__anext__(), timeout=max(deadline - time.monotonic(), 0.001))
        except (StopAsyncIteration, asyncio.TimeoutError):
            return


async def read_body(request, limits: ConnectionLimits) -> bytes:
    """The request's body, refused (BodyRefused) before reading when its Content-Length is over the limit,
    while reading when more arrives than the limit, and when it is not whole within body_timeout_s.
    A hang-up raises starlette's ClientDisconnect."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise BodyRefused(400, f"Content-Length must be a number of bytes, got {length[:40]!r}")
        if int(length) > limits.max_body:
            message = f"request body is {int(length)} bytes (Content-Length); the limit is {limits.max_body}"
            if int(length) > DRAIN_FACTOR * limits.max_body:  # refused before reading: the connection closes
                raise BodyRefused(413, message, close=True)
            # a client that sends its body at once (most do) reads the 413 only if the body was taken first (a
            # close with unread data resets the connection): a body up to DRAIN_FACTOR x the limit is read
            # and dropped, under the body timeout
            await _drain(request, time.monotonic() + limits.body_timeout_s)
            raise BodyRefused(413, message)
    deadline = time.monotonic() + limits.body_timeout_s
    parts, size = [], 0
    chunks = request.stream().__aiter__()
    while True:
        left = deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), timeout=max(left, 0.001))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyRefused(408, f"the request body was not sent within {limits.body_timeout_s:g} s "
                                   "(--body-timeout)", close=True) from None
        size += len(chunk)
        if size > limits.max_body:
            raise BodyRefused(413, f"request body is over {limits.max_body} bytes, the limit", close=True)
        parts.append(chunk)
    return b"".join(parts)


def timed_h11_protocol(limits: ConnectionLimits):
    """uvicorn's h11 protocol, closing a connection whose request line and headers are not whole within
    header_timeout_s of its start (or of its previous answer): a slow-loris client holds nothing for long."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            if self.conn.their_state == h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection from %s: no whole request headers within %g s (--header-timeout)",
                         self.client, limits.header_timeout_s)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_timer.cancel()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return TimedH11Protocol
