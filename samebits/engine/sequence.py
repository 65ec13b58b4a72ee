"""A request's state as the engine sees it (plain Python), and what it hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from samebits.sampling_params import SamplingParams


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
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
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
    text: str | None = None  # set when a stop string cut the text

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position must be computed (no prefix-cache hits) and its logprob kept."""
        return self.score_only or self.params.prompt_logprobs is not None


@dataclass(frozen=True)
class Logprob:
    """vLLM's per-token entry: the logprob, its 1-based rank in the raw distribution (the number
    of tokens whose logprob is >= this one's), and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]  # None first: the first token has no context


@dataclass
class RequestOutput:
    """One request's result, as ``LLM.generate`` returns it (design.md section 4)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]  # raw-distribution logprob of each generated token, exact fp32 values
    seed: int
    system_fingerprint: str
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
