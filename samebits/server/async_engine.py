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
from dataclasses import dataclass, field, replace

from samebits.engine.engine import LLMEngine
from samebits.engine.sequence import RequestOutput, Sequence
from samebits.sampling_params import SamplingParams
from samebits.server.metrics import Metrics

log = logging.getLogger("samebits.server")


@dataclass(frozen=True)
class Delta:
    """New tokens of one engine request; ``output`` is set on its last delta."""

    index: int  # the request's position in its group
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    output: RequestOutput | None = None
    error: str | None = None  # the engine failed; the request is gone


@dataclass
class RequestGroup:
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    seed_offsets: list[int]  # without a seed, request i gets the drawn seed + seed_offsets[i]
    stream: bool  # deliver every step's tokens, not only the final output
    score_only: bool = False  # teacher-forced prompt logprobs, nothing generated (max_tokens 0)
    arrival: float = field(default_factory=time.monotonic)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    seeds: list[int] = field(default_factory=list)  # filled in at admission


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    seen: int = 0  # tokens counted in the metrics
    sent: int = 0  # tokens delivered to the caller
    last_token: float = 0.0


@dataclass(frozen=True)
class _Add:
    group: RequestGroup
    done: Future


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopped = False
        metrics.kv_blocks_total.set(engine.stats().kv_blocks_total)

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="samebits-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, group: RequestGroup) -> None:
        """Queue the group's requests; raises the engine's ``ValueError`` if one is invalid."""
        if self._stopped or not self.alive:
            raise RuntimeError("the engine loop is not running")
        done: Future = Future()
        self._commands.put(_Add(group, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(group.request_ids)
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (idempotent: finished or unknown ids are ignored)."""
        self._commands.put(_Abort(list(request_ids)))

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                self._report_state()
        except BaseException:
            log.exception("the engine loop failed")
            raise
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Fail what is in flight and what is still queued: no caller waits forever."""
        self._stopped = True
        for request_id in list(self._tracked):
            self._fail(request_id, "the server is shutting down")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and cmd.done.set_running_or_notify_cancel():
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
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                for request_id in cmd.request_ids:
                    self._abort(request_id)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return  # the caller went away before admission
        group, seqs = cmd.group, []
        try:
            base = None
            for rid, ids, p, off in zip(group.request_ids, group.prompts, group.params,
                                        group.seed_offsets, strict=True):
                if p.seed is None and base is not None:
                    p = replace(p, seed=base + off)
                seq = self.engine.add_request(rid, ids, p, score_only=group.score_only)
                base = seq.seed - off if base is None else base
                seqs.append(seq)
        except Exception as e:  # all or nothing, as LLM.generate
            for seq in seqs:
                self.engine.abort(seq.request_id)
            cmd.done.set_exception(e)
            return
        group.seeds = [s.seed for s in seqs]
        for i, seq in enumerate(seqs):
            self._tracked[seq.request_id] = _Tracked(group, i)
            self.metrics.prompt_tokens.inc(len(seq.prompt_token_ids))
        cmd.done.set_result(None)

    def _abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.metrics.finished.labels(reason="abort").inc()

    def _step(self) -> None:
        try:
            progressed = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing the requests in flight")
            for request_id in list(self._tracked):
                self._fail(request_id, "internal error in the engine step")
            return
        if progressed:
            self.metrics.batch_size.observe(len(progressed))
        now = time.monotonic()
        for seq in progressed:
            tracked = self._tracked.get(seq.request_id)
            if tracked is not None:
                self._deliver(seq, tracked, now)

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
            output = self.engine.output(seq)
            del self._tracked[seq.request_id]
            self.metrics.finished.labels(reason=seq.finish_reason or "unknown").inc()
        elif not t.group.stream or total == t.sent:
            return
        s = slice(t.sent, total)
        t.sent = total
        _post(t.group, Delta(t.index, seq.output_token_ids[s], seq.logprobs[s],
                             seq.top_logprobs[s], output))

    def _fail(self, request_id: str, message: str) -> None:
        t = self._tracked.pop(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine is in a bad state; the request is dropped either way
            log.exception("abort of %s failed", request_id)
        self.metrics.finished.labels(reason="error").inc()
        _post(t.group, Delta(t.index, [], [], [], error=message))

    def _report_state(self) -> None:
        stats = self.engine.stats()
        self.metrics.set_engine_state(stats.num_running, stats.num_waiting, stats.kv_blocks_used)


def _post(group: RequestGroup, delta: Delta) -> None:
    try:
        group.loop.call_soon_threadsafe(group.queue.put_nowait, delta)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass
