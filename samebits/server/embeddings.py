"""``POST /v1/embeddings``: texts or token ids -> one vector each, as floats or base64.

One worker thread owns the ``Embedder`` (one call at a time) so the event loop never waits on the
encoder. Each call embeds at most ``max_batch_inputs`` inputs taken round robin from every request
in flight, so large requests are split and interleaved with small ones, and a request whose client
left is dropped before the next call. With the batch-invariant numerics a vector does not depend
on what it was batched with, so this policy only changes latency, never the bits (in
``--standard`` mode it does change them).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request

from samebits.embedder import Embedder, EmbeddingOutput, EmbedInput
from samebits.server.async_engine import RETRY_AFTER_S
from samebits.server.errors import APIError
from samebits.server.metrics import Metrics
from samebits.server.protocol import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)

log = logging.getLogger("samebits.server")
MAX_BATCH_INPUTS = 32  # inputs per embedder call: the unit of fairness and of cancellation


@dataclass
class _Job:
    inputs: list[EmbedInput]
    truncate: bool | int  # Embedder.tokenize's: True (at the model's limit) or a token count
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    abandoned: bool = False  # set by the event loop when the client left: drop, never finish
    ids: list[list[int]] | None = None  # token ids, filled in by the worker
    outputs: list[EmbeddingOutput] = field(default_factory=list)  # done so far, in order


_STOP = object()


class EmbeddingService:
    """The embedding model of a server and the thread that runs it.

    Each embedder call takes at most ``max_batch_inputs`` inputs, shared round robin among the
    requests in flight (each gets about ``max_batch_inputs / len(active)``), so a small request
    waits about one call behind a large one, and an abandoned request stops within one call.
    Batch-invariant numerics make the split invisible in the vectors.
    """

    def __init__(self, embedder: Embedder, model_name: str, metrics: Metrics,
                 max_batch_inputs: int = MAX_BATCH_INPUTS,
                 max_queued_requests: int | None = None) -> None:
        self.embedder, self.model_name, self.metrics = embedder, model_name, metrics
        self.max_batch_inputs = max_batch_inputs
        self.max_queued_requests = max_queued_requests
        self._in_flight = 0  # event loop only
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._active: list[_Job] = []  # worker thread only, in round-robin order
        self._thread: threading.Thread | None = None

    @property
    def fingerprint(self) -> str:
        return self.embedder.fingerprint

    @property
    def max_len(self) -> int:
        return self.embedder.max_len

    @property
    def dimension(self) -> int:
        return self.embedder.model_config.hidden_size

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="samebits-embed", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def embed(self, inputs: list[EmbedInput], truncate: bool | int,
                    disconnected: Awaitable[None] | None = None) -> list[EmbeddingOutput]:
        """Vectors of the inputs; bad input raises a 400 ``APIError`` naming the input. When
        ``disconnected`` completes first, the work is dropped and a 499 raised."""
        if not self.alive:
            raise APIError(503, "the embedding worker is not running")
        limit = self.max_queued_requests
        if limit is not None and self._in_flight >= max(limit, 1):
            raise APIError(503, f"the server is busy: {self._in_flight} embedding requests in "
                           f"flight (limit {limit}, --max-queued-requests); retry later",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        job = _Job(inputs, truncate)
        self._in_flight += 1
        self._jobs.put(job)
        try:
            return await _first(job.future, disconnected)
        finally:
            self._in_flight -= 1
            if not job.future.done():
                job.abandoned = True
                job.future.cancel()

    # ---- worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_jobs():
                batch = self._next_batch()
                try:
                    self._process(batch)
                except Exception:  # never leave a caller waiting, never stop the worker
                    log.exception("embedding failed; failing its requests")
                    for job, _ in batch:
                        self._finish(job, error=APIError(500, "internal error in the embedder"))
        finally:
            self._fail_queued()

    def _take_jobs(self) -> bool:
        """Move newly submitted jobs into the rotation (waiting when idle); False: stop."""
        block = not self._active
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if job is _STOP:
                return False
            block = False
            self._active.append(job)
            self._tokenize(job)

    def _tokenize(self, job: _Job) -> None:
        try:
            job.ids = self.embedder.tokenize(job.inputs, job.truncate)
        except ValueError as e:
            self._finish(job, error=input_error(str(e)))
        except Exception:  # never leave a caller waiting, never stop the worker
            log.exception("tokenization failed; failing its request")
            self._finish(job, error=APIError(500, "internal error in the embedder"))

    def _next_batch(self) -> list[tuple[_Job, int]]:
        """(job, number of its next inputs) for one embedder call, round robin: every job in
        flight gets an equal share of ``max_batch_inputs`` (at least one input)."""
        for job in [j for j in self._active if j.abandoned]:
            self._active.remove(job)
        batch, room = [], self.max_batch_inputs
        share = -(-room // max(len(self._active), 1))
        for job in list(self._active):
            if room == 0:
                break
            assert job.ids is not None
            take = min(share, len(job.ids) - len(job.outputs), room)
            batch.append((job, take))
            room -= take
        served = len(batch)  # the next call starts with the first job not served in this one
        self._active = self._active[served:] + self._active[:served]
        return batch

    def _process(self, batch: list[tuple[_Job, int]]) -> None:
        ids = [seq for job, take in batch for seq in _next_ids(job, take)]
        if not ids:
            return
        outputs = self.embedder.embed_outputs(ids)
        self.metrics.embedding_batch_size.observe(len(ids))
        self.metrics.embedding_inputs.inc(len(ids))
        self.metrics.embedding_tokens.inc(sum(len(seq) for seq in ids))
        start = 0
        for job, take in batch:
            job.outputs.extend(outputs[start:start + take])
            start += take
            if job.ids is not None and len(job.outputs) == len(job.ids):
                self._finish(job, result=job.outputs)

    def _finish(self, job: _Job, result: list[EmbeddingOutput] | None = None,
                error: APIError | None = None) -> None:
        if job in self._active:
            self._active.remove(job)
        _settle(job, result, error)

    def _fail_queued(self) -> None:
        for job in self._active:
            _settle(job, error=APIError(503, "the server is shutting down"))
        self._active.clear()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                _settle(job, error=APIError(503, "the server is shutting down"))


def _next_ids(job: _Job, take: int) -> list[list[int]]:
    assert job.ids is not None
    done = len(job.outputs)
    return job.ids[done:done + take]


async def _first(future: asyncio.Future, disconnected: Awaitable[None] | None) -> Any:
    """The future's result, or a 499 if ``disconnected`` completes first."""
    if disconnected is None:
        return await future
    watcher = asyncio.ensure_future(disconnected)
    try:
        done, _ = await asyncio.wait({future, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if future not in done:
            raise APIError(499, "client disconnected")
        return future.result()
    finally:
        watcher.cancel()


def _settle(job: _Job, result: list[EmbeddingOutput] | None = None,
            error: APIError | None = None) -> None:
    def apply() -> None:
        if job.future.done():  # the caller went away
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(apply)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def input_error(message: str) -> APIError:
    code = "context_length_exceeded" if "over the model's limit" in message else None
    message = message.replace("truncate=True", '"truncate": true (or "truncate_prompt_tokens")')
    return APIError(400, message, param="input", code=code)


# ---- the endpoint ---------------------------------------------------------------------------
async def create_embedding(svc: EmbeddingService, req: EmbeddingRequest,
                           request: Request | None = None) -> EmbeddingResponse:
    """The response; a client that disconnects first abandons the work (a 499, not a 200)."""
    arrival = time.monotonic()
    if req.dimensions is not None and req.dimensions != svc.dimension:
        raise APIError(400, f"dimensions={req.dimensions} is not supported: {svc.model_name!r} "
                       f"gives {svc.dimension}-dimensional vectors (omit dimensions)",
                       param="dimensions")
    inputs, truncate = _inputs(req.input), _truncation(svc, req)  # 400s before any waiting
    disconnected = None if request is None else _wait_disconnect(request)
    outputs = await svc.embed(inputs, truncate, disconnected)
    encode = _base64 if req.encoding_format == "base64" else list
    data = [EmbeddingData(index=i, embedding=encode(o.embedding)) for i, o in enumerate(outputs)]
    tokens = sum(o.num_tokens for o in outputs)
    svc.metrics.embedding_latency.observe(time.monotonic() - arrival)
    return EmbeddingResponse(data=data, model=svc.model_name, system_fingerprint=svc.fingerprint,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _truncation(svc: EmbeddingService, req: EmbeddingRequest) -> bool | int:
    k = req.truncate_prompt_tokens
    if k is None or k == -1:
        return req.truncate or k == -1
    if not 0 < k <= svc.max_len:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or from 1 to the model's limit of "
                       f"{svc.max_len} tokens, got {k}", param="truncate_prompt_tokens")
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


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI's clients decode (exact for float32)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
