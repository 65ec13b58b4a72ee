"""The determinism canary: replay a sampled share of finished requests alone and check the bits.

A finished request is sampled with probability ``rate`` (a generator seeded by the server's seed,
so a run's choice of requests is reproducible). Its prompt, sampling parameters and the seed it
used are queued with the hash of what was served (``samebits.server.output_hash``). When the engine has
nothing else to do, the engine thread replays one queued request as a batch of one with the prefix
cache bypassed, and compares hashes: in the invariant numerics they must agree, whatever batch
the request was served in. New work preempts a replay (it is aborted and queued again), so the
canary only uses idle capacity. A mismatch is counted and logged with the request id.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from samebits.engine.engine import LLMEngine
from samebits.engine.sequence import Sequence
from samebits.sampling_params import SamplingParams
from samebits.server.metrics import Metrics
from samebits.server.output_hash import output_hash

log = logging.getLogger("samebits.server")
MAX_PENDING = 256  # replays queued beyond this are dropped (counted in samebits_canary_dropped)


@dataclass(frozen=True)
class CanaryJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # with the seed the request used
    expected: str  # output_hash of what was served

    def __post_init__(self) -> None:
        if self.params.seed is None:
            raise ValueError("a canary replay needs the seed the request used")


class Canary:
    """Engine-thread only (like the engine): ``offer`` finished sequences, ``replay`` when idle."""

    def __init__(self, rate: float, metrics: Metrics, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"canary rate must be in [0, 1], got {rate!r}")
        self.rate = rate
        self.metrics = metrics
        self._rng = random.Random(seed)
        self._pending: deque[CanaryJob] = deque()
        self._count = 0
        self._active: tuple[CanaryJob, Sequence] | None = None  # a replay, maybe parked mid-way

    @property
    def pending(self) -> bool:
        return bool(self._pending) or self._active is not None

    @property
    def parked(self) -> bool:
        return self._active is not None

    def offer(self, seq: Sequence) -> None:
        """Maybe queue a replay of ``seq``, a request that finished normally."""
        if self.rate == 0.0 or seq.score_only or seq.finish_reason not in ("stop", "length"):
            return
        if self._rng.random() >= self.rate:
            return
        if len(self._pending) >= MAX_PENDING:
            self.metrics.canary_dropped.inc()
            return
        expected = output_hash([(seq.output_token_ids, seq.logprobs)])
        self._pending.append(CanaryJob(seq.request_id, list(seq.prompt_token_ids),
                                       replace(seq.params, seed=seq.seed), expected))

    def replay(self, engine: LLMEngine, busy: Callable[[], bool]) -> None:
        """Run the parked replay, or start the oldest queued one, alone until it finishes or
        ``busy`` says work arrived; then it is parked: out of the scheduler, its KV blocks kept,
        resumed alone at the next idle time. The engine must have no other request in flight."""
        try:
            job, seq = self._resume(engine)
            while not seq.is_finished:
                if busy():
                    engine.park(seq.request_id)
                    return
                engine.step()
        except Exception:
            log.exception("canary replay failed")
            self.abort_parked(engine, requeue=False)
            return
        self._active = None
        self._check(job, output_hash([(seq.output_token_ids, seq.logprobs)]))

    def _resume(self, engine: LLMEngine) -> tuple[CanaryJob, Sequence]:
        if self._active is None:
            job = self._pending.popleft()
            self._count += 1
            seq = engine.add_request(f"canary-{self._count}-{job.request_id}",
                                     job.prompt_token_ids, job.params, bypass_prefix_cache=True)
            self._active = (job, seq)
            return job, seq
        job, seq = self._active
        engine.unpark(seq.request_id)
        return job, seq

    def abort_parked(self, engine: LLMEngine, requeue: bool = True) -> None:
        """Give up the parked replay (freeing its KV blocks); ``requeue``: start it over later."""
        if self._active is None:
            return
        job, seq = self._active
        self._active = None
        engine.abort(seq.request_id)  # parked or not
        if requeue:
            self._pending.appendleft(job)

    def forget(self, engine: LLMEngine) -> None:
        """Drop every replay, parked or queued: after a weight update the served outputs they
        would be compared with came from other weights."""
        self.abort_parked(engine, requeue=False)
        self._pending.clear()

    def holds_blocks_needed(self, engine: LLMEngine) -> bool:
        """True when the parked replay's blocks stop the queue: nothing runs and some wait."""
        return self._active is not None and engine.parked_blocks_needed()

    def _check(self, job: CanaryJob, got: str) -> None:
        self.metrics.canary_checks.inc()
        if got != job.expected:
            self.metrics.canary_mismatches.inc()
            log.warning("determinism canary: request %s replayed alone gave output hash %s, "
                        "served %s", job.request_id, got, job.expected)
