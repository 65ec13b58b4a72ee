"""The engine core: the one owner of an ``LLMEngine`` in the server, stepping it in a busy loop.

It takes commands (``AddGroup``, ``Abort``, ``UpdateWeights``, ``Stop``; the messages are
samebits.server.core_messages) from an ``Inbox`` and hands back one ``CoreOutputs`` per loop turn:
admission replies first (before the step, so a caller waits for no step to learn its seed or its
400), then every request's new tokens of the step, then the turn's statistics for the metrics. The
same loop runs in a thread of the server process or in a process of its own
(samebits.server.engine_process); nothing it sends depends on which, and nothing here can change a
bit of what the engine computes.

Once a step fails, or a tensor-parallel rank's process dies (an idle core looks at its engine
every ``IDLE_CHECK_S``), the core fails the requests it holds with the reason (naming the rank),
reports it in every turn's statistics (/health turns 503) and takes no new work.

A streamed request's new tokens go out every step it progresses, as a plain tuple (``TokenRow``:
cheap to pickle, and rebuilt into a ``Delta`` on the event loop); every request's last ``Delta``
carries its result. Finished requests are offered to the determinism canary, which replays them
when the engine is idle (samebits.server.canary).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from samebits.engine.engine import EngineStats, LLMEngine
from samebits.engine.executor import RankFailedError
from samebits.engine.fanout import seed_requests
from samebits.engine.pooling import PoolingOutput, PoolingSequence
from samebits.engine.sequence import Sequence, SequenceStatus
from samebits.pooling_params import PoolingParams
from samebits.server.canary import Canary
from samebits.server.core_messages import (
    Abort,
    AddGroup,
    Admitted,
    CoreOutputs,
    CoreStats,
    Delta,
    Inbox,
    Stop,
    UpdateWeights,
    WeightsUpdated,
)

log = logging.getLogger("samebits.server")
NOT_RUNNING = "the engine loop is not running"


class _Tally:
    """The canary's counters, read into each turn's ``CoreStats``."""

    class _Count:
        def __init__(self) -> None:
            self.value = 0

        def inc(self, amount: int = 1) -> None:
            self.value += amount

    def __init__(self) -> None:
        self.canary_checks, self.canary_mismatches = self._Count(), self._Count()
        self.canary_dropped = self._Count()

    def take(self, stats: CoreStats) -> None:
        for name in ("canary_checks", "canary_mismatches", "canary_dropped"):
            count = getattr(self, name)
            setattr(stats, name, count.value)
            count.value = 0


@dataclass
class _Tracked:
    index: int  # position in its group
    seq: Sequence
    stream: bool
    arrival: float
    seen: int = 0  # tokens counted in the metrics
    sent: int = 0  # tokens delivered
    last_token: float = 0.0
    first_token: float = 0.0
    scheduled: float | None = None  # when the step that first took it in began


class EngineCore:
    """Steps one engine for the server; every method runs on the core's own thread."""

    def __init__(self, engine: LLMEngine, canary_rate: float = 0.0) -> None:
        self.engine = engine
        self._tally = _Tally()
        self.canary = Canary(canary_rate, self._tally, engine.config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._queued: set[str] = set()  # tracked requests the scheduler has not taken in yet
        self._update: UpdateWeights | None = None  # a swap waiting for the engine to drain
        self._held: list[AddGroup] = []  # admissions that arrived while a swap waits
        self._error: str | None = None
        self._out = CoreOutputs()

    def run(self, inbox: Inbox, send: Callable[[CoreOutputs], None]) -> None:
        """Serve commands until ``Stop`` (or the inbox ends): apply every waiting command, send
        the replies, step, send the step's outputs. Blocks only when there is nothing to do."""
        try:
            while self._apply_commands(inbox, block=not self._has_work()):
                if self._out:
                    self._flush(send)  # replies before the step
                if self.engine.has_unfinished():
                    self._step()
                elif self._update is not None:
                    self._swap_weights()
                elif self.canary.pending:  # idle: replay one request alone
                    self.canary.replay(self.engine, busy=inbox.pending)
                self._flush(send)
        except BaseException:
            log.exception("the engine loop failed")
            raise
        finally:
            self._shut_down(inbox, send)

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or self._update is not None or self.canary.pending

    def _flush(self, send: Callable[[CoreOutputs], None]) -> None:
        out, self._out = self._out, CoreOutputs()
        stats, engine = out.stats, self.engine.stats()
        stats.running, stats.waiting = engine.num_running, engine.num_waiting
        stats.kv_blocks_used, stats.error = engine.kv_blocks_used, self._error
        self._tally.take(stats)
        send(out)

    # ---- commands -------------------------------------------------------------------------
    def _apply_commands(self, inbox: Inbox, block: bool) -> bool:
        """Apply the waiting commands (waiting for one if ``block``); False on ``Stop``."""
        cmd = inbox.get(block)
        while block and cmd is None and not self._engine_failed():
            cmd = inbox.get(block)  # idle: between waits, the engine is checked
        while cmd is not None:
            if isinstance(cmd, Stop):
                return False
            if isinstance(cmd, AddGroup):
                self._admit(cmd)
            elif isinstance(cmd, Abort):
                for request_id in cmd.request_ids:
                    self._abort(request_id)
            elif isinstance(cmd, UpdateWeights):
                self._queue_update(cmd)
            cmd = inbox.get(False)
        return True

    def _admit(self, cmd: AddGroup) -> None:
        if self._error is not None:
            self._refuse(cmd, RuntimeError(self._error))
        elif self._update is not None:
            self._held.append(cmd)  # admission is paused until the swap
        else:
            self._add(cmd)

    def _add(self, cmd: AddGroup) -> None:
        seqs: list[Sequence] = []
        seed, params = None, cmd.params  # pooling requests draw no seed
        try:
            if not isinstance(params[0], PoolingParams):
                seed, params = seed_requests(params, cmd.seed_offsets, self.engine.draw_seed)
            for rid, ids, p, off in zip(cmd.request_ids, cmd.prompts, params, cmd.seed_offsets,
                                        strict=True):
                seqs.append(self.engine.add_request(rid, ids, p, score_only=cmd.score_only,
                                                    index=off, cache_salt=cmd.cache_salt))
        except Exception as e:  # all or nothing, as LLM.generate
            for seq in seqs:
                self.engine.abort(seq.request_id)
            return self._refuse(cmd, e)
        for i, seq in enumerate(seqs):
            self._tracked[seq.request_id] = _Tracked(i, seq, cmd.stream, cmd.arrival)
            self._queued.add(seq.request_id)
            self._out.stats.prompt_tokens += len(seq.prompt_token_ids)
        self._out.replies.append(Admitted(cmd.group_id, [s.seed for s in seqs], seed=seed))

    def _refuse(self, cmd: AddGroup, error: Exception) -> None:
        self._out.stats.dequeued += len(cmd.request_ids)
        self._out.replies.append(Admitted(cmd.group_id, None, error))

    def _queue_update(self, cmd: UpdateWeights) -> None:
        if self._update is not None:
            error = RuntimeError("another weight update is in progress")
            self._out.replies.append(WeightsUpdated(cmd.call_id, None, error))
        else:
            self._update = cmd

    def _swap_weights(self) -> None:
        """The engine is drained: swap, answer, then admit the requests that were held."""
        cmd, self._update = self._update, None
        self.canary.forget(self.engine)
        try:
            reply = WeightsUpdated(cmd.call_id, self.engine.update_weights(cmd.tensors))
        except Exception as e:  # ValueError: a bad tensor, nothing changed
            reply = WeightsUpdated(cmd.call_id, None, e)
        self._out.replies.append(reply)
        held, self._held = self._held, []
        for add in held:
            self._add(add)

    def _untrack(self, request_id: str) -> _Tracked | None:
        if request_id in self._queued:
            self._queued.discard(request_id)
            self._out.stats.dequeued += 1
        return self._tracked.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        if self._untrack(request_id) is not None:
            self.engine.abort(request_id)
            self._out.stats.finished["abort"] += 1

    # ---- the step -------------------------------------------------------------------------
    def _step(self) -> None:
        start, before = time.monotonic(), self.engine.stats()
        try:
            progressed = self.engine.step()
        except RankFailedError as e:
            log.error("%s; failing the requests in flight and taking no new work", e)
            return self._fail_all(f"{e}; restart the server")
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
            self._out.stats.batch_sizes.append(len(progressed))
        self._count_step(before)
        self._mark_running(start)
        now = time.monotonic()
        for seq in progressed:
            tracked = self._tracked.get(seq.request_id)
            if tracked is not None:
                self._deliver_alone(seq, tracked, now)

    def _engine_failed(self) -> bool:
        """Whether the engine has just turned out unable to run (a tensor-parallel rank's
        process died while the core was idle): then it fails, naming the rank, and takes no new
        work."""
        if self._error is not None:
            return False
        try:
            self.engine.check_health()
        except RankFailedError as e:
            log.error("%s; taking no new work", e)
            self._fail_all(f"{e}; restart the server")
            return True
        return False

    def _fail_all(self, reason: str) -> None:
        """The engine cannot run again: every request in flight fails with ``reason``, which
        /health reports from now on."""
        self._error = reason
        for request_id in list(self._tracked):
            self._fail(request_id, reason)

    def _count_step(self, before: EngineStats) -> None:
        """The step's tokens and preemptions: the engine's counters after it less ``before``
        (two snapshots at the step's edges: nothing else that steps the engine is counted)."""
        after, stats = self.engine.stats(), self._out.stats
        if ran := after.num_scheduled_tokens - before.num_scheduled_tokens:
            stats.iteration_tokens.append(ran)
        stats.preemptions += after.num_preemptions - before.num_preemptions

    def _mark_running(self, step_start: float) -> None:
        """Requests the scheduler has taken in leave the queue count; their queue time ends
        when the step that took them in began."""
        started = [rid for rid in self._queued
                   if self._tracked[rid].seq.status is not SequenceStatus.WAITING]
        self._queued.difference_update(started)
        self._out.stats.dequeued += len(started)
        for rid in started:
            t = self._tracked[rid]
            t.scheduled = step_start
            self._out.stats.queue_time.append(step_start - t.arrival)

    def _deliver_alone(self, seq: Sequence, t: _Tracked, now: float) -> None:
        """``_deliver``, or the request's own error: a request that failed alone in the step, or
        whose result cannot be built, fails with its cause; the others are delivered as usual."""
        if seq.error is not None:
            status = 400 if seq.error.invalid_request else 500
            return self._fail(seq.request_id, seq.error.message, status)
        try:
            self._deliver(seq, t, now)
        except Exception as e:
            log.exception("delivering %s failed", seq.request_id)
            message = f"building its output failed: {type(e).__name__}"
            if seq.request_id in self._tracked:
                self._fail(seq.request_id, message)
            else:  # it failed after leaving the tracked set: tell its caller all the same
                self._out.last.append((seq.request_id, Delta(t.index, [], [], [],
                                                               error=message)))

    def _deliver(self, seq: Sequence, t: _Tracked, now: float) -> None:
        if isinstance(seq, PoolingSequence):
            return self._deliver_pooled(seq, t)
        total, stats = len(seq.output_token_ids), self._out.stats
        if total > t.seen:
            stats.generation_tokens += total - t.seen
            if t.seen == 0:
                stats.ttft.append(now - t.arrival)
                stats.prefill_time.append(now - (t.scheduled or t.arrival))
                t.first_token = now
            else:
                stats.itl.append(now - t.last_token)
            t.seen, t.last_token = total, now
        if seq.is_finished:
            self._out.last.append((seq.request_id, self._last_delta(seq, t)))
            self._untrack(seq.request_id)
            self.canary.offer(seq)
            stats.finished[seq.finish_reason or "unknown"] += 1
            stats.e2e.append(now - t.arrival)
            stats.inference_time.append(now - (t.scheduled or t.arrival))
            if t.seen:
                stats.decode_time.append(now - t.first_token)
        elif t.stream and total > t.sent:
            s = slice(t.sent, total)
            prompt_logprobs = self.engine.output.prompt_logprobs(seq) if t.sent == 0 else None
            t.sent = total
            self._out.tokens.append((seq.request_id, seq.output_token_ids[s], seq.logprobs[s],
                                     seq.top_logprobs[s], self.engine.output.stream_text(seq),
                                     prompt_logprobs))

    def _last_delta(self, seq: Sequence, t: _Tracked) -> Delta:
        s = slice(t.sent, len(seq.output_token_ids))
        output = self.engine.output
        return Delta(t.index, seq.output_token_ids[s], seq.logprobs[s], seq.top_logprobs[s],
                     output.completion(seq), text=output.stream_text(seq) if t.stream else "",
                     cached_tokens=seq.num_cached_tokens,
                     prompt_logprobs=output.prompt_logprobs(seq))

    def _deliver_pooled(self, seq: PoolingSequence, t: _Tracked) -> None:
        """A pooling request's one delta: its vector, once computed."""
        if not seq.is_finished:
            return
        self._untrack(seq.request_id)
        self._out.stats.finished[seq.finish_reason or "unknown"] += 1
        self._out.last.append((seq.request_id, Delta(t.index, [], [], [],
                                                       PoolingOutput(seq.embedding))))

    def _fail(self, request_id: str, message: str, status: int = 500) -> None:
        t = self._untrack(request_id)
        assert t is not None
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine is in a bad state; the request is dropped either way
            log.exception("abort of %s failed", request_id)
        self._out.stats.finished["error"] += 1
        self._out.last.append((request_id, Delta(t.index, [], [], [], error=message,
                                                 error_status=status)))

    def _shut_down(self, inbox: Inbox, send: Callable[[CoreOutputs], None]) -> None:
        """Fail what is in flight and what is still queued: no caller waits forever."""
        self._error = self._error or NOT_RUNNING
        for request_id in list(self._tracked):
            self._fail(request_id, "the server is shutting down")
        pending: list[Any] = self._held + ([self._update] if self._update else [])
        self._held, self._update = [], None
        while (cmd := inbox.get(False)) is not None and not isinstance(cmd, Stop):
            pending.append(cmd)
        for cmd in pending:
            if isinstance(cmd, AddGroup):
                self._refuse(cmd, RuntimeError(NOT_RUNNING))
            elif isinstance(cmd, UpdateWeights):
                self._out.replies.append(WeightsUpdated(cmd.call_id, None,
                                                        RuntimeError(NOT_RUNNING)))
        try:
            self._flush(send)
        except Exception:  # nobody is listening any more
            log.debug("the engine loop's last outputs were not delivered", exc_info=True)
