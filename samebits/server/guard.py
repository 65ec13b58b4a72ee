"""Checks every HTTP request passes before any route sees it (pure ASGI, safe for streaming).

- A ``POST`` (or ``PUT``/``PATCH``) body must be declared ``application/json`` (media-type
  parameters such as ``; charset=utf-8`` are fine): anything else gets 415 before the body is read,
  so a web page cannot drive the server with a cross-site form post (``text/plain``,
  ``application/x-www-form-urlencoded`` and ``multipart/form-data`` are the types a browser sends
  without a CORS preflight).
- A body over ``max_request_bytes`` gets 413: a declared ``Content-Length`` is checked before
  reading anything, and a chunked body is counted as it arrives and dropped once past the limit,
  so an oversized body is never held whole.

The body is read here (up to the limit) and replayed to the route; after it, ``receive`` passes
through, so routes still see ``http.disconnect`` when the client leaves.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
_BODY_METHODS = {"POST", "PUT", "PATCH"}


class RequestGuard:
    def __init__(self, app: ASGIApp, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
        self.app, self.max_bytes = app, max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        if _media_type(headers.get("content-type", "")) != "application/json":
            return await _error(send, 415, "the request body must be JSON: send 'Content-Type: "
                                "application/json'", "unsupported_media_type")
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await _error(send, 413, self._too_large(), "request_too_large")
        body = await _read_body(receive, self.max_bytes)
        if body is None:
            return await _error(send, 413, self._too_large(), "request_too_large")
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                "(--max-request-bytes)")


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes ``limit`` bytes (the rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
