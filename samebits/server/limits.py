"""The HTTP server's security limits (``samebits serve``), one frozen dataclass checked when it is
built; ``add_cli_args`` declares its flags and ``from_cli_args`` reads them (docs/SECURITY.md
states what each one guarantees and its limit).

- Bodies: at most ``max_request_bytes`` each (413), all bodies held at once at most
  ``max_buffered_bytes`` (503), each read within ``body_timeout_s`` of its headers (408).
- Connections: at most ``max_connections`` open; a new one past it closes the connection that
  has waited longest for its request headers (or idled longest between requests), and when every
  connection is busy with a request, it gets 503 (``/health`` is always answered); a connection
  must deliver its request headers within ``header_timeout_s`` of connecting or of its first
  byte after a response, else it is closed.
- Shutdown: on SIGTERM the server stops accepting, lets running requests finish for
  ``shutdown_grace_s``, then ends the rest with an error event (streams) or an error response.
- Weight updates: only with ``enable_weight_updates``, from directories inside
  ``weight_update_root``, behind the API key unless ``allow_unauthenticated_weight_updates``.
- ``/metrics`` needs the API key (when one is set) unless ``metrics_public``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("samebits.server")
MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 16 * MiB
    max_buffered_bytes: int = 256 * MiB  # request bodies held at once, all connections together
    body_timeout_s: float = 60.0  # from the end of the headers to the end of the body
    header_timeout_s: float = 10.0  # from connecting (or a request's first byte) to its headers
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed after it
    max_connections: int = 1000
    shutdown_grace_s: float = 30.0  # SIGTERM: running requests may finish within it
    metrics_public: bool = False
    enable_weight_updates: bool = False
    weight_update_root: str | None = None  # the real path of the only tree updates may read
    allow_unauthenticated_weight_updates: bool = False
    weight_update_timeout_s: float = 600.0  # reading one update's files

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_buffered_bytes", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("body_timeout_s", "header_timeout_s", "keep_alive_timeout_s",
                     "shutdown_grace_s", "weight_update_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.max_buffered_bytes < self.max_request_bytes:
            raise ValueError(f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least "
                             f"max_request_bytes ({self.max_request_bytes})")
        self._check_weight_updates()

    def _check_weight_updates(self) -> None:
        if not self.enable_weight_updates:
            if self.weight_update_root is not None or self.allow_unauthenticated_weight_updates:
                raise ValueError("--weight-update-root and --allow-unauthenticated-weight-updates "
                                 "go with --enable-weight-updates")
            return
        if self.weight_update_root is None:
            raise ValueError("--enable-weight-updates needs --weight-update-root DIR: the only "
                             "directory tree POST /v1/update_weights may read")
        root = os.path.realpath(self.weight_update_root)
        if not os.path.isdir(root):
            raise ValueError(f"--weight-update-root {self.weight_update_root!r} is not a "
                             "directory")
        object.__setattr__(self, "weight_update_root", root)

    def check_auth(self, api_keys: Sequence[str]) -> None:
        """Weight updates read the server's disk and change every answer: they need an API key,
        unless explicitly allowed without one (a warning then)."""
        if not self.enable_weight_updates or api_keys:
            return
        if not self.allow_unauthenticated_weight_updates:
            raise ValueError("--enable-weight-updates needs an API key (--api-key or "
                             "SAMEBITS_API_KEY): anyone who can reach the port could replace "
                             "the model; pass --allow-unauthenticated-weight-updates to accept "
                             "that")
        log.warning("weight updates are enabled WITHOUT an API key: anyone who can reach the "
                    "port can replace the model's weights (--allow-unauthenticated-weight-updates)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits ``add_cli_args`` declares, with ``--max-request-bytes`` and
        ``--enable-weight-updates`` (declared beside them)."""
        return cls(max_request_bytes=args.max_request_bytes,
                   max_buffered_bytes=args.max_buffered_bytes, body_timeout_s=args.body_timeout,
                   header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                   shutdown_grace_s=args.shutdown_grace_period, metrics_public=args.metrics_public,
                   enable_weight_updates=getattr(args, "enable_weight_updates", False),
                   weight_update_root=args.weight_update_root,
                   allow_unauthenticated_weight_updates=args.allow_unauthenticated_weight_updates,
                   weight_update_timeout_s=args.weight_update_timeout)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``ServerLimits`` (``samebits serve``)."""
    d = ServerLimits()
    p.add_argument("--max-buffered-bytes", type=int, default=d.max_buffered_bytes, metavar="N",
                   help="request bodies held at once, all connections together; past it, 503")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="SECONDS",
                   help="a request body must arrive within this time of its headers, else 408 "
                   "and the connection is closed")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="SECONDS",
                   help="a connection must send its request headers within this time (of "
                   "connecting, or of its first byte after a response), else it is closed")
    p.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open connections; past it the one idle longest is closed, and when all "
                   "are busy new requests get 503 (/health is always answered)")
    p.add_argument("--shutdown-grace-period", type=float, default=d.shutdown_grace_s,
                   metavar="SECONDS", help="on SIGTERM, running requests may finish within this "
                   "time; then each stream ends with an error event and [DONE]")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (it reveals load and fingerprints)")
    p.add_argument("--weight-update-root", default=None, metavar="DIR",
                   help="with --enable-weight-updates (required): the only directory tree "
                   "POST /v1/update_weights may read")
    p.add_argument("--allow-unauthenticated-weight-updates", action="store_true",
                   help="allow --enable-weight-updates without an API key (anyone who can reach "
                   "the port can then replace the model)")
    p.add_argument("--weight-update-timeout", type=float, default=d.weight_update_timeout_s,
                   metavar="SECONDS", help="most time to read one weight update's files")
