"""``POST /v1/embeddings``: texts or token ids -> one vector each, as floats or base64.

Each input is a pooling request of the embedding model's engine, driven by an ``AsyncEngine`` like
the generation model's (a server with both runs two engine loops). Inputs are tokenized off the
event loop, then submitted in slices of the engine's ``max_num_seqs`` inputs, at most two slices
of a request in the engine at once: the engine batches what is queued (inputs of several requests
in one step), concurrent requests interleave slice by slice so a small one waits for at most two
slices of a large one, and a request whose client left is aborted within a step. With the
batch-invariant numerics a vector does not depend on what it was batched with, so none of this
changes the bits (in ``--standard`` mode it does).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request

from samebits.engine.engine import LLMEngine
from samebits.engine.pooling import PoolingOutput, embedding_inputs
from samebits.pooling_params import PoolingParams
from samebits.server.async_engine import AsyncEngine, RequestGroup
from samebits.server.errors import APIError
from samebits.server.metrics import Metrics
from samebits.server.protocol import MAX_EMBEDDING_INPUTS
from samebits.server.protocol_embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from samebits.server.serving import new_id, submit
from samebits.text.embedding_inputs import EmbeddingInputs, EmbedInput

SLICES_IN_FLIGHT = 2  # slices of one request in the engine at once: the next is queued in time


class EmbeddingEngineMetrics:
    """What an ``AsyncEngine`` reports, for the embedding model's loop: tokens admitted count in
    ``samebits_embedding_tokens``, inputs per engine step in ``samebits_embedding_batch_size``,
    finished inputs in ``samebits_embedding_inputs``; the engine gauges, token latencies and the
    canary are the generation model's, so this loop leaves them alone."""

    def __init__(self, metrics: Metrics) -> None:
        self.prompt_tokens = metrics.embedding_tokens
        self.batch_size = metrics.embedding_batch_size
        self.finished = _FinishedInputs(metrics)
        self.kv_blocks_total = self.preemptions = _Unreported()
        self.queue_time = self.prefill_time = self.decode_time = _Unreported()
        self.inference_time = self.iteration_tokens = _Unreported()

    def set_engine_state(self, running: int, waiting: int, kv_blocks: int) -> None:
        """The generation model's gauges: not set from here."""


class _Unreported:
    """A metric of the generation model's, not reported by the embedding loop."""

    def set(self, value: float) -> None: ...

    def inc(self, amount: float = 1) -> None: ...

    def observe(self, value: float) -> None: ...


class _FinishedInputs:
    """``finished.labels(reason=...).inc()``: an input counts as embedded unless it was aborted
    or failed."""

    def __init__(self, metrics: Metrics) -> None:
        self._inputs = metrics.embedding_inputs

    def labels(self, reason: str) -> Any:
        return _Unreported() if reason in ("abort", "error") else self._inputs


@dataclass
class EmbeddingContext:
    """The embedding model of a server: its engine loop, how it tokenizes, what it reports."""

    engine: AsyncEngine
    model_name: str
    inputs: EmbeddingInputs
    fingerprint: str
    dimension: int
    slice_inputs: int  # inputs per engine submission (the engine's max_num_seqs)
    metrics: Metrics

    @classmethod
    def serve(cls, engine: LLMEngine, model_name: str, metrics: Metrics,
              max_queued_requests: int | None = None) -> EmbeddingContext:
        """The context over ``engine`` (an embedding model's), with its own engine loop."""
        loop = AsyncEngine(engine, EmbeddingEngineMetrics(metrics), max_queued_requests)
        return cls(loop, model_name, embedding_inputs(engine.loaded), engine.fingerprint,
                   engine.loaded.model_config.hidden_size, engine.config.max_num_seqs, metrics)

    @property
    def max_len(self) -> int:
        return self.inputs.max_len

    @property
    def alive(self) -> bool:
        return self.engine.alive


async def embed_ids(ctx: EmbeddingContext, ids: list[list[int]], request: Request | None = None
                    ) -> list[list[float]]:
    """The vector of each token id list, in order (module docstring: slices, at most
    ``SLICES_IN_FLIGHT`` in the engine). A client that disconnects first aborts the work: 499."""
    prefix, size = new_id("embd"), ctx.slice_inputs
    vectors: list[list[float]] = []
    in_engine: list[RequestGroup] = []
    watcher = asyncio.ensure_future(_wait_disconnect(request)) if request is not None else None
    try:
        for start in range(0, len(ids), size):
            group = _group(f"{prefix}-{start}", ids[start:start + size])
            await submit(ctx, group)
            in_engine.append(group)
            if len(in_engine) == SLICES_IN_FLIGHT:
                vectors += await _vectors(in_engine[0], watcher)
                in_engine.pop(0)
        while in_engine:
            vectors += await _vectors(in_engine[0], watcher)
            in_engine.pop(0)
        return vectors
    finally:
        if watcher is not None:
            watcher.cancel()
        for group in in_engine:  # a departed client, or an error: nothing more runs for it
            ctx.engine.abort(group.request_ids)


def _group(prefix: str, ids: list[list[int]]) -> RequestGroup:
    return RequestGroup([f"{prefix}-{i}" for i in range(len(ids))], ids,
                        [PoolingParams()] * len(ids), [0] * len(ids), stream=False)


async def _vectors(group: RequestGroup, watcher: asyncio.Future | None) -> list[list[float]]:
    """The group's vectors in order; a 499 if ``watcher`` (the client left) completes first."""
    vectors: list[list[float] | None] = [None] * len(group.request_ids)
    for _ in vectors:
        delta = await _first(group.queue.get(), watcher)
        if delta.error is not None:
            raise APIError(500, delta.error)
        assert isinstance(delta.output, PoolingOutput)
        vectors[delta.index] = delta.output.embedding
    return vectors


async def _first(work, watcher: asyncio.Future | None):
    """``work``'s result, or a 499 if ``watcher`` completes first."""
    if watcher is None:
        return await work
    if watcher.done():  # checked first: results already queued must not hide a departure
        work.close()
        raise APIError(499, "client disconnected")
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        raise APIError(499, "client disconnected")
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def input_error(message: str) -> APIError:
    code = "context_length_exceeded" if "over the model's limit" in message else None
    message = message.replace("truncate=True", '"truncate": true (or "truncate_prompt_tokens")')
    return APIError(400, message, param="input", code=code)


# ---- the endpoint ---------------------------------------------------------------------------
async def create_embedding(ctx: EmbeddingContext, req: EmbeddingRequest,
                           request: Request | None = None) -> EmbeddingResponse:
    """The response; a client that disconnects first abandons the work (a 499, not a 200)."""
    arrival = time.monotonic()
    if req.dimensions is not None and req.dimensions != ctx.dimension:
        raise APIError(400, f"dimensions={req.dimensions} is not supported: {ctx.model_name!r} "
                       f"gives {ctx.dimension}-dimensional vectors (omit dimensions)",
                       param="dimensions")
    items, truncate = _inputs(req.input), _truncation(ctx, req)
    try:  # off the event loop: tokenizers releases the GIL
        ids = await asyncio.to_thread(ctx.inputs.tokenize, items, truncate)
    except ValueError as e:
        raise input_error(str(e)) from None
    vectors = await embed_ids(ctx, ids, request)
    encode = _base64 if req.encoding_format == "base64" else list
    data = [EmbeddingData(index=i, embedding=encode(v)) for i, v in enumerate(vectors)]
    tokens = sum(len(i) for i in ids)
    ctx.metrics.embedding_latency.observe(time.monotonic() - arrival)
    return EmbeddingResponse(data=data, model=ctx.model_name, system_fingerprint=ctx.fingerprint,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _truncation(ctx: EmbeddingContext, req: EmbeddingRequest) -> bool | int:
    k = req.truncate_prompt_tokens
    if k is None or k == -1:
        return req.truncate or k == -1
    if not 0 < k <= ctx.max_len:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or from 1 to the model's limit of "
                       f"{ctx.max_len} tokens, got {k}", param="truncate_prompt_tokens")
    return k


def _inputs(value: str | list) -> list[EmbedInput]:
    """One input per string or token-id list (a flat id list is one input)."""
    if isinstance(value, str):
        items: list[EmbedInput] = [value]
    elif not value:
        raise APIError(400, "input is an empty list", param="input")
    elif len(value) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"input has {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per "
                       "request", param="input")
    else:
        items = [value] if isinstance(value[0], int) else list(value)
    return items


def _base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI's clients decode (exact for float32)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
