"""Checks every HTTP request body passes before any route sees it (pure ASGI, safe for streaming).

- A ``POST`` (or ``PUT``/``PATCH``) body must be declared ``application/json`` (media-type
  parameters such as ``; charset=utf-8`` are fine): anything else gets 415 before the body is read,
  so a web page cannot drive the server with a cross-site form post (``text/plain``,
  ``application/x-www-form-urlencoded`` and ``multipart/form-data`` are the types a browser sends
  without a CORS preflight).
- A body over ``max_request_bytes`` gets 413: a declared ``Content-Length`` is checked before
  reading anything, and a chunked body is counted as it arrives and dropped once past the limit,
  so an oversized body is never held whole.
- A body must arrive within ``body_timeout_s`` (408), and all bodies held at once, by every
  request together, stay within one ``BodyBudget`` (503 with Retry-After past it): slow or
  numerous uploads cannot pin the server's memory. A body's bytes count until its request ends.

The body is read here (up to the limit) and replayed to the route; after it, ``receive`` passes
through, so routes still see ``http.disconnect`` when the client leaves. Every refusal closes the
connection (its unread body is never parsed as a next request).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from samebits.server.limits import ServerLimits

_BODY_METHODS = {"POST", "PUT", "PATCH"}


class BodyBudget:
    """Bytes of request bodies held at once, all requests together (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class _Share:
    """One request's part of the budget, given back when the request ends."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget, self.n = budget, 0

    def take(self, n: int) -> bool:
        if not self.budget.take(n):
            return False
        self.n += n
        return True

    def __enter__(self) -> _Share:
        return self

    def __exit__(self, *exc: object) -> None:
        self.budget.give(self.n)


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


class RequestGuard:
    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits
        self.budget = BodyBudget(limits.max_buffered_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        with _Share(self.budget) as share:
            try:
                body = await self._body(scope, receive, share)
            except _Refused as e:
                return await _error(send, e.status, e.message, e.code, e.headers)
            await self.app(scope, _replay(body, receive), send)

    async def _body(self, scope: Scope, receive: Receive, share: _Share) -> bytes:
        headers = _headers(scope)
        if _media_type(headers.get("content-type", "")) != "application/json":
            raise _Refused(415, "the request body must be JSON: send 'Content-Type: "
                           "application/json'", "unsupported_media_type")
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit()
                                     or int(declared) > self.limits.max_request_bytes):
            raise _Refused(413, self._too_large(), "request_too_large")
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await self._read(receive, share)
        except TimeoutError:
            raise _Refused(408, f"the request body did not arrive within "
                           f"{self.limits.body_timeout_s:g} s (--body-timeout)",
                           "request_timeout") from None

    async def _read(self, receive: Receive, share: _Share) -> bytes:
        """The whole body; refused as soon as it passes the limit or the budget."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            if share.n + len(chunk) > self.limits.max_request_bytes:
                raise _Refused(413, self._too_large(), "request_too_large")
            if not share.take(len(chunk)):
                raise _Refused(503, "the server is busy: too many request bodies are being "
                               "received (--max-buffered-bytes); retry later", "server_busy",
                               ((b"retry-after", b"1"),))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's limit of "
                f"{self.limits.max_request_bytes} bytes (--max-request-bytes)")


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _error(send: Send, status: int, message: str, code: str,
                 extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra]})
    await send({"type": "http.response.body", "body": body})
