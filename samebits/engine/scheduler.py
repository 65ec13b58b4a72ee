"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences come first (a decode token, or the next chunk of a prefill), then waiting ones
in arrival order, within ``max_num_batched_tokens`` and ``max_num_seqs``. Any prompt may be
chunked at any boundary. Prefill tokens (every scheduled token of a
sequence that has more than one left to compute) share a per-step budget of
``long_prefill_token_threshold``, so a step holds at most one chunk of prefill beside the decodes:
a running stream never waits longer than one chunk's compute, however long the prompts that
arrive. When blocks run out, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed.
A paused sequence (``pause`` / ``resume``) keeps its blocks and progress but is not scheduled.
Without ``chunked_prefill`` (an encoder, whose tokens attend to each other) a prompt runs whole in
one step or waits, and the per-step prefill budget is the step's.
With ``lookahead_until`` (async scheduling), a decoding sequence whose next position is below it
also holds that position's block when one is free beyond a block for every running sequence: the
decode step launched ahead writes its K/V there (``ModelRunner._launch_ahead`` launches only into
held blocks, so without this, sequences at staggered positions -- one of them always at a block
boundary -- would keep every step from being launched ahead). Never preempts for it.
None of these choices changes a sequence's bits (the ops are invariant); they change only speed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from samebits.engine.kv_cache import KVCacheManager
from samebits.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv: KVCacheManager,
                 long_prefill_token_threshold: int | None = None,
                 chunked_prefill: bool = True, lookahead_until: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = long_prefill_token_threshold or max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.lookahead_until = lookahead_until  # next positions below it get their block early
        if not chunked_prefill:
            self.prefill_chunk = max_num_batched_tokens
        self._prefill_left = 0  # prefill tokens still allowed in the step being scheduled
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: dict[str, bool] = {}  # paused request id -> it was running (holds blocks)
        self._paused_seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_scheduled_tokens = 0  # since start: prompt and decode tokens of every step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        self._prefill_left = self.prefill_chunk
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._schedule_waiting(batch, budget)
        self.num_scheduled_tokens += sum(batch.num_new_tokens)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # a prefill, and this step's prefill budget is spent
                i += 1
                continue
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                self._look_ahead(seq, n)
        return budget

    def _look_ahead(self, seq: Sequence, n: int) -> None:
        """A decoding ``seq``'s next position's block, if it is below ``lookahead_until`` and a
        block is free beyond one for every running sequence (best effort)."""
        if (n == 1 and seq.num_tokens < self.lookahead_until
                and self.kv.pool.num_free > len(self.running)):
            self.kv.allocate(seq, 2)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            n = self._chunk(seq.num_tokens - num_cached, budget)
            if n == 0 or not self.kv.allocate(seq, n, cached):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to schedule for a sequence with ``remaining`` to compute; a prefill (more than
        one token left) draws on the step's prefill budget."""
        if remaining <= 1:
            return min(remaining, budget)
        n = min(remaining, budget, self._prefill_left)
        if n < remaining and not self.chunked_prefill:
            return 0  # the whole prompt, in a later step
        self._prefill_left -= n
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def pause(self, seq: Sequence) -> None:
        """Take an unfinished sequence out of scheduling, keeping its progress and KV blocks:
        ``schedule`` skips it and ``has_unfinished`` no longer counts it until ``resume`` puts it
        back in the queue it left (running or waiting), or ``finish`` ends it."""
        running = seq in self.running
        (self.running if running else self.waiting).remove(seq)
        self.paused[seq.request_id] = running
        self._paused_seqs[seq.request_id] = seq

    def resume(self, seq: Sequence) -> None:
        running = self.paused.pop(seq.request_id)
        del self._paused_seqs[seq.request_id]
        (self.running if running else self.waiting).append(seq)

    def paused_blocks_needed(self) -> bool:
        """Whether paused sequences hold KV blocks the queue waits for: one was paused running
        (it holds blocks), nothing runs, and sequences wait."""
        return any(self.paused.values()) and not self.running and bool(self.waiting)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished (or aborted), drop it from its queue and free its blocks."""
        if seq.request_id in self.paused:
            self.resume(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
