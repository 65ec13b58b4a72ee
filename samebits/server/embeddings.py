"""``POST /v1/embeddings``: texts or token ids -> one vector each, as floats or base64.

One worker thread owns the ``Embedder`` (one call at a time) so the event loop never waits on the
encoder. Requests that arrive while it works are embedded together in its next call: with the
batch-invariant numerics a vector does not depend on what it was batched with, so this batching
policy only changes throughput, never the bits (in ``--standard`` mode it does change them).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from samebits.embedder import Embedder, EmbeddingOutput, EmbedInput
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
MAX_BATCH_INPUTS = 256  # inputs gathered from waiting requests into one embedder call


@dataclass
class _Job:
    inputs: list[EmbedInput]
    truncate: bool | int  # Embedder.tokenize's: True (at the model's limit) or a token count
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


_STOP = object()


class EmbeddingService:
    """The embedding model of a server and the thread that runs it."""

    def __init__(self, embedder: Embedder, model_name: str, metrics: Metrics,
                 max_batch_inputs: int = MAX_BATCH_INPUTS) -> None:
        self.embedder, self.model_name, self.metrics = embedder, model_name, metrics
        self.max_batch_inputs = max_batch_inputs
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
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

    async def embed(self, inputs: list[EmbedInput], truncate: bool | int
                    ) -> list[EmbeddingOutput]:
        """Vectors of the inputs; bad input raises a 400 ``APIError`` naming the input."""
        if not self.alive:
            raise APIError(503, "the embedding worker is not running")
        job = _Job(inputs, truncate)
        self._jobs.put(job)
        return await job.future

    # ---- worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (jobs := self._next_jobs()) is not None:
                try:
                    self._process(jobs)
                except Exception:  # never leave a caller waiting, never stop the worker
                    log.exception("embedding failed; failing its requests")
                    for job in jobs:
                        _settle(job, error=APIError(500, "internal error in the embedder"))
        finally:
            self._fail_queued()

    def _next_jobs(self) -> list[_Job] | None:
        """The next job and whatever else waits, up to ``max_batch_inputs`` inputs; None: stop."""
        job = self._jobs.get()
        if job is _STOP:
            return None
        jobs, count = [job], len(job.inputs)
        while count < self.max_batch_inputs:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                self._jobs.put(_STOP)  # finish this batch, then stop
                break
            jobs.append(job)
            count += len(job.inputs)
        return jobs

    def _process(self, jobs: list[_Job]) -> None:
        ready: list[tuple[_Job, list[list[int]]]] = []
        for job in jobs:
            try:
                ready.append((job, self.embedder.tokenize(job.inputs, job.truncate)))
            except ValueError as e:
                _settle(job, error=input_error(str(e)))
        ids = [seq for _, job_ids in ready for seq in job_ids]
        if not ids:
            return
        outputs = self.embedder.embed_outputs(ids)
        self.metrics.embedding_batch_size.observe(len(ids))
        self.metrics.embedding_inputs.inc(len(ids))
        self.metrics.embedding_tokens.inc(sum(len(seq) for seq in ids))
        start = 0
        for job, job_ids in ready:
            _settle(job, result=outputs[start:start + len(job_ids)])
            start += len(job_ids)

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                _settle(job, error=APIError(503, "the server is shutting down"))


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
async def create_embedding(svc: EmbeddingService, req: EmbeddingRequest) -> EmbeddingResponse:
    arrival = time.monotonic()
    if req.dimensions is not None and req.dimensions != svc.dimension:
        raise APIError(400, f"dimensions={req.dimensions} is not supported: {svc.model_name!r} "
                       f"gives {svc.dimension}-dimensional vectors (omit dimensions)",
                       param="dimensions")
    outputs = await svc.embed(_inputs(req.input), _truncation(svc, req))
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


def _base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI's clients decode (exact for float32)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
