"""Why one request failed alone (the engine finishes it with ``finish_reason="error"``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestError:
    """Why one request failed alone. ``invalid_request``: its own input made it fail (its output
    constraint can no longer be met), not the server."""

    message: str
    invalid_request: bool = False
