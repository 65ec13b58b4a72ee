"""``POST /v1/update_weights`` (``samebits serve --enable-weight-updates``): load HF-named
safetensors from a directory on the server's disk and swap them in between requests.

Body ``{"path": "<dir>"}``; answer ``{"system_fingerprint": "<new>"}``. The swap runs on the engine
thread (``AsyncEngine.update_weights``): admission pauses, requests in flight finish on the old
weights, then the new ones go in, so no request ever mixes the two. A missing directory, an
unreadable file or a bad tensor (unknown name, wrong shape or dtype, non-finite) is a 400 naming
it, and the weights stay as they were. Reading server-side paths is why the route exists only with
the flag and sits behind the API key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from samebits.config import ModelFormatError
from samebits.loader import hf
from samebits.server.errors import APIError
from samebits.server.metrics import Metrics
from samebits.server.serving import ServingContext


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


class UpdateWeightsResponse(BaseModel):
    system_fingerprint: str


def read_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors files (single or sharded)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise APIError(400, f"path {path!r} is not a directory on the server", param="path")
    try:
        return list(hf.iter_safetensors(hf.safetensors_files(directory)))
    except ModelFormatError as e:
        raise APIError(400, str(e), param="path") from None


def add_route(router: APIRouter, ctx: ServingContext, metrics: Metrics,
              parse: Callable[[Request, type], Awaitable[UpdateWeightsRequest]]) -> None:
    @router.post("/update_weights")
    async def update_weights(request: Request) -> UpdateWeightsResponse:
        req = await parse(request, UpdateWeightsRequest)
        tensors = await asyncio.to_thread(read_weights, req.path)
        try:
            fingerprint = await ctx.engine.update_weights(tensors)
        except ValueError as e:
            raise APIError(400, str(e), param="path", code="invalid_weights") from None
        except RuntimeError as e:
            raise APIError(409, str(e)) from None
        ctx.fingerprint = fingerprint
        metrics.add_model(ctx.model_name, fingerprint)
        return UpdateWeightsResponse(system_fingerprint=fingerprint)
