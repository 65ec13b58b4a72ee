"""A request's state as the engine sees it (plain Python); what callers get back is built from it
by ``samebits.engine.output_processor`` (shapes in ``samebits.outputs``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from samebits.outputs import RequestMetrics
from samebits.sampling_params import SamplingParams

if TYPE_CHECKING:
    from samebits.engine.grammar import GrammarState
    from samebits.engine.request_error import RequestError
    from samebits.text.output_text import OutputText


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    score_only: bool = False  # teacher-forced: logprob of every prompt token, nothing generated
    cache_salt: str | None = None  # enters the first block's hash: no sharing across salts
    bypass_prefix_cache: bool = False  # neither reads nor fills the prefix cache
    index: int = 0  # which choice of its prompt this sequence is (0 .. best_of - 1)
    stop_ids: frozenset[int] = frozenset()  # token ids that end it: EOS (unless ignored), stop ids
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)  # of each token, when logprobs are asked
    # logprob of prompt token i+1 at index i (t_1 .. t_{n-1}), for score_only requests and those
    # asking for prompt logprobs; ranks and top-k only for the latter. Position-indexed, so a
    # recompute after preemption overwrites entries instead of appending.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this sequence's blocks
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    num_committed_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    grammar: GrammarState | None = None  # structured output: this request's matcher
    detokenizer: OutputText | None = None  # the output's text (None: no tokenizer, or not asked)
    metrics: RequestMetrics | None = None  # timings (requests added through add_request)
    error: RequestError | None = None  # why it failed alone (finish_reason "error"), else None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id(self, i: int) -> int:
        """``all_token_ids[i]`` without building the list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether cached blocks may serve this sequence (not when every prompt position's
        logprob is wanted, nor when it bypasses the cache)."""
        return not (self.bypass_prefix_cache or self.wants_prompt_logprobs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position must be computed (no prefix-cache hits) and its logprob kept."""
        return self.score_only or self.params.prompt_logprobs is not None
