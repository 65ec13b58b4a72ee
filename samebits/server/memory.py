"""Memory given back after a large request.

glibc keeps freed heap memory, in the main arena and in each worker thread's own arena, for later
reuse; so one oversize request (a 16 MB body parsed, refused or tokenized) would leave the
server's resident memory up to hundreds of MB higher for good. ``GiveBackMemory`` (pure ASGI
middleware, safe for streaming) counts each request's body bytes and, after a request of at least
``threshold`` bytes has been answered, runs ``malloc_trim(0)`` in a worker thread: glibc returns
the free memory of every arena to the system. Without glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRIM_AFTER_BYTES = 1 << 20  # bodies at least this large are followed by a trim


def _malloc_trim() -> Callable[[], None] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0) and None


_TRIM = _malloc_trim()
_trimming = threading.Lock()  # one trim at a time; a request arriving during one skips its own


def give_back_memory() -> None:
    """Return glibc's free heap memory to the system (a no-op without glibc)."""
    if _TRIM is not None and _trimming.acquire(blocking=False):
        try:
            _TRIM()
        finally:
            _trimming.release()


class GiveBackMemory:
    def __init__(self, app: ASGIApp, threshold: int = TRIM_AFTER_BYTES) -> None:
        self.app, self.threshold = app, threshold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = 0

        async def counting() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting, send)
        finally:
            if size >= self.threshold:
                await asyncio.to_thread(give_back_memory)
