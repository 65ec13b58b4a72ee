"""The server's side of the engine: requests go to the engine core, outputs come back to the event
loop, one hand-over per engine step.

The engine core (samebits.server.engine_core) owns the ``LLMEngine`` and steps it. It runs in a
process of its own when the app is given an ``EngineProcess`` (``samebits serve``), or in a thread
of this process when it is given an ``LLMEngine`` (tests, embedding in other programs); both
behave the same. Each ``CoreOutputs`` (admission replies, the step's deltas, statistics) reaches
the event loop in one ``call_soon_threadsafe`` and is dispatched there: replies resolve waiting
submissions, each delta goes to its request group's queue, the statistics to the metrics. An HTTP
request is a ``RequestGroup`` of engine requests, one per choice, submitted all or nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from samebits.engine.engine import LLMEngine
from samebits.pooling_params import PoolingParams
from samebits.sampling_params import SamplingParams
from samebits.server.core_messages import (
    IDLE_CHECK_S,
    Abort,
    AddGroup,
    Admitted,
    CoreOutputs,
    CoreStats,
    Delta,
    Stop,
    UpdateWeights,
    WeightsUpdated,
)
from samebits.server.engine_core import NOT_RUNNING, EngineCore
from samebits.server.engine_process import EngineProcess, model_bytes
from samebits.server.metrics import Metrics

__all__ = ["RETRY_AFTER_S", "AsyncEngine", "Delta", "QueueFull", "RequestGroup"]
RETRY_AFTER_S = 1  # what a 503 past the queue limit tells the client


@dataclass
class RequestGroup:
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams | PoolingParams]  # the request's, unseeded per candidate
    seed_offsets: list[int]  # candidate index: request j is seeded choice_seed(seed, this)
    stream: bool  # deliver every step's tokens, not only the final output
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    score_only: bool = False  # teacher-forced prompt logprobs, nothing generated (max_tokens 0)
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    seed: int | None = None  # the request's seed, given or drawn at admission (engine.fanout)
    seeds: list[int] = field(default_factory=list)  # per request, filled in at admission
    cached_tokens: list[int] = field(default_factory=list)  # per request, set when it finishes
    prompt_logprobs: list = field(default_factory=list)  # per request (PromptLogprobs | None), same


class _ThreadCore:
    """The engine core on a thread of this process (``EngineProcess``'s interface)."""

    def __init__(self, engine: LLMEngine, canary_rate: float) -> None:
        self.core = EngineCore(engine, canary_rate)  # checks the rate now
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, deliver) -> None:
        def run() -> None:
            try:
                self.core.run(_QueueInbox(self._commands), deliver)
            finally:
                deliver(None)
        self._thread = threading.Thread(target=run, name="samebits-engine", daemon=True)
        self._thread.start()

    def send(self, command: Any) -> None:
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        self._commands.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout)


class _QueueInbox:
    def __init__(self, commands: queue.SimpleQueue) -> None:
        self.commands = commands

    def get(self, block: bool) -> Any:
        try:
            return self.commands.get(block=block, timeout=IDLE_CHECK_S if block else None)
        except queue.Empty:
            return None

    def pending(self) -> bool:
        return not self.commands.empty()


class AsyncEngine:
    """Submit request groups, abort them, swap weights; every method runs on the event loop
    except ``stop`` (any thread)."""

    def __init__(self, engine: LLMEngine | EngineProcess, metrics: Metrics,
                 max_queued_requests: int | None = None, canary_rate: float = 0.0) -> None:
        if not 0.0 <= canary_rate <= 1.0:
            raise ValueError(f"canary rate must be in [0, 1], got {canary_rate!r}")
        self.engine = engine
        self.metrics = metrics
        self.canary_rate = canary_rate
        self.max_queued_requests = max_queued_requests
        self._core: _ThreadCore | EngineProcess | None = None
        if isinstance(engine, LLMEngine):
            self._thread_core = _ThreadCore(engine, canary_rate)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued = 0  # engine requests submitted and not yet running
        self._groups: dict[str, tuple[RequestGroup, int]] = {}  # request id -> (group, index)
        self._admissions: dict[int, tuple[asyncio.Future, RequestGroup]] = {}
        self._updates: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._error: str | None = None  # why the core takes no work (set by the core)
        self._stopped = False
        total = (engine.kv_blocks_total if isinstance(engine, EngineProcess)
                 else engine.stats().kv_blocks_total)
        metrics.kv_blocks_total.set(total)

    # ---- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the core; outputs are dispatched on the running event loop."""
        self._loop = asyncio.get_running_loop()
        if isinstance(self.engine, EngineProcess):
            self._core = self.engine
            self._core.start(self.canary_rate, self._deliver)
        else:
            self._core = self._thread_core
            self._core.start(self._deliver)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the core (what runs or waits fails); safe to call twice, from any thread."""
        core, self._core = self._core, None
        self._stopped = True
        if core is not None:
            core.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._core is not None and self._core.alive

    @property
    def model_bytes(self) -> int:
        """Bytes of the served model's weights (rank 0's under tensor parallel)."""
        engine = self.engine
        return engine.model_bytes if isinstance(engine, EngineProcess) else model_bytes(engine)

    @property
    def error(self) -> str | None:
        """Why the engine takes no work (a step failed, or the core stopped); None while it
        does."""
        if self._error is None and self._core is not None and not self._core.alive:
            return self._stopped_message
        return self._error

    @property
    def _stopped_message(self) -> str:
        where = "thread" if isinstance(self.engine, LLMEngine) else "process"
        return f"the engine {where} stopped"

    def _check_running(self) -> None:
        if self._stopped or not self.alive or self._error is not None:
            raise RuntimeError(self.error or NOT_RUNNING)

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, group: RequestGroup) -> None:
        """Queue the group's requests; raises the engine's ``ValueError`` if one is invalid and
        ``QueueFull`` past ``max_queued_requests`` (a group is admitted whole into an empty
        queue, so any group can run)."""
        self._check_running()
        self._reserve(len(group.request_ids))
        group_id, done = next(self._ids), self._loop.create_future()
        self._admissions[group_id] = (done, group)
        self._groups.update((rid, (group, i)) for i, rid in enumerate(group.request_ids))
        self._core.send(AddGroup(group_id, group.request_ids, group.prompts, group.params,
                                 group.seed_offsets, group.stream, group.cache_salt,
                                 group.score_only, group.arrival))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(group.request_ids)
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (idempotent: finished or unknown ids are ignored)."""
        for request_id in request_ids:
            self._groups.pop(request_id, None)
        core = self._core
        if core is not None and core.alive:
            try:
                core.send(Abort(list(request_ids)))
            except RuntimeError:  # the engine process is gone: nothing left to abort
                pass

    async def update_weights(self, tensors: list) -> str:
        """Swap weights between requests: admission pauses, the requests in flight finish on the
        old weights, the engine swaps, admission resumes; so no request mixes old and new weights.
        Returns the new fingerprint; raises the engine's ``ValueError`` for a bad tensor."""
        self._check_running()
        call_id, done = next(self._ids), self._loop.create_future()
        self._updates[call_id] = done
        self._core.send(UpdateWeights(call_id, tensors))
        return await done

    def _reserve(self, n: int) -> None:
        limit = self.max_queued_requests
        if limit is not None and self._queued > 0 and self._queued + n > limit:
            raise QueueFull(self._queued, limit)
        self._queued += n

    # ---- outputs (on the event loop) ----------------------------------------------------------
    def _deliver(self, outputs: CoreOutputs | None) -> None:
        """From the core's side: hand ``outputs`` (None: the core is gone) to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: CoreOutputs | None) -> None:
        if outputs is None:
            return self._core_gone()
        for reply in outputs.replies:
            if isinstance(reply, Admitted):
                self._admitted(reply)
            else:
                self._weights_updated(reply)
        groups = self._groups
        for request_id, token_ids, logprobs, top, text, prompt_lps in outputs.tokens:
            if (entry := groups.get(request_id)) is not None:  # else aborted: its caller left
                group, index = entry
                group.queue.put_nowait(Delta(index, token_ids, logprobs, top, text=text,
                                             prompt_logprobs=prompt_lps))
        for request_id, delta in outputs.last:
            if (entry := groups.pop(request_id, None)) is not None:
                group = entry[0]
                if delta.output is not None:
                    group.cached_tokens[delta.index] = delta.cached_tokens
                    group.prompt_logprobs[delta.index] = delta.prompt_logprobs
                group.queue.put_nowait(delta)
        self._record(outputs.stats)

    def _admitted(self, reply: Admitted) -> None:
        done, group = self._admissions.pop(reply.group_id)
        if reply.error is not None:
            for request_id in group.request_ids:
                self._groups.pop(request_id, None)
            if not done.done():
                done.set_exception(reply.error)
            return
        n = len(group.request_ids)
        group.seeds, group.cached_tokens, group.prompt_logprobs = reply.seeds, [0] * n, [None] * n
        group.seed = reply.seed
        if not done.done():
            done.set_result(None)

    def _weights_updated(self, reply: WeightsUpdated) -> None:
        done = self._updates.pop(reply.call_id)
        if done.done():
            return
        if reply.error is not None:
            done.set_exception(reply.error)
        else:
            done.set_result(reply.fingerprint)

    def _record(self, stats: CoreStats) -> None:
        m = self.metrics
        self._queued -= stats.dequeued
        self._error = stats.error
        if stats.prompt_tokens:
            m.prompt_tokens.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            m.generation_tokens.inc(stats.generation_tokens)
        for name, values in (("batch_size", stats.batch_sizes), ("ttft", stats.ttft),
                             ("itl", stats.itl), ("e2e", stats.e2e),
                             ("queue_time", stats.queue_time),
                             ("prefill_time", stats.prefill_time),
                             ("decode_time", stats.decode_time),
                             ("inference_time", stats.inference_time),
                             ("iteration_tokens", stats.iteration_tokens)):
            for value in values:  # an embedding loop's metrics have no token latencies
                getattr(m, name).observe(value)
        if stats.preemptions:
            m.preemptions.inc(stats.preemptions)
        for reason, count in stats.finished.items():
            m.finished.labels(reason=reason).inc(count)
        for name in ("canary_checks", "canary_mismatches", "canary_dropped"):
            if count := getattr(stats, name):
                getattr(m, name).inc(count)
        m.set_engine_state(stats.running, stats.waiting, stats.kv_blocks_used)

    def _core_gone(self) -> None:
        """The core stopped: whatever still waits for it fails."""
        self._error = self._error or self._stopped_message
        for done, _ in self._admissions.values():
            if not done.done():
                done.set_exception(RuntimeError(self._error))
        for done in self._updates.values():
            if not done.done():
                done.set_exception(RuntimeError(self._error))
        self._admissions.clear()
        self._updates.clear()
        for group in {id(g): g for g, _ in self._groups.values()}.values():
            group.queue.put_nowait(Delta(0, [], [], [], error="the engine stopped"))
        self._groups.clear()


class QueueFull(Exception):
    """More requests wait than ``--max-queued-requests`` allows: the caller answers 503."""

    def __init__(self, queued: int, limit: int) -> None:
        super().__init__(f"the server is busy: {queued} requests are queued (limit {limit}, "
                         "--max-queued-requests); retry later")
