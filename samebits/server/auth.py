"""The API key, checked first (pure ASGI middleware, outside every other check).

With keys set, every request but those to the open paths (``/health``; ``/metrics`` with
``--metrics-public``) needs ``Authorization: Bearer <one of the keys>``; anything else, unknown
paths included, gets 401 from the headers alone: not one body byte is read, and the connection
is closed after the answer (so an unread body is never parsed as a next request).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

UNAUTHORIZED = json.dumps({"error": {
    "message": "invalid or missing API key: send 'Authorization: Bearer <key>'",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_keys: Iterable[str], open_paths: Iterable[str]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in api_keys)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (not self.keys or scope["type"] not in ("http", "websocket")
                or scope["path"] in self.open_paths or self.authorized(scope["headers"])):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(UNAUTHORIZED)).encode()),
            (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": UNAUTHORIZED})

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Exactly one Authorization header, scheme Bearer (any case), token one of the keys;
        compared with every key (no early exit), so timing does not tell which key was close."""
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        matches = [hmac.compare_digest(token.strip(), key) for key in self.keys]
        return scheme.lower() == b"bearer" and any(matches)
