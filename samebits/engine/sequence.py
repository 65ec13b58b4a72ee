"""A request's state as the engine sees it (plain Python), and what it hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from samebits.sampling_params import SamplingParams
from samebits.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from samebits.engine.grammar import GrammarState
    from samebits.engine.isolation import RequestError


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
    index: int = 0  # which choice of its prompt this sequence is (0 .. best_of - 1)
    stop_ids: frozenset[int] = frozenset()  # token ids that end it: EOS (unless ignored), stop ids
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
    grammar: GrammarState | None = None  # structured output: this request's matcher
    detokenizer: IncrementalDetokenizer | None = None  # the output's text, for stop strings
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
class CompletionOutput:
    """One generated sequence (one choice) of a request, vLLM's shape."""

    index: int  # its position in RequestOutput.outputs
    text: str
    token_ids: list[int]
    logprobs: list[float]  # raw-distribution logprob of each generated token, exact fp32 values
    top_logprobs: list[dict[int, float]]  # per token, the SamplingParams.logprobs most likely
    cumulative_logprob: float  # the sum of ``logprobs`` (float64, in order)
    finish_reason: str | None  # "stop" | "length" | "abort"
    seed: int  # the seed it was sampled with: SamplingParams(seed=seed) replays it alone

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, as ``LLM.generate`` returns it (design.md section 4, vLLM's shape):
    ``outputs`` holds its n choices."""

    request_id: str
    prompt: str | None  # the prompt text; None when it was given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # None unless SamplingParams.prompt_logprobs is set
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens its first sequence took from the prefix cache
    system_fingerprint: str
