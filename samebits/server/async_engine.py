"""The engine loop: one thread owns the ``LLMEngine``; the event loop talks to it through queues.

Requests enter and leave through a thread-safe command queue; the thread steps the engine while
there is work and hands each request's progress to an asyncio queue on the caller's event loop.
Only this thread touches the engine (it is not thread-safe). An HTTP request is a ``RequestGroup``
of engine requests, one per choice, submitted all or nothing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from samebits.engine.engine import LLMEngine
from samebits.engine.fanout import seed_requests
from samebits.engine.sequence import Sequence, SequenceStatus
from samebits.outputs import CompletionOutput
from samebits.sampling_params import SamplingParams
from samebits.server.canary import Canary
from samebits.server.metrics import Metrics

log = logging.getLogger("samebits.server")


@dataclass(frozen=True)
class Delta:
    """New tokens of one engine request; ``output`` is set on its last delta."""

    index: int  # the request's position in its group
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    output: CompletionOutput | None = None  # the request's result (one choice)
    error: str | None = None  # the engine failed; the request is gone
    text: str = ""  # new output text a stream may send (engine.output_processor.stream_text)


@dataclass
class RequestGroup:
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]  # the request's, unseeded per candidate
    seed_offsets: list[int]  # candidate index: request j is seeded choice_seed(seed, this)
    stream: bool  # deliver every step's tokens, not only the final output
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    score_only: bool = False  # teacher-forced prompt logprobs, nothing generated (max_tokens 0)
    arrival: float = field(default_factory=time.monotonic)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    seed: int | None = None  # the request's seed, given or drawn at admission (engine.fanout)
    seeds: list[int] = field(default_factory=list)  # per request, filled in at admission
    cached_tokens: list[int] = field(default_factory=list)  # per request, set when it finishes
    prompt_logprobs: list = field(default_factory=list)  # per request (PromptLogprobs | None), same


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    seq: Sequence
    seen: int = 0  # tokens counted in the metrics
    sent: int = 0  # tokens delivered to the caller
    last_token: float = 0.0
    queued: bool = False  # counted in AsyncEngine._queued (until it first runs or leaves)


@dataclass(frozen=True)
class _Add:
    group: RequestGroup
    done: Future


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _UpdateWeights:
    tensors: list  # (HF name, tensor) pairs
    done: Future  # -> the new fingerprint


_STOP = object()
RETRY_AFTER_S = 1  # what a 503 past the queue limit tells the client


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics,
                 max_queued_requests: int | None = None, canary_rate: float = 0.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.canary = Canary(canary_rate, metrics, engine.config.seed)
        self.max_queued_requests = max_queued_requests
        self._queued = 0  # engine requests submitted and not yet running (under _lock)
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._error: str | None = None  # set when a step fails (see ``error``)
        self._update: _UpdateWeights | None = None  # engine thread only: a swap waiting to drain
        self._held: list[_Add] = []  # requests that arrived while it waits (admitted after)
        metrics.kv_blocks_total.set(engine.stats().kv_blocks_total)

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="samebits-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (what runs or waits fails); safe to call twice, from any thread."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._commands.put(_STOP)
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> str | None:
        """Why the engine cannot step (its thread died, or a step failed: its state is unknown,
        so it takes no new work until the server restarts); None while it can."""
        if self._error is None and self._thread is not None and not self._thread.is_alive():
            return "the engine thread stopped"
        return self._error

    async def submit(self, group: RequestGroup) -> None:
        """Queue the group's requests; raises the engine's ``ValueError`` if one is invalid and
        ``QueueFull`` past ``max_queued_requests`` (a group is admitted whole into an empty
        queue, so any group can run)."""
        if self._stopped or not self.alive or self._error is not None:
            raise RuntimeError(self.error or "the engine loop is not running")
        self._reserve(len(group.request_ids))
        done: Future = Future()
        self._commands.put(_Add(group, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(group.request_ids)
            raise

    async def update_weights(self, tensors: list) -> str:
        """Swap weights between requests: admission pauses, the requests in flight finish on the
        old weights, the engine swaps, admission resumes; so no request mixes old and new weights.
        Returns the new fingerprint; raises the engine's ``ValueError`` for a bad tensor."""
        if self._stopped or not self.alive or self._error is not None:
            raise RuntimeError(self.error or "the engine loop is not running")
        done: Future = Future()
        self._commands.put(_UpdateWeights(tensors, done))
        return await asyncio.wrap_future(done)

    def _reserve(self, n: int) -> None:
        with self._lock:
            limit = self.max_queued_requests
            if limit is not None and self._queued > 0 and self._queued + n > limit:
                raise QueueFull(self._queued, limit)
            self._queued += n

    def _release(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (idempotent: finished or unknown ids are ignored)."""
        self._commands.put(_Abort(list(request_ids)))

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain_commands(block=not self._has_work()):
                if self.engine.has_unfinished():
                    self._step()
                elif self._update is not None:
                    self._swap_weights()
                elif self.canary.pending:  # idle: replay one request alone
                    self.canary.replay(self.engine, busy=lambda: not self._commands.empty())
                self._report_state()
        except BaseException:
            log.exception("the engine loop failed")
            raise
        finally:
            self._shut_down()

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or self._update is not None or self.canary.pending

    def _shut_down(self) -> None:
        """Fail what is in flight and what is still queued: no caller waits forever."""
        self._stopped = True
        for request_id in list(self._tracked):
            self._fail(request_id, "the server is shutting down")
        held = [c for c in self._held if c.done.set_running_or_notify_cancel()]
        pending = held + ([self._update] if self._update is not None else [])
        self._held, self._update = [], None
        for cmd in pending:
            cmd.done.set_exception(RuntimeError("the engine loop is not running"))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add | _UpdateWeights) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(RuntimeError("the engine loop is not running"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add) and self._update is not None:
                self._held.append(cmd)  # admission is paused until the swap
            elif isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _UpdateWeights):
                self._queue_update(cmd)
            else:
                for request_id in cmd.request_ids:
                    self._abort(request_id)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            self._release(len(cmd.group.request_ids))
            return  # the caller went away before admission
        group, seqs = cmd.group, []
        try:
            group.seed, params = seed_requests(group.params, group.seed_offsets,
                                               self.engine.draw_seed)
            for rid, ids, p, off in zip(group.request_ids, group.prompts, params,
                                        group.seed_offsets, strict=True):
                seqs.append(self.engine.add_request(rid, ids, p, score_only=group.score_only,
                                                   index=off, cache_salt=group.cache_salt))
        except Exception as e:  # all or nothing, as LLM.generate
            for seq in seqs:
                self.engine.abort(seq.request_id)
            self._release(len(group.request_ids))
            cmd.done.set_exception(e)
            return
        group.seeds = [s.seed for s in seqs]
        group.cached_tokens = [0] * len(seqs)
        group.prompt_logprobs = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            self._tracked[seq.request_id] = _Tracked(group, i, seq, queued=True)
            self.metrics.prompt_tokens.inc(len(seq.prompt_token_ids))
        cmd.done.set_result(None)

    def _queue_update(self, cmd: _UpdateWeights) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return
        if self._update is not None:
            cmd.done.set_exception(RuntimeError("another weight update is in progress"))
            return
        self._update = cmd

    def _swap_weights(self) -> None:
        """The engine is drained: swap, answer, then admit the requests that were held."""
        cmd, self._update = self._update, None
        self.canary.forget(self.engine)
        try:
            cmd.done.set_result(self.engine.update_weights(cmd.tensors))
        except Exception as e:  # ValueError: a bad tensor, nothing changed
            cmd.done.set_exception(e)
        held, self._held = self._held, []
        for add in held:
            self._add(add)

    def _untrack(self, request_id: str) -> _Tracked | None:
        t = self._tracked.pop(request_id, None)
        if t is not None and t.queued:
            t.queued = False
            self._release(1)
        return t

    def _abort(self, request_id: str) -> None:
        if self._untrack(request_id) is not None:
            self.engine.abort(request_id)
            self.metrics.finished.labels(reason="abort").inc()

    def _step(self) -> None:
        try:
            progressed = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight and taking no "
                          "new work")
            self._error = f"an engine step failed ({type(e).__name__}); restart the server"
            for request_id in list(self._tracked):
                self._fail(request_id, "internal error in the engine step")
            return
        if self.canary.holds_blocks_needed(self.engine):
            self.canary.abort_parked(self.engine)  # the KV blocks go to the waiting requests
        if progressed:
            self.metrics.batch_size.observe(len(progressed))
        self._mark_running()
        now = time.monotonic()
        for seq in progressed:
            tracked = self._tracked.get(seq.request_id)
            if tracked is not None:
                self._deliver(seq, tracked, now)

    def _mark_running(self) -> None:
        """Requests the scheduler has taken in leave the queue count."""
        for t in self._tracked.values():
            if t.queued and t.seq.status is not SequenceStatus.WAITING:
                t.queued = False
                self._release(1)

    def _deliver(self, seq: Sequence, t: _Tracked, now: float) -> None:
        total = len(seq.output_token_ids)
        if total > t.seen:
            self.metrics.generation_tokens.inc(total - t.seen)
            if t.seen == 0:
                self.metrics.ttft.observe(now - t.group.arrival)
            else:
                self.metrics.itl.observe(now - t.last_token)
            t.seen, t.last_token = total, now
        output = None
        if seq.is_finished:
            output = self.engine.output.completion(seq)
            t.group.cached_tokens[t.index] = seq.num_cached_tokens
            t.group.prompt_logprobs[t.index] = self.engine.output.prompt_logprobs(seq)
            self._untrack(seq.request_id)
            self.canary.offer(seq)
            self.metrics.finished.labels(reason=seq.finish_reason or "unknown").inc()
        elif not t.group.stream or total == t.sent:
            return
        s = slice(t.sent, total)
        t.sent = total
        text = self.engine.output.stream_text(seq) if t.group.stream else ""
        _post(t.group, Delta(t.index, seq.output_token_ids[s], seq.logprobs[s],
                             seq.top_logprobs[s], output, text=text))

    def _fail(self, request_id: str, message: str) -> None:
        t = self._untrack(request_id)
        assert t is not None
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine is in a bad state; the request is dropped either way
            log.exception("abort of %s failed", request_id)
        self.metrics.finished.labels(reason="error").inc()
        _post(t.group, Delta(t.index, [], [], [], error=message))

    def _report_state(self) -> None:
        stats = self.engine.stats()
        self.metrics.set_engine_state(stats.num_running, stats.num_waiting, stats.kv_blocks_used)


class QueueFull(Exception):
    """More requests wait than ``--max-queued-requests`` allows: the caller answers 503."""

    def __init__(self, queued: int, limit: int) -> None:
        super().__init__(f"the server is busy: {queued} requests are queued (limit {limit}, "
                         "--max-queued-requests); retry later")


def _post(group: RequestGroup, delta: Delta) -> None:
    try:
        group.loop.call_soon_threadsafe(group.queue.put_nowait, delta)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass
