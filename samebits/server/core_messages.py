"""The messages between the server and its engine core (samebits.server.engine_core): the
commands the core takes from its ``Inbox`` and the ``CoreOutputs`` it hands back each loop turn.
Plain dataclasses and tuples: they cross a process boundary pickled
(samebits.server.engine_process), and nothing in them depends on which side of it they are read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from samebits.engine.pooling import PoolingOutput
from samebits.outputs import CompletionOutput, PromptLogprobs
from samebits.pooling_params import PoolingParams
from samebits.sampling_params import SamplingParams

IDLE_CHECK_S = 1.0  # the most an idle core waits for a command before it checks its engine


# ---- commands (server -> core) ----------------------------------------------------------------
@dataclass(frozen=True)
class AddGroup:
    """An HTTP request's engine requests, admitted all or nothing (replied with ``Admitted``)."""

    group_id: int
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams | PoolingParams]  # the request's, unseeded per candidate
    seed_offsets: list[int]  # candidate index: request j is seeded choice_seed(seed, this)
    stream: bool  # a Delta every step, not only the last
    cache_salt: str | None
    score_only: bool
    arrival: float  # time.monotonic() at arrival (one clock for every process of the machine)


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]  # finished or unknown ids are ignored


@dataclass(frozen=True)
class UpdateWeights:
    call_id: int
    tensors: list  # (HF name, tensor) pairs


@dataclass(frozen=True)
class Stop:
    pass


# ---- what the core hands back (core -> server) ------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """New tokens of one engine request; ``output`` is set on its last delta."""

    index: int  # the request's position in its group
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    output: CompletionOutput | PoolingOutput | None = None  # the request's result (one choice)
    error: str | None = None  # the engine failed; the request is gone
    text: str = ""  # new output text a stream may send (engine.output_processor.stream_text)
    error_status: int = 500  # with ``error``: 400 when the request's own input made it fail
    cached_tokens: int = 0  # with ``output``: prompt tokens read from the prefix cache
    # when asked for: with ``output``, and on a stream's first delta (the prompt is scored
    # before the first token is sampled)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class Admitted:
    group_id: int
    seeds: list[int] | None  # per request; None when ``error`` refused the group
    error: Exception | None = None
    seed: int | None = None  # the request's seed, given or drawn (engine.fanout)


@dataclass(frozen=True)
class WeightsUpdated:
    call_id: int
    fingerprint: str | None
    error: Exception | None = None


@dataclass
class CoreStats:
    """What the metrics need from one loop turn (counts since the previous turn)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # sequences that progressed, per step
    prompt_tokens: int = 0  # admitted
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # engine requests by finish reason
    ttft: list[float] = field(default_factory=list)  # arrival -> first token, seconds
    itl: list[float] = field(default_factory=list)  # between two tokens of one request
    e2e: list[float] = field(default_factory=list)  # arrival -> finish, per engine request
    queue_time: list[float] = field(default_factory=list)  # arrival -> first scheduled
    prefill_time: list[float] = field(default_factory=list)  # first scheduled -> first token
    decode_time: list[float] = field(default_factory=list)  # first token -> finish
    inference_time: list[float] = field(default_factory=list)  # first scheduled -> finish
    iteration_tokens: list[int] = field(default_factory=list)  # tokens each step ran
    preemptions: int = 0
    dequeued: int = 0  # requests that left the queue (running, finished, refused or aborted)
    canary_checks: int = 0
    canary_mismatches: int = 0
    canary_dropped: int = 0
    error: str | None = None  # set once a step has failed: the core takes no new work


# a streamed request's progress in one step: (request id, token ids, logprobs, top logprobs,
# its new output text, its prompt logprobs: on its first row only, when asked for)
TokenRow = tuple[str, list[int], list[float], list[dict[int, float]], str, PromptLogprobs | None]


@dataclass
class CoreOutputs:
    replies: list[Admitted | WeightsUpdated] = field(default_factory=list)
    tokens: list[TokenRow] = field(default_factory=list)  # streamed requests that go on
    last: list[tuple[str, Delta]] = field(default_factory=list)  # (request id, its last delta)
    stats: CoreStats = field(default_factory=CoreStats)

    def __bool__(self) -> bool:
        return bool(self.replies or self.tokens or self.last)


class Inbox(Protocol):
    def get(self, block: bool) -> Any:
        """The next command, or None when none waits (``block``: wait for one, at most
        ``IDLE_CHECK_S``)."""

    def pending(self) -> bool:
        """Whether a command waits."""
